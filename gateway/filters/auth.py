"""API-key authentication, decided from the headers alone before any body byte is read.

Keys are stored as ``sha256:<hex>`` digests and read from the state layer's local cache (config
keys, the keys file, and the shared store's keys, kept current by pub/sub), never per request
from the store itself. A presented key is hashed and looked up; the
lookup is by digest, so its timing says nothing about any stored key, and the final equality is
``hmac.compare_digest``. Logs and metrics name a key by its configured name and a short id
derived from the digest, never by the key itself.
"""

from __future__ import annotations

import hashlib
import hmac
import time

from ..config import ApiKeyConfig, AuthConfig
from ..errors import Refusal
from ..state.keys import KeyCache
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

_MAX_KEY_LEN = 256

_EXPIRED = Refusal(401, "This API key has expired.", "expired_api_key", code="invalid_api_key", headers=((b"www-authenticate", b"Bearer"),))


class ApiKeyAuth:
    """Looks keys up in the state layer's local cache (``KeyCache``): no I/O per request."""

    def __init__(self, cfg: AuthConfig, keys: KeyCache | None = None):
        self.disabled = cfg.disabled
        self.keys = keys if keys is not None else KeyCache(cfg.keys)

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
        found = self.keys.lookup(digest)
        if found is None or not hmac.compare_digest(bytes.fromhex(found.hash[7:]), digest):
            return _INVALID
        if found.disabled:
            return _INVALID  # a revoked key reads as any unknown key
        if found.expires_at is not None and time.time() >= found.expires_at:
            return _EXPIRED
        ctx.key = found
        return None


def model_allowed(key: ApiKeyConfig | None, model: str) -> bool:
    return key is None or key.models is None or model in key.models
