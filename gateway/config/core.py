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
from .settings import internal, read_fields, setting
from .media import read_domain_set
from .operate import CorsConfig, read_cors
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
KEY_NAME = re.compile(r"^[A-Za-z0-9._@-]{1,64}$")
BUDGET_PERIODS = ("day", "month", "total")


@dataclass(frozen=True)
class ServerConfig:
    """The public listener. Every bound holds per connection before a request reaches the app, with or without a key."""

    RETIRED = {"http": "the gateway has one HTTP server (its own, which enforces the server.max_* bounds); remove this line"}

    host: str = setting("127.0.0.1", "Address to listen on; `0.0.0.0` for every interface.")
    port: int = setting(8080, "Port to listen on.", min=0, max=65535)
    log_level: str = setting("info", "The gateway's log level.", choices=LOG_LEVELS)
    access_log: bool = setting(False, "One line per request (id, key name, model, backend, status, seconds); never the key or the body.")
    max_request_line_bytes: int = setting(8 * 1024, "Method, target and version together; longer gets 414.", min=256, max=1 << 20)
    max_header_bytes: int = setting(64 * 1024, "Request line and all headers together; more gets 431.", min=1024, max=16 << 20)
    max_headers: int = setting(100, "Header lines, repeated ones included; more gets 431.", min=8, max=10_000)
    header_timeout: float = setting(10.0, "Seconds from a request's first byte to the end of its headers; then 408.", min=0, exclusive=True)
    body_timeout: float = setting(60.0, "Seconds from the end of the headers to the end of the body; then 408.", min=0, exclusive=True)
    keepalive_timeout: float = setting(5.0, "Seconds an idle keep-alive connection stays open.", min=0, exclusive=True)
    max_connections: int = setting(0, "Client connections at once; 0: from the open-files limit, leaving room for upstream connections.", min=0, max=1 << 20)
    linger_timeout: float = setting(5.0, "Seconds to drain an unread body after an early answer (a 413, a 401) before closing.", min=0)
    linger_bytes: int = setting(64 * 1024 * 1024, "Most bytes drained that way.", min=0, max=1 << 40)
    cors: CorsConfig = setting(CorsConfig(), "Cross-origin requests from browser pages.")


@dataclass(frozen=True)
class ApiKeyConfig:
    """One API key: only its hash is stored (`gateway keys create` prints the key once and writes the entry)."""

    name: str = setting(doc="Who holds it, in logs and metrics: 1-64 letters, digits, `.`, `_`, `-`, `@`.", shown_default="`key-<n>`")
    hash: str = setting(doc="`sha256:<hex>` of the full key (`gateway keys hash` prints it); never the key itself.", custom={"type": "string", "pattern": "^sha256:[0-9a-fA-F]{64}$"}, type_name="key hash")
    models: tuple[str, ...] | None = setting(None, "Models it may use; unset: every model.")
    media_allowed_domains: tuple[str, ...] | None = setting(None, "Replaces `media.allowed_domains` for this key (same grammar); unset: the gateway's list.", custom={"type": ["array", "string"], "items": {"type": "string"}}, type_name="list of domain entries")
    rate_limit_rpm: int | None = setting(None, "Requests per minute, over every replica; then 429.", min=1)
    admin: bool = setting(False, "May read the gateway's /metrics.")
    rate_limit_tpm: int | None = setting(None, "Prompt + completion tokens per minute; then 429.", min=1)
    max_concurrent: int | None = setting(None, "Requests in flight at once, over every replica; then 429.", min=1, max=1_000_000)
    budget_tokens: int | None = setting(None, "Tokens per `budget_period`; then 429 `insufficient_quota`.", min=1)
    budget_period: str = setting("month", "The period `budget_tokens` counts over.", choices=BUDGET_PERIODS)
    expires_at: float | None = setting(None, "Unix time from which the key is refused.", min=0)
    disabled: bool = setting(False, "Revoked: kept for the record, refused.")
    created_at: float | None = setting(None, "Unix time it was made (written by `gateway keys create`).", min=0)
    routes: tuple[str, ...] | None = setting(None, "Forwarded routes it may use; unset: the OpenAI and Anthropic ones.")
    priority: int = setting(DEFAULT_PRIORITY, "Queue class: `interactive` (10), `batch` (0) or a number 0-100; higher is served first.", custom={"anyOf": [{"enum": ["interactive", "batch"]}, {"type": "integer", "minimum": 0, "maximum": 100}]}, type_name="`interactive` \\| `batch` \\| 0-100", shown_default="`interactive`")
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
    """API keys. Every route needs one unless `disabled` is set."""

    disabled: bool = setting(False, "Run without authentication (a private test set-up only).")
    keys: tuple[ApiKeyConfig, ...] = setting((), "Keys written in the config itself (the keys file's are added to them).")
    keys_file: str | None = setting(None, "A YAML file of `keys:` (relative to the config); reloaded when it changes and on SIGHUP.")
    inline_keys: tuple[ApiKeyConfig, ...] = internal(())  # the ones written in the config itself; `keys` holds both


@dataclass(frozen=True)
class BackendConfig:
    """An api_server the gateway does not launch, by URL (or, as `{discover: ...}`, found through DNS)."""

    url: str = setting(doc="Base URL, `http(s)://host[:port]`, no path.")
    api_key: str | None = setting(None, "The api_server's own `--api-keys` value, if it has one.")
    models: tuple[str, ...] | None = setting(None, "Models it serves; unset: asked from its /v1/models.")
    name: str | None = setting(None, "Its id in logs, metrics and the status page; default: the URL.")
    role: str = setting("hybrid", "`prefill` or `decode` for PD disaggregation (the model's `serving: distserve`).", choices=("hybrid", "prefill", "decode"))


