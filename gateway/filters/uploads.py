"""Per-key cap on request-body bytes being received at once (process-local).

A key may upload several bodies concurrently, but not more than ``limits.max_upload_bytes_per_key``
in total: sixteen concurrent 32 MB uploads on one key cannot hold half a gigabyte. A request
reserves its declared Content-Length before its first body byte is read (a chunked one reserves
as its chunks arrive) and gives the reservation back when the request is over.
"""

from __future__ import annotations

from ..errors import Refusal
from . import RequestContext

UPLOAD_BUSY = Refusal(
    429,
    "Too many request-body bytes are being uploaded at once with this API key; retry when an upload has finished.",
    "upload_budget",
    code="rate_limit_exceeded",
    headers=((b"retry-after", b"1"),),
)


class UploadGrant:
    __slots__ = ("budget", "who", "held")

    def __init__(self, budget: "UploadBudget", who: str, held: int):
        self.budget, self.who, self.held = budget, who, held

    def grow(self, size: int) -> bool:
        """Cover a body that has reached size bytes; False when the key's budget cannot."""
        if size <= self.held:
            return True
        if not self.budget._take(self.who, size - self.held):
            return False
        self.held = size
        return True

    def release(self) -> None:
        if self.held:
            self.budget._give(self.who, self.held)
            self.held = 0


class UploadBudget:
    def __init__(self, cap: int):
        self.cap = cap
        self.held: dict[str, int] = {}

    def grant(self, ctx: RequestContext) -> UploadGrant | None:
        """A reservation of the declared body length for this request's key, or None when over budget."""
        who = ctx.key.hash if ctx.key is not None else "-"
        length = ctx.headers.get(b"content-length")
        declared = int(length) if length is not None and length.isdigit() else 0
        if declared and not self._take(who, declared):
            return None
        return UploadGrant(self, who, declared)

    def _take(self, who: str, n: int) -> bool:
        held = self.held.get(who, 0)
        if held + n > self.cap:
            return False
        self.held[who] = held + n
        return True

    def _give(self, who: str, n: int) -> None:
        left = self.held.get(who, 0) - n
        if left > 0:
            self.held[who] = left
        else:
            self.held.pop(who, None)
