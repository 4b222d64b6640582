"""Sections for operating the gateway: logs, CORS, the admin listener, tracing, discovery, state dir."""

from __future__ import annotations

import re
from dataclasses import dataclass

from .fields import Section

LOG_FORMATS = ("text", "json")
_HASH = re.compile(r"^sha256:[0-9a-f]{64}$")
_DNS_NAME = re.compile(r"^(?=.{1,253}$)[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\.?$")
DEFAULT_STATE_DIR = ".gateway"


@dataclass(frozen=True)
class LogConfig:
    format: str = "text"


@dataclass(frozen=True)
class CorsConfig:
    allow_origins: tuple[str, ...] = ()  # exact origins ("https://app.example.com") or "*"
    max_age: int = 600

    @property
    def enabled(self) -> bool:
        return bool(self.allow_origins)


@dataclass(frozen=True)
class AdminConfig:
    enabled: bool = False
    host: str = "127.0.0.1"
    port: int = 8081
    key_hash: str | None = None  # "sha256:<hex>" of the admin key


@dataclass(frozen=True)
class TracingConfig:
    enabled: bool = False
    service_name: str = "lmdeploy-gateway"
    otlp_endpoint: str | None = None  # e.g. http://otel-collector:4318/v1/traces; None: no export
    sample_ratio: float = 1.0
    trust_client_traceparent: bool = False


@dataclass(frozen=True)
class DiscoverConfig:
    dns: str
    port: int
    interval: float = 10.0
    scheme: str = "http"
    api_key: str | None = None
    models: tuple[str, ...] | None = None
    max_backends: int = 256  # a record set larger than this is cut (and logged): DNS is not trusted blindly


def read_log(s: Section) -> LogConfig:
    cfg = LogConfig(format=s.enum("format", LOG_FORMATS, "text"))
    s.finish()
    return cfg


def read_cors(s: Section) -> CorsConfig:
    origins = s.str_list("allow_origins", [])
    max_age = s.int("max_age", 600, min=0, max=86400)
    s.finish()
    good = []
    for i, origin in enumerate(origins):
        if origin == "*" or re.fullmatch(r"https?://[A-Za-z0-9.\-\[\]:]+", origin):
            good.append(origin)
        else:
            s.problems.add(f"{s.where('allow_origins')}[{i}]", f"{origin!r} is not an origin; write scheme://host[:port] with no path, or '*'")
    return CorsConfig(allow_origins=tuple(good), max_age=max_age)


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
    d = AdminConfig()
    host = s.str("host", d.host)
    port = s.int("port", d.port, min=0, max=65535)
    key_hash = read_hash(s, "key_hash")
    s.finish()
    if present and key_hash is None and not s.problems:
        s.error("key_hash", "required: the admin listener needs its own key (`gateway admin-key` makes one)")
    return AdminConfig(enabled=present and key_hash is not None, host=host, port=port, key_hash=key_hash)


def read_tracing(s: Section) -> TracingConfig:
    d = TracingConfig()
    cfg = TracingConfig(
        enabled=s.bool("enabled", d.enabled),
        service_name=s.str("service_name", d.service_name),
        otlp_endpoint=s.str("otlp_endpoint", None),
        sample_ratio=s.number("sample_ratio", d.sample_ratio, min=0, max=1),
        trust_client_traceparent=s.bool("trust_client_traceparent", d.trust_client_traceparent),
    )
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
        dns = s.str("dns")
        port = s.int("port", min=1, max=65535)
        interval = s.number("interval", 10.0, min=0.1)
        scheme = s.enum("scheme", ("http", "https"), "http")
        api_key = s.str("api_key", None)
        models = s.str_list("models", None)
        max_backends = s.int("max_backends", 256, min=1, max=4096)
        s.finish()
        if dns is not None and not _DNS_NAME.match(dns):
            s.error("dns", f"{dns!r} is not a DNS name")
            continue
        if dns is None or port is None:
            continue
        out.append(DiscoverConfig(dns=dns.rstrip("."), port=port, interval=interval, scheme=scheme, api_key=api_key, models=tuple(models) if models else None, max_backends=max_backends))
    return tuple(out)