@dataclass(frozen=True)
class LimitsConfig:
    """Bounds on request bodies, checked before parsing."""

    max_body_bytes: int = setting(32 * 1024 * 1024, "A request body; larger gets 413.", min=1024, max=1 << 31)
    max_json_depth: int = setting(32, "Nesting depth of a JSON body; deeper gets 400.", min=4, max=512)
    # Python objects cost 10x+ their JSON text: capped before parsing. 256 Ki values keep the worst
    # parse (one dict of that many keys) near 0.1 s of event loop on a 2-core machine.
    max_json_values: int = setting(262_144, "Values (strings, numbers, items) in a JSON body; more gets 400.", min=1000, max=100_000_000)
    max_upload_bytes_per_key: int = setting(128 * 1024 * 1024, "Request bodies being received at once per key; more gets 429.", min=1024, max=1 << 40)
    drop_fields: tuple[str, ...] = setting(DEFAULT_DROP_FIELDS, "Body fields removed before forwarding: engine knobs a client must never set (sessions, caches, processors).")


@dataclass(frozen=True)
class TimeoutsConfig:
    """Upstream time bounds (seconds)."""

    connect: float = setting(5.0, "To connect to a backend; then the next backend is tried.", min=0, exclusive=True)
    first_byte: float = setting(600.0, "From sending a request to its first byte (a long prompt's prefill on a loaded GPU takes minutes).", min=0, exclusive=True)
    idle: float = setting(120.0, "Between two chunks of a stream.", min=0, exclusive=True)
    drain: float = setting(30.0, "On shutdown, for requests in flight to finish.", min=0)


@dataclass(frozen=True)
class UpstreamConfig:
    """Backends are untrusted: what they send back is bounded (a backend over a bound gets the client a 502)."""

    RETIRED = {
        "transport": "the gateway has one upstream client (the native one); remove this line",
        "max_connections": "it bounded the aiohttp client, which is gone; remove this line",
    }

    max_response_bytes: int = setting(64 * 1024 * 1024, "A whole (non-streamed) response body.", min=1024, max=1 << 34)
    max_header_bytes: int = setting(64 * 1024, "Status line and headers together.", min=1024, max=1 << 24)
    max_headers: int = setting(100, "Header lines of a response.", min=8, max=10000)
    max_line_bytes: int = setting(4 * 1024 * 1024, "A streamed response: bytes without a newline.", min=1024, max=1 << 30)


@dataclass(frozen=True)
class HealthConfig:
    """Active health checks (`/health` of every backend) and outlier ejection."""

    interval: float = setting(2.0, "Seconds between checks of a backend.", min=0, exclusive=True)
    timeout: float = setting(2.0, "Seconds a check may take.", min=0, exclusive=True)
    failures_to_eject: int = setting(3, "Consecutive connect errors or 5xx before a backend is ejected.", min=1)
    ejection_base: float = setting(5.0, "Seconds of the first ejection; doubles on each repeated one.", min=0, exclusive=True)


def read_server(s: Section) -> ServerConfig:
    cfg = ServerConfig(**read_fields(ServerConfig, s), cors=read_cors(s.section("cors")))
    if cfg.max_request_line_bytes > cfg.max_header_bytes:
        s.error("max_request_line_bytes", f"{cfg.max_request_line_bytes} is larger than max_header_bytes ({cfg.max_header_bytes}), which includes the request line")
    s.finish()
    return cfg


def _read_key(s: Section, index: int) -> ApiKeyConfig | None:
    v = read_fields(ApiKeyConfig, s, defaults={"name": f"key-{index}"})
    name, models, routes = v["name"], v["models"], v["routes"]
    digest = s.str("hash")
    media = s.str_list("media_allowed_domains", None)
    media_domains = None
    if media is not None:
        owner = f" (key {name!r})"
        media_domains = read_domain_set(media, lambda j: f"{s.where('media_allowed_domains')}[{j}]", s, owner)
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
        **v,
        hash=norm,
        media_allowed_domains=media_domains.texts if media_domains is not None else None,
        priority=priority,
    )


def read_auth(s: Section, base_dir: Path) -> AuthConfig:
    v = read_fields(AuthConfig, s)
    disabled, keys_file = v["disabled"], v["keys_file"]
    entries = s.sections("keys")
    keys = [k for i, sub in enumerate(entries) if (k := _read_key(sub, i)) is not None]
    inline = tuple(keys)
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
        v = read_fields(BackendConfig, sub)
        url, name = v["url"], v["name"]
        if name is not None and not (name.isprintable() and len(name) <= 128):
            # Names are backend ids in logs, metrics and the load exchange (whose extra fields start with NUL).
            sub.error("name", f"{name[:40]!r} is not a valid backend name; use up to 128 printable characters")
            name = None
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
        out.append(BackendConfig(**{**v, "url": base, "models": v["models"] or None, "name": name, "role": v["role"] or "hybrid"}))
    return tuple(out)


def read_limits(s: Section) -> LimitsConfig:
    cfg = LimitsConfig(**read_fields(LimitsConfig, s))
    s.finish()
    return cfg


def read_timeouts(s: Section) -> TimeoutsConfig:
    cfg = TimeoutsConfig(**read_fields(TimeoutsConfig, s))
    s.finish()
    return cfg


def read_health(s: Section) -> HealthConfig:
    cfg = HealthConfig(**read_fields(HealthConfig, s))
    s.finish()
    return cfg



def read_upstream(s: Section) -> UpstreamConfig:
    cfg = UpstreamConfig(**read_fields(UpstreamConfig, s))
    s.finish()
    return cfg
