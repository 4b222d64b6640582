"""API-key authentication, decided from the headers alone before any body byte is read.

Keys are stored as ``sha256:<hex>`` digests. A presented key is hashed and looked up; the
lookup is by digest, so its timing says nothing about any stored key, and the final equality is
``hmac.compare_digest``. Logs and metrics name a key by its configured name and a short id
derived from the digest, never by the key itself.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

from ..config import ApiKeyConfig, AuthConfig
from ..errors import Refusal
from . import RequestContext

_MISSING = Refusal(
    401,
    "Missing API key. Send it as 'Authorization: Bearer <key>' or 'x-api-key: <key>'.",
    "missing_api_key",
    code="invalid_api_key",
    headers=((b"www-authenticate", b"Bearer"),),
)
_INVALID = Refusal(401, "Invalid API key.", "invalid_api_key", code="invalid_api_key", headers=((b"www-authenticate", b"Bearer"),))
_MALFORMED = Refusal(
    401,
    "Malformed Authorization header; expected 'Bearer <key>'.",
    "malformed_authorization",
    code="invalid_api_key",
    headers=((b"www-authenticate", b"Bearer"),),
)
_AMBIGUOUS = Refusal(
    401,
    "More than one API key was sent; send exactly one.",
    "ambiguous_credentials",
    code="invalid_api_key",
    headers=((b"www-authenticate", b"Bearer"),),
)

KEY_PREFIX = "sk-"
_MAX_KEY_LEN = 256


def hash_key(key: str) -> str:
    return "sha256:" + hashlib.sha256(key.encode("utf-8")).hexdigest()


def key_id(digest: str) -> str:
    """A short, stable, non-secret name for logs: 8 hex digits of the stored digest."""
    return digest.removeprefix("sha256:")[:8]


def new_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


class ApiKeyAuth:
    def __init__(self, cfg: AuthConfig):
        self.disabled = cfg.disabled
        self._by_digest: dict[bytes, tuple[bytes, ApiKeyConfig]] = {}
        for k in cfg.keys:
            d = bytes.fromhex(k.hash.removeprefix("sha256:"))
            self._by_digest[d] = (d, k)

    def check(self, ctx: RequestContext) -> Refusal | None:
        if self.disabled or not ctx.route.auth:
            return None
        authz = ctx.headers.get(b"authorization")
        xkey = ctx.headers.get(b"x-api-key")
        if authz is None and xkey is None:
            return _MISSING
        token: bytes | None = None
        if authz is not None:
            if b"\x00" in authz:  # the header was sent more than once
                return _AMBIGUOUS
            scheme, _, rest = authz.partition(b" ")
            rest = rest.strip(b" ")
            if scheme.lower() != b"bearer" or not rest or b" " in rest:
                return _MALFORMED
            token = rest
        if xkey is not None:
            if b"\x00" in xkey:
                return _AMBIGUOUS
            xkey = xkey.strip(b" ")
            if token is not None and not hmac.compare_digest(token, xkey):
                return _AMBIGUOUS
            token = xkey
        if not token or len(token) > _MAX_KEY_LEN:
            return _INVALID
        digest = hashlib.sha256(token).digest()
        found = self._by_digest.get(digest)
        if found is None or not hmac.compare_digest(found[0], digest):
            return _INVALID
        ctx.key = found[1]
        return None


def model_allowed(key: ApiKeyConfig | None, model: str) -> bool:
    return key is None or key.models is None or model in key.models
