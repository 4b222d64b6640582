"""Core sections: server, auth, backends, limits, timeouts, health."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import yaml

from .fields import Section
from .balancer import DEFAULT_PRIORITY, parse_priority

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")

# Engine knobs a client must never set: they address sessions, caches or processors directly.
DEFAULT_DROP_FIELDS = (
    "session_id",
    "migration_request",
    "with_cache",
    "preserve_cache",
    "media_io_kwargs",
    "mm_processor_kwargs",
    "input_ids",
    "return_routed_experts",
)

_HASH = re.compile(r"^sha256:[0-9a-f]{64}$")


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8080
    log_level: str = "info"
    access_log: bool = False


@dataclass(frozen=True)
class ApiKeyConfig:
    name: str
    hash: str  # "sha256:<hex>" of the full key
    models: tuple[str, ...] | None = None  # None: every model
    media_allowed_domains: tuple[str, ...] | None = None  # None: the gateway's media policy
    rate_limit_rpm: int | None = None
    admin: bool = False  # may read the gateway's /metrics
    priority: int = DEFAULT_PRIORITY  # queue class: interactive (10), batch (0) or 0-100; higher is served first


@dataclass(frozen=True)
class AuthConfig:
    disabled: bool = False
    keys: tuple[ApiKeyConfig, ...] = ()


@dataclass(frozen=True)
class BackendConfig:
    url: str
    api_key: str | None = None
    models: tuple[str, ...] | None = None  # None: discovered from the backend's /v1/models
    name: str | None = None


@dataclass(frozen=True)
class LimitsConfig:
    max_body_bytes: int = 32 * 1024 * 1024
    max_json_depth: int = 32
    drop_fields: tuple[str, ...] = DEFAULT_DROP_FIELDS


@dataclass(frozen=True)
class TimeoutsConfig:
    connect: float = 5.0
    first_byte: float = 600.0  # prefill of a long prompt on a loaded GPU can take minutes
    idle: float = 120.0  # between two chunks of a stream
    drain: float = 30.0  # on shutdown


@dataclass(frozen=True)
class UpstreamConfig:
    transport: str = "native"  # see gateway/upstream.py; the others are there to be measured against
    max_connections: int = 4096


@dataclass(frozen=True)
class HealthConfig:
    interval: float = 2.0
    timeout: float = 2.0
    failures_to_eject: int = 3  # consecutive connect errors / 5xx before outlier ejection
    ejection_base: float = 5.0  # seconds; doubles on each repeated ejection


def read_server(s: Section) -> ServerConfig:
    d = ServerConfig()
    cfg = ServerConfig(
        host=s.str("host", d.host),
        port=s.int("port", d.port, min=0, max=65535),
        log_level=s.enum("log_level", LOG_LEVELS, d.log_level),
        access_log=s.bool("access_log", d.access_log),
    )
    s.finish()
    return cfg


def _read_key(s: Section, index: int) -> ApiKeyConfig | None:
    name = s.str("name", f"key-{index}")
    digest = s.str("hash")
    models = s.str_list("models", None)
    media = s.str_list("media_allowed_domains", None)
    rpm = s.int("rate_limit_rpm", None, min=1)
    admin = s.bool("admin", False)
    priority = parse_priority(s.raw("priority", DEFAULT_PRIORITY))
    if isinstance(priority, str):
        s.error("priority", priority)
        priority = DEFAULT_PRIORITY
    s.finish()
    if digest is None:
        return None
    norm = digest.strip().lower()
    if not _HASH.match(norm):
        if norm.startswith("sk-"):
            s.error("hash", "looks like a raw API key; store its hash instead (`gateway keys hash` prints it)")
        else:
            s.error("hash", f"{digest[:12]!r}... is not a key hash; expected 'sha256:' followed by 64 hex digits")
        return None
    return ApiKeyConfig(
        name=name,
        hash=norm,
        models=tuple(models) if models is not None else None,
        media_allowed_domains=tuple(media) if media is not None else None,
        rate_limit_rpm=rpm,
        admin=admin,
        priority=priority,
    )


def read_auth(s: Section, base_dir: Path) -> AuthConfig:
    disabled = s.bool("disabled", False)
    entries = s.sections("keys")
    keys = [k for i, sub in enumerate(entries) if (k := _read_key(sub, i)) is not None]
    keys_file = s.str("keys_file", None)
    if keys_file is not None:
        path = Path(keys_file)
        if not path.is_absolute():
            path = base_dir / path
        try:
            loaded = yaml.safe_load(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            s.error("keys_file", f"{keys_file!r} does not exist; create a key with `gateway keys create --file {keys_file}`")
            loaded = None
        except (OSError, yaml.YAMLError) as exc:
            s.error("keys_file", f"cannot read {keys_file!r}: {exc.__class__.__name__}")
            loaded = None
        if loaded is not None:
            sub = Section(loaded, f"{s.where('keys_file')}({keys_file})", s.problems)
            file_entries = sub.sections("keys")
            entries += file_entries
            keys += [k for i, ks in enumerate(file_entries) if (k := _read_key(ks, len(keys) + i)) is not None]
            sub.finish()
    s.finish()
    seen: dict[str, str] = {}
    for k in keys:
        if k.hash in seen:
            s.error("keys", f"keys {seen[k.hash]!r} and {k.name!r} have the same hash")
        seen[k.hash] = k.name
    if not entries and not disabled and keys_file is None:
        s.problems.add(
            "auth",
            "no API keys configured; add one with `gateway keys create`, or set `auth: {disabled: true}` to run without authentication",
        )
    return AuthConfig(disabled=bool(disabled), keys=tuple(keys))


def validate_backend_url(value: str, s: Section, key: str) -> str | None:
    """A backend base URL: http(s)://host[:port] with no path, query, fragment or userinfo."""
    try:
        parts = urlsplit(value.strip())
        port = parts.port
    except ValueError:
        s.error(key, f"{value!r} is not a valid URL")
        return None
    if parts.scheme not in ("http", "https"):
        s.error(key, f"{value!r} must start with http:// or https://")
        return None
    if not parts.hostname or "@" in parts.netloc:
        s.error(key, f"{value!r} must name a host and carry no user info")
        return None
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        s.error(key, f"{value!r} must be a base URL with no path, query or fragment")
        return None
    host = parts.hostname
    if ":" in host:
        host = f"[{host}]"
    return f"{parts.scheme}://{host}" + (f":{port}" if port else "")


