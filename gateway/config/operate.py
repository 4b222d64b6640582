"""Sections for operating the gateway: logs, CORS, the admin listener, tracing, discovery, state dir."""

from __future__ import annotations

import re
from dataclasses import dataclass

from .fields import Section
from .settings import internal, read_fields, setting

LOG_FORMATS = ("text", "json")
_HASH = re.compile(r"^sha256:[0-9a-f]{64}$")
_DNS_NAME = re.compile(r"^(?=.{1,253}$)[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\.?$")
DEFAULT_STATE_DIR = ".gateway"


@dataclass(frozen=True)
class LogConfig:
    """The gateway's own log lines (launched instances log to files under ``state_dir``)."""

    format: str = setting("text", "`text` for people, `json` (one object per line) for a log pipeline.", choices=LOG_FORMATS)


@dataclass(frozen=True)
class CorsConfig:
    """Cross-origin requests from browsers; off while ``allow_origins`` is empty."""

    allow_origins: tuple[str, ...] = setting((), "Origins a browser page may call from: exact `scheme://host[:port]` or `*`.")
    max_age: int = setting(600, "Seconds a browser may cache a preflight answer.", min=0, max=86400)

    @property
    def enabled(self) -> bool:
        return bool(self.allow_origins)


@dataclass(frozen=True)
class AdminConfig:
    """The admin listener (status page, /admin API) on its own port; on when the section is present."""

    enabled: bool = internal(False)  # the section is present and has a key
    host: str = setting("127.0.0.1", "Address the admin listener binds; keep it private.")
    port: int = setting(8081, "Port of the admin listener.", min=0, max=65535)
    key_hash: str | None = setting(None, "`sha256:<hex>` of the admin key (`gateway admin-key` makes one); required when the section is present.", custom={"type": "string", "pattern": "^sha256:[0-9a-fA-F]{64}$"}, type_name="key hash")


@dataclass(frozen=True)
class TracingConfig:
    """OpenTelemetry spans per request."""

    enabled: bool = setting(False, "Record a span per request (and per upstream attempt).")
    service_name: str = setting("lmdeploy-gateway", "The `service.name` the spans carry.")
    otlp_endpoint: str | None = setting(None, "OTLP/HTTP traces URL, e.g. `http://otel-collector:4318/v1/traces`; unset: spans are not exported.")
    sample_ratio: float = setting(1.0, "Share of requests traced.", min=0, max=1)
    trust_client_traceparent: bool = setting(False, "Continue a client's `traceparent` instead of starting a new trace.")


@dataclass(frozen=True)
class DiscoverConfig:
    """Backends found through DNS: every address a name resolves to, re-resolved every ``interval``."""

    dns: str = setting(doc="The DNS name whose A/AAAA records are the backends, e.g. a headless Kubernetes service.")
    port: int = setting(doc="The api_servers' port.", min=1, max=65535)
    interval: float = setting(10.0, "Seconds between resolutions; backends that left are drained.", min=0.1)
    scheme: str = setting("http", "How to reach them.", choices=("http", "https"))
    api_key: str | None = setting(None, "The api_servers' own `--api-keys` value, if they have one.")
    models: tuple[str, ...] | None = setting(None, "Models they serve; unset: asked from each one's /v1/models.")
    max_backends: int = setting(256, "A record set larger than this is cut (and logged): DNS is not trusted blindly.", min=1, max=4096)


def read_log(s: Section) -> LogConfig:
    cfg = LogConfig(**read_fields(LogConfig, s))
    s.finish()
    return cfg


def read_cors(s: Section) -> CorsConfig:
    v = read_fields(CorsConfig, s)
    s.finish()
    good = []
    for i, origin in enumerate(v["allow_origins"]):
        if origin == "*" or re.fullmatch(r"https?://[A-Za-z0-9.\-\[\]:]+", origin):
            good.append(origin)
        else:
            s.problems.add(f"{s.where('allow_origins')}[{i}]", f"{origin!r} is not an origin; write scheme://host[:port] with no path, or '*'")
    return CorsConfig(allow_origins=tuple(good), max_age=v["max_age"])


def read_hash(s: Section, key: str) -> str | None:
    digest = s.str(key, None)
    if digest is None:
        return None
    norm = digest.strip().lower()
    if _HASH.match(norm):
        return norm
    if norm.startswith("sk-"):
        s.error(key, "looks like a raw key; store its hash instead (`gateway keys hash` prints it)")
    else:
        s.error(key, f"{digest[:12]!r}... is not a key hash; expected 'sha256:' followed by 64 hex digits")
    return None


def read_admin(s: Section, present: bool) -> AdminConfig:
    v = read_fields(AdminConfig, s)
    key_hash = read_hash(s, "key_hash")
    s.finish()
    if present and key_hash is None and not s.problems:
        s.error("key_hash", "required: the admin listener needs its own key (`gateway admin-key` makes one)")
    return AdminConfig(enabled=present and key_hash is not None, key_hash=key_hash, **v)


def read_tracing(s: Section) -> TracingConfig:
    cfg = TracingConfig(**read_fields(TracingConfig, s))
    s.finish()
    if cfg.otlp_endpoint is not None and not re.match(r"^https?://", cfg.otlp_endpoint):
        s.error("otlp_endpoint", f"{cfg.otlp_endpoint!r} must be an http:// or https:// URL")
    return cfg


def read_discovery(root: Section) -> tuple[DiscoverConfig, ...]:
    """The ``backends`` entries of the form ``{discover: {dns, port, ...}}`` (the others are URLs)."""
    out = []
    for entry in root.sections("backends"):
        if not entry.has("discover"):
            continue
        s = entry.section("discover")
        entry.finish()
        v = read_fields(DiscoverConfig, s)
        dns, port, models = v["dns"], v["port"], v["models"]
        s.finish()
        if dns is not None and not _DNS_NAME.match(dns):
            s.error("dns", f"{dns!r} is not a DNS name")
            continue
        if dns is None or port is None:
            continue
        out.append(DiscoverConfig(**{**v, "dns": dns.rstrip("."), "models": models or None}))
    return tuple(out)
