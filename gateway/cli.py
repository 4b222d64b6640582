"""Command line: ``gateway serve | check-config | keys | usage | sim``.

``check-config`` runs exactly the validation ``serve`` runs. Configuration problems are printed
all at once, one per line, and exit with status 2: never a traceback.
"""

from __future__ import annotations

import argparse
import logging
import dataclasses
import os
import sys

from .config import ConfigError, GatewayConfig, load_config

EXIT_CONFIG = 2


def _load(path: str) -> GatewayConfig | None:
    try:
        return load_config(path)
    except ConfigError as exc:
        n = len(exc.problems)
        print(f"{path}: {n} configuration problem{'s' if n != 1 else ''}:", file=sys.stderr)
        for p in exc.problems:
            print(f"  - {p}", file=sys.stderr)
        return None


def cmd_check_config(args: argparse.Namespace) -> int:
    cfg = _load(args.config)
    if cfg is None:
        return EXIT_CONFIG
    print(f"{args.config}: OK ({len(cfg.backends)} remote backend(s), {len(cfg.launch)} launch group(s), {len(cfg.auth.keys)} key(s))")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    cfg = _load(args.config)
    if cfg is None:
        return EXIT_CONFIG
    import uvicorn

    from .app import Gateway

    from . import logs

    logs.configure(cfg.log.format, cfg.server.log_level)
    if args.state_dir:
        cfg = dataclasses.replace(cfg, state_dir=args.state_dir)
    host = args.host or cfg.server.host
    port = args.port if args.port is not None else cfg.server.port
    gateway = Gateway(cfg)
    config = uvicorn.Config(
        gateway.asgi(),
        host=host,
        port=port,
        loop="uvloop",
        http="httptools",
        lifespan="on",
        access_log=False,  # ours (server.access_log) names keys by id and never logs query strings
        log_level=cfg.server.log_level,
        log_config=None,  # uvicorn's lines go through our handler (and format) too
        timeout_graceful_shutdown=int(cfg.timeouts.drain) or None,
        server_header=False,
        date_header=False,
        proxy_headers=False,
    )
    server = uvicorn.Server(config)
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn re-raises Ctrl-C after its clean shutdown
        return 130
    return 0 if server.started else 1


def cmd_keys_hash(args: argparse.Namespace) -> int:
    from .filters.auth import hash_key

    key = sys.stdin.readline().strip() if args.key == "-" else args.key
    print(hash_key(key))
    return 0


def cmd_sim(argv: list[str]) -> int:
    from .sim.__main__ import main as sim_main

    return sim_main(argv) or 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gateway", description="lmdeploy-gateway: a secure, fast front door for lmdeploy api_server backends")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="run the gateway")
    p.add_argument("--config", "-c", required=True, help="YAML config file")
    p.add_argument("--host", default=None, help="override server.host")
    p.add_argument("--port", type=int, default=None, help="override server.port")
    p.add_argument("--state-dir", default=None, help="override state_dir: where launched instances' logs go (must be writable)")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("check-config", help="validate a config file exactly as serve does, and exit")
    p.add_argument("config")
    p.set_defaults(func=cmd_check_config)

    keys = sub.add_parser("keys", help="manage API keys").add_subparsers(dest="keys_command", required=True)
    from .state.admin import add_commands as add_key_commands

    add_key_commands(keys, sub)  # create|list|show|revoke|update, and `gateway usage` (gateway/state/admin.py)
    p = keys.add_parser("hash", help="print the stored form of an existing key ('-' reads it from stdin)")
    p.add_argument("key")
    p.set_defaults(func=cmd_keys_hash)

    sub.add_parser("sim", help="run the simulated api_server (see `gateway sim --help`)", add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "sim":
        return cmd_sim(argv[1:])
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