def read_backends(root: Section) -> tuple[BackendConfig, ...]:
    out = []
    seen = set()
    for sub in root.sections("backends"):
        url = sub.str("url")
        api_key = sub.str("api_key", None)
        models = sub.str_list("models", None)
        name = sub.str("name", None)
        sub.finish()
        if url is None:
            continue
        base = validate_backend_url(url, sub, "url")
        if base is None:
            continue
        if base in seen:
            sub.error("url", f"{url!r} is listed twice")
            continue
        seen.add(base)
        out.append(BackendConfig(url=base, api_key=api_key, models=tuple(models) if models else None, name=name))
    return tuple(out)


def read_limits(s: Section) -> LimitsConfig:
    d = LimitsConfig()
    cfg = LimitsConfig(
        max_body_bytes=s.int("max_body_bytes", d.max_body_bytes, min=1024, max=1 << 31),
        max_json_depth=s.int("max_json_depth", d.max_json_depth, min=4, max=512),
        drop_fields=tuple(s.str_list("drop_fields", d.drop_fields)),
    )
    s.finish()
    return cfg


def read_timeouts(s: Section) -> TimeoutsConfig:
    d = TimeoutsConfig()
    cfg = TimeoutsConfig(
        connect=s.number("connect", d.connect, min=0, exclusive=True),
        first_byte=s.number("first_byte", d.first_byte, min=0, exclusive=True),
        idle=s.number("idle", d.idle, min=0, exclusive=True),
        drain=s.number("drain", d.drain, min=0),
    )
    s.finish()
    return cfg


def read_health(s: Section) -> HealthConfig:
    d = HealthConfig()
    cfg = HealthConfig(
        interval=s.number("interval", d.interval, min=0, exclusive=True),
        timeout=s.number("timeout", d.timeout, min=0, exclusive=True),
        failures_to_eject=s.int("failures_to_eject", d.failures_to_eject, min=1),
        ejection_base=s.number("ejection_base", d.ejection_base, min=0, exclusive=True),
    )
    s.finish()
    return cfg



TRANSPORTS = ("native", "aiohttp", "httpx-aiohttp", "httpx")


def read_upstream(s: Section) -> UpstreamConfig:
    d = UpstreamConfig()
    cfg = UpstreamConfig(
        transport=s.enum("transport", TRANSPORTS, d.transport),
        max_connections=s.int("max_connections", d.max_connections, min=1, max=1 << 20),
    )
    s.finish()
    return cfg
