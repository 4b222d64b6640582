"""API keys: how a key is made and hashed, its stored record, the local cache auth reads, keys files.

A record is a plain mapping with the same fields as a key in the config (``name``, ``hash``,
``models``, ``rate_limit_rpm``, ...), so a keys file, a Redis entry and ``auth.keys`` all go
through one validator (``read_key_entry``). Keys files are written with PyYAML, never by string
formatting, so no name or model can inject YAML.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import secrets
import tempfile
import time
from pathlib import Path
from typing import Any, Iterable

import yaml

from ..config.core import KEY_NAME, ApiKeyConfig, read_key_entry

KEY_PREFIX = "sk-"
FILE_HEADER = "# API key hashes (sha256). The keys themselves are shown once, at creation, and never stored.\n"

_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ApiKeyConfig) if f.default is not dataclasses.MISSING}


def new_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def hash_key(key: str) -> str:
    """The stored form of a key (``sha256:<hex>``); the key itself is never stored."""
    return "sha256:" + hashlib.sha256(key.encode("utf-8")).hexdigest()


def key_id(digest: str) -> str:
    """A short, stable, non-secret name for logs: 8 hex digits of the stored digest."""
    return digest.removeprefix("sha256:")[:8]


def key_to_record(key: ApiKeyConfig) -> dict[str, Any]:
    """The non-default fields of a key, in a stable order (YAML- and JSON-safe)."""
    out: dict[str, Any] = {"name": key.name, "hash": key.hash}
    for f in dataclasses.fields(ApiKeyConfig):
        if f.name in out:
            continue
        value = getattr(key, f.name)
        if value == _DEFAULTS.get(f.name, object()):
            continue
        out[f.name] = list(value) if isinstance(value, tuple) else value
    return out


def key_from_record(data: Any, where: str = "key") -> ApiKeyConfig:
    """Raises ConfigError naming the bad field."""
    return read_key_entry(data, where)


def valid_name(name: str) -> bool:
    return bool(KEY_NAME.match(name))


def usable(key: ApiKeyConfig, now: float | None = None) -> str | None:
    """None when the key may be used; otherwise why not ("revoked" or "expired")."""
    if key.disabled:
        return "revoked"
    if key.expires_at is not None and (now if now is not None else time.time()) >= key.expires_at:
        return "expired"
    return None


class KeyCache:
    """Digest -> key, read by auth on every request with no I/O.

    Two layers: the config's keys (inline plus the keys file, replaced on reload) and the
    store's keys (replaced or patched when the store says they changed). A key in the store
    wins over a config key with the same hash.
    """

    def __init__(self, config_keys: Iterable[ApiKeyConfig] = ()) -> None:
        self._config: dict[bytes, ApiKeyConfig] = {}
        self._store: dict[bytes, ApiKeyConfig] = {}
        self._merged: dict[bytes, ApiKeyConfig] = {}
        self.set_config_keys(config_keys)

    @staticmethod
    def digest(key: ApiKeyConfig) -> bytes:
        return bytes.fromhex(key.hash.removeprefix("sha256:"))

    def lookup(self, digest: bytes) -> ApiKeyConfig | None:
        return self._merged.get(digest)

    def set_config_keys(self, keys: Iterable[ApiKeyConfig]) -> None:
        self._config = {self.digest(k): k for k in keys}
        self._merge()

    def set_store_keys(self, keys: Iterable[ApiKeyConfig]) -> None:
        self._store = {self.digest(k): k for k in keys}
        self._merge()

    def put_store_key(self, digest_hex: str, key: ApiKeyConfig | None) -> None:
        d = bytes.fromhex(digest_hex.removeprefix("sha256:"))
        if key is None:
            self._store.pop(d, None)
        else:
            self._store[d] = key
        self._merge()

    def _merge(self) -> None:
        merged = dict(self._config)
        merged.update(self._store)
        self._merged = merged  # one assignment: a reader never sees a half-built dict

    def all(self) -> list[ApiKeyConfig]:
        return list(self._merged.values())

    @property
    def any_limited(self) -> bool:
        return any(k.limited for k in self._merged.values())


# -- keys files ------------------------------------------------------------------------------------
def read_file_records(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    if not isinstance(data, dict) or not isinstance(data.get("keys", []), list):
        raise ValueError(f"{path}: expected a mapping with a `keys:` list")
    return list(data.get("keys") or [])


def write_file_records(path: Path, records: list[dict[str, Any]]) -> None:
    """Atomically replace the file (0600), so a reloading gateway never reads half of it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    text = FILE_HEADER + yaml.safe_dump({"keys": records}, sort_keys=False, allow_unicode=False, default_flow_style=False)
    fd, tmp = tempfile.mkstemp(prefix=".keys-", dir=str(path.parent))
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
