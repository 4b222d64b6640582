"""The gateway's configuration: typed, frozen dataclasses built by one loader.

``load_config(path)`` reads YAML, expands ``${VAR}`` references, validates every section and
raises ``ConfigError`` with *all* problems at once. ``gateway check-config`` and ``gateway serve``
both call it, so an offline check is exactly the start-up check.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from .balancer import BalancerConfig, read_balancer
from .core import (
    ApiKeyConfig,
    AuthConfig,
    BackendConfig,
    HealthConfig,
    LimitsConfig,
    ServerConfig,
    TimeoutsConfig,
    UpstreamConfig,
    read_auth,
    read_backends,
    read_health,
    read_limits,
    read_server,
    read_timeouts,
    read_upstream,
)
from .fields import ConfigError, Problems, Section, expand_env
from .settings import internal, setting
from .disagg import ModelServing, check_serving, read_models
from .launch import LaunchGroup, read_launch
from .media import MediaConfig, read_media
from .state import StateConfig, read_state
from .operate import (
    DEFAULT_STATE_DIR,
    AdminConfig,
    CorsConfig,
    DiscoverConfig,
    LogConfig,
    TracingConfig,
    read_admin,
    read_discovery,
    read_log,
    read_tracing,
)

__all__ = [
    "AdminConfig",
    "CorsConfig",
    "DiscoverConfig",
    "LogConfig",
    "TracingConfig",
    "ApiKeyConfig",
    "AuthConfig",
    "BackendConfig",
    "BalancerConfig",
    "ConfigError",
    "GatewayConfig",
    "HealthConfig",
    "LaunchGroup",
    "LimitsConfig",
    "MediaConfig",
    "ServerConfig",
    "StateConfig",
    "TimeoutsConfig",
    "UpstreamConfig",
    "load_config",
    "parse_config",
]


@dataclass(frozen=True)
class GatewayConfig:
    """The gateway's configuration file."""

    server: ServerConfig = setting(doc="The public listener and its bounds.", default_factory=ServerConfig)
    auth: AuthConfig = setting(doc="API keys.", default_factory=AuthConfig)
    backends: tuple[BackendConfig, ...] = setting((), "api_servers by URL (or `{discover: ...}` entries) that the gateway does not launch.", alternative="discover")
    launch: tuple[LaunchGroup, ...] = setting((), "api_server instances the gateway starts and supervises, one group per model.")
    limits: LimitsConfig = setting(doc="Bounds on request bodies.", default_factory=LimitsConfig)
    timeouts: TimeoutsConfig = setting(doc="Upstream time bounds.", default_factory=TimeoutsConfig)
    health: HealthConfig = setting(doc="Health checks and ejection.", default_factory=HealthConfig)
    upstream: UpstreamConfig = setting(doc="Bounds on what backends send back.", default_factory=UpstreamConfig)
    balancer: BalancerConfig = setting(doc="How a backend is picked, and the gateway queue.", default_factory=BalancerConfig)
    media: MediaConfig = setting(doc="The media policy.", default_factory=MediaConfig)
    models: dict[str, ModelServing] = setting(doc="Per served model: serving mode and extra routes.", default_factory=dict)
    state: StateConfig = setting(doc="Where keys, limits, usage and shared load live.", default_factory=StateConfig)
    log: LogConfig = setting(doc="The gateway's log format.", default_factory=LogConfig)
    admin: AdminConfig = setting(doc="The admin listener; on when present.", default_factory=AdminConfig)
    tracing: TracingConfig = setting(doc="OpenTelemetry tracing.", default_factory=TracingConfig)
    discover: tuple[DiscoverConfig, ...] = setting((), "Backends found through DNS, written as `backends` entries `{discover: {...}}`.", where="backends[].discover")
    state_dir: str = setting(DEFAULT_STATE_DIR, "Folder for launched instances' logs (rotated); must be writable.")
    source: str = internal("<memory>")  # the file it was read from


def parse_config(data: Any, *, base_dir: Path | None = None, env: dict[str, str] | None = None, source: str = "<memory>") -> GatewayConfig:
    """Validate an already-loaded YAML tree; raise ConfigError listing every problem."""
    problems = Problems()
    data = expand_env(data, problems, "", env)
    root = Section(data, "", problems)
    base_dir = base_dir or Path.cwd()
    server = read_server(root.section("server"))
    auth = read_auth(root.section("auth"), base_dir)
    backends = read_backends(root)
    launch = read_launch(root, env)
    limits = read_limits(root.section("limits"))
    timeouts = read_timeouts(root.section("timeouts"))
    health = read_health(root.section("health"))
    upstream = read_upstream(root.section("upstream"))
    balancer = read_balancer(root.section("balancer"))
    media = read_media(root.section("media"))
    state = read_state(root.section("state"))
    log = read_log(root.section("log"))
    admin = read_admin(root.section("admin"), root.has("admin"))
    tracing = read_tracing(root.section("tracing"))
    discover = read_discovery(root)
    state_dir = root.str("state_dir", DEFAULT_STATE_DIR)
    models = read_models(root.section("models"))
    check_serving(models, launch, backends, problems)
    root.finish()
    if server is not None and not backends and not launch and not discover and not problems:
        problems.add("backends", "no backends: configure `backends` (URLs) or `launch` (instances to start)")
    problems.raise_if_any()
    return GatewayConfig(
        server=server,
        auth=auth,
        backends=backends,
        launch=launch,
        limits=limits,
        timeouts=timeouts,
        health=health,
        upstream=upstream,
        balancer=balancer,
        media=media,
        models=models,
        state=state,
        log=log,
        admin=admin,
        tracing=tracing,
        discover=discover,
        state_dir=state_dir,
        source=source,
    )


def load_config(path: str | os.PathLike[str], env: dict[str, str] | None = None) -> GatewayConfig:
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError([f"{p}: file not found"]) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError([f"{p}: cannot read ({exc.__class__.__name__}: {exc})"]) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or "invalid YAML"
        raise ConfigError([f"{p}: invalid YAML{where}: {problem}"]) from None
    return parse_config(data, base_dir=p.resolve().parent, env=env, source=str(p))
