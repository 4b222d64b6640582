"""Core sections: server, auth, backends, limits, timeouts, health."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import yaml

from ..media.url import DomainSet
from .fields import ConfigError, Problems, Section
from .media import read_domain_set
from .operate import CorsConfig, read_cors
from .balancer import DEFAULT_PRIORITY, parse_priority

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
HTTP_SERVERS = ("native", "uvicorn")

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
KEY_NAME = re.compile(r"^[A-Za-z0-9._@-]{1,64}$")
BUDGET_PERIODS = ("day", "month", "total")


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8080
    log_level: str = "info"
    access_log: bool = False
    http: str = "native"  # our HTTP/1.1 server (gateway/server); "uvicorn" is kept to be measured against
    # Bounded work per connection, enforced before any request reaches the app (gateway/server).
    max_request_line_bytes: int = 8 * 1024  # method + target + version: 414 above
    max_header_bytes: int = 64 * 1024  # request line and all headers together: 431 above
    max_headers: int = 100  # header lines, repeated ones included: 431 above
    header_timeout: float = 10.0  # from a request's first byte to the end of its headers: 408
    body_timeout: float = 60.0  # from the end of the headers to the end of the body: 408
    keepalive_timeout: float = 5.0  # a connection with no request in progress is closed after this
    max_connections: int = 0  # 0: from the open-files limit, leaving room for upstream connections
    linger_timeout: float = 5.0  # after an answer given before the body was read: drain, then close
    linger_bytes: int = 64 * 1024 * 1024  # most bytes drained that way
    cors: CorsConfig = CorsConfig()


@dataclass(frozen=True)
class ApiKeyConfig:
    name: str
    hash: str  # "sha256:<hex>" of the full key
    models: tuple[str, ...] | None = None  # None: every model
    media_allowed_domains: tuple[str, ...] | None = None  # None: the gateway's media policy
    rate_limit_rpm: int | None = None
    admin: bool = False  # may read the gateway's /metrics
    rate_limit_tpm: int | None = None  # prompt + completion tokens per minute
    max_concurrent: int | None = None  # requests in flight at once, over every replica
    budget_tokens: int | None = None  # tokens per budget_period; then 429 insufficient_quota
    budget_period: str = "month"  # day | month | total
    expires_at: float | None = None  # unix time; refused from then on
    disabled: bool = False  # revoked: kept for the record, refused
    created_at: float | None = None
    routes: tuple[str, ...] | None = None  # forwarded routes it may use; None: the OpenAI/Anthropic ones
    priority: int = DEFAULT_PRIORITY  # queue class: interactive (10), batch (0) or 0-100; higher is served first
    if TYPE_CHECKING:
        media_domains: DomainSet | None  # set by __post_init__; not a field, so records carry the texts only

    def __post_init__(self) -> None:
        # media_allowed_domains parsed once, when the key is made (gateway/media/url.py); a bad entry raises
        # ValueError here (config loading has reported it with its field by then).
        domains = DomainSet.parse(self.media_allowed_domains) if self.media_allowed_domains is not None else None
        object.__setattr__(self, "media_domains", domains)

    @property
    def limited(self) -> bool:
        return bool(self.rate_limit_rpm or self.rate_limit_tpm or self.max_concurrent or self.budget_tokens)


@dataclass(frozen=True)
class AuthConfig:
    disabled: bool = False
    keys: tuple[ApiKeyConfig, ...] = ()  # inline keys and the keys file's, together
    keys_file: str | None = None  # resolved path: reloaded on SIGHUP and when it changes
    inline_keys: tuple[ApiKeyConfig, ...] = ()  # the ones written in the config itself


@dataclass(frozen=True)
class BackendConfig:
    url: str
    api_key: str | None = None
    models: tuple[str, ...] | None = None  # None: discovered from the backend's /v1/models
    name: str | None = None
    role: str = "hybrid"  # hybrid | prefill | decode (PD disaggregation; see config/disagg.py)


@dataclass(frozen=True)
class LimitsConfig:
    max_body_bytes: int = 32 * 1024 * 1024
    max_json_depth: int = 32
    # Python objects cost 10x+ their JSON text: capped before parsing. 256 Ki values keep the worst
    # parse (one dict of that many keys) near 0.1 s of event loop on a 2-core machine.
    max_json_values: int = 262_144
    max_upload_bytes_per_key: int = 128 * 1024 * 1024  # request bodies being received at once, per key
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
    # Backends are untrusted: what they send back is bounded (gateway/upstream.py).
    max_response_bytes: int = 64 * 1024 * 1024  # a whole (non-streamed) response body
    max_header_bytes: int = 64 * 1024  # status line and headers together
    max_headers: int = 100
    max_line_bytes: int = 4 * 1024 * 1024  # a streamed response: bytes without a newline


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
        http=s.enum("http", HTTP_SERVERS, d.http),
        max_request_line_bytes=s.int("max_request_line_bytes", d.max_request_line_bytes, min=256, max=1 << 20),
        max_header_bytes=s.int("max_header_bytes", d.max_header_bytes, min=1024, max=16 << 20),
        max_headers=s.int("max_headers", d.max_headers, min=8, max=10_000),
        header_timeout=s.number("header_timeout", d.header_timeout, min=0, exclusive=True),
        body_timeout=s.number("body_timeout", d.body_timeout, min=0, exclusive=True),
        keepalive_timeout=s.number("keepalive_timeout", d.keepalive_timeout, min=0, exclusive=True),
        max_connections=s.int("max_connections", d.max_connections, min=0, max=1 << 20),
        linger_timeout=s.number("linger_timeout", d.linger_timeout, min=0),
        linger_bytes=s.int("linger_bytes", d.linger_bytes, min=0, max=1 << 40),
        cors=read_cors(s.section("cors")),
    )
    if cfg.max_request_line_bytes > cfg.max_header_bytes:
        s.error("max_request_line_bytes", f"{cfg.max_request_line_bytes} is larger than max_header_bytes ({cfg.max_header_bytes}), which includes the request line")
    s.finish()
    return cfg


def _read_key(s: Section, index: int) -> ApiKeyConfig | None:
    name = s.str("name", f"key-{index}")
    digest = s.str("hash")
    models = s.str_list("models", None)
    media = s.str_list("media_allowed_domains", None)
    media_domains = None
    if media is not None:
        owner = f" (key {name!r})"
        media_domains = read_domain_set(media, lambda j: f"{s.where('media_allowed_domains')}[{j}]", s, owner)
    rpm = s.int("rate_limit_rpm", None, min=1)
    admin = s.bool("admin", False)
    tpm = s.int("rate_limit_tpm", None, min=1)
    concurrent = s.int("max_concurrent", None, min=1, max=1_000_000)
    budget = s.int("budget_tokens", None, min=1)
    period = s.enum("budget_period", BUDGET_PERIODS, "month")
    expires = s.number("expires_at", None, min=0)
    disabled = s.bool("disabled", False)
    created = s.number("created_at", None, min=0)
    routes = s.str_list("routes", None)
    if routes is not None:
        from ..routes import KEY_ROUTE_CHOICES

        for i, r in enumerate(routes):
            if r not in KEY_ROUTE_CHOICES:
                s.problems.add(f"{s.where('routes')}[{i}]", f"{r!r} is not a forwarded route; choose from: {', '.join(KEY_ROUTE_CHOICES)}")
    priority = parse_priority(s.raw("priority", DEFAULT_PRIORITY))
    if isinstance(priority, str):
        s.error("priority", priority)
        priority = DEFAULT_PRIORITY
    s.finish()
    if not KEY_NAME.match(name):
        s.error("name", f"{name[:40]!r} is not a valid key name; use 1-64 letters, digits, '.', '_', '-' or '@'")
    if not isinstance(digest, str):  # missing (already reported) or not a string
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
        media_allowed_domains=media_domains.texts if media_domains is not None else None,
        rate_limit_rpm=rpm,
        admin=admin,
        rate_limit_tpm=tpm,
        max_concurrent=concurrent,
        budget_tokens=budget,
        budget_period=period,
        expires_at=expires,
        disabled=disabled,
        created_at=created,
        routes=tuple(routes) if routes is not None else None,
        priority=priority,
    )


def read_auth(s: Section, base_dir: Path) -> AuthConfig:
    disabled = s.bool("disabled", False)
    entries = s.sections("keys")
    keys = [k for i, sub in enumerate(entries) if (k := _read_key(sub, i)) is not None]
    inline = tuple(keys)
    keys_file = s.str("keys_file", None)
    path = None
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
    return AuthConfig(disabled=bool(disabled), keys=tuple(keys), keys_file=str(path) if path is not None else None, inline_keys=inline)


def read_key_entry(data: object, where: str = "key") -> ApiKeyConfig:
    """One key record (from the store or a file), validated as the config's keys are."""
    problems = Problems()
    key = _read_key(Section(data, where, problems), 0)
    problems.raise_if_any()
    assert key is not None
    return key


def read_keys_file(path: str) -> tuple[ApiKeyConfig, ...]:
    """The keys of a keys file alone, validated as at start-up (used to reload it)."""
    problems = Problems()
    try:
        loaded = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError([f"{path}: cannot read ({exc.__class__.__name__})"]) from None
    sub = Section(loaded, path, problems)
    keys = [k for i, ks in enumerate(sub.sections("keys")) if (k := _read_key(ks, i)) is not None]
    sub.finish()
    problems.raise_if_any()
    return tuple(keys)


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
        if sub.has("discover"):  # read by config.operate.read_discovery
            continue
        url = sub.str("url")
        api_key = sub.str("api_key", None)
        models = sub.str_list("models", None)
        name = sub.str("name", None)
        if name is not None and not (name.isprintable() and len(name) <= 128):
            # Names are backend ids in logs, metrics and the load exchange (whose extra fields start with NUL).
            sub.error("name", f"{name[:40]!r} is not a valid backend name; use up to 128 printable characters")
            name = None
        role = sub.enum("role", ("hybrid", "prefill", "decode"), "hybrid")
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
        out.append(BackendConfig(url=base, api_key=api_key, models=tuple(models) if models else None, name=name, role=role or "hybrid"))
    return tuple(out)


def read_limits(s: Section) -> LimitsConfig:
    d = LimitsConfig()
    cfg = LimitsConfig(
        max_body_bytes=s.int("max_body_bytes", d.max_body_bytes, min=1024, max=1 << 31),
        max_json_depth=s.int("max_json_depth", d.max_json_depth, min=4, max=512),
        max_json_values=s.int("max_json_values", d.max_json_values, min=1000, max=100_000_000),
        max_upload_bytes_per_key=s.int("max_upload_bytes_per_key", d.max_upload_bytes_per_key, min=1024, max=1 << 40),
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



TRANSPORTS = ("native", "aiohttp")  # gateway/upstream.py says why the httpx ones were dropped


def read_upstream(s: Section) -> UpstreamConfig:
    d = UpstreamConfig()
    cfg = UpstreamConfig(
        transport=s.enum("transport", TRANSPORTS, d.transport),
        max_connections=s.int("max_connections", d.max_connections, min=1, max=1 << 20),
        max_response_bytes=s.int("max_response_bytes", d.max_response_bytes, min=1024, max=1 << 34),
        max_header_bytes=s.int("max_header_bytes", d.max_header_bytes, min=1024, max=1 << 24),
        max_headers=s.int("max_headers", d.max_headers, min=8, max=10000),
        max_line_bytes=s.int("max_line_bytes", d.max_line_bytes, min=1024, max=1 << 30),
    )
    s.finish()
    return cfg
