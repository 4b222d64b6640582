"""Command line: ``gateway serve | check-config | keys | sim``.

``check-config`` runs exactly the validation ``serve`` runs. Configuration problems are printed
all at once, one per line, and exit with status 2: never a traceback.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

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
    from .app import Gateway

    logging.basicConfig(
        level=cfg.server.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    for noisy in ("httpx", "httpcore"):  # one line per health probe otherwise
        logging.getLogger(noisy).setLevel(max(logging.WARNING, logging.getLogger().level))
    host = args.host or cfg.server.host
    port = args.port if args.port is not None else cfg.server.port
    if cfg.server.http == "uvicorn":
        return _serve_uvicorn(cfg, host, port)
    from . import server

    # Bind before start-up: a busy port is reported at once, before any backend is launched.
    try:
        sockets = [server.bind(host, port)]
    except server.PortBusy as exc:
        print(f"gateway: {exc}", file=sys.stderr)
        return 1
    gateway = Gateway(cfg)
    return server.run(gateway.asgi(), cfg.server, drain=cfg.timeouts.drain, host=host, port=port, sockets=sockets)


def _serve_uvicorn(cfg: GatewayConfig, host: str, port: int) -> int:
    """uvicorn, kept only to be measured against (bench/overhead.py): it enforces none of server.max_*."""
    import uvicorn

    from .app import Gateway

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
        timeout_graceful_shutdown=int(cfg.timeouts.drain) or None,
        timeout_keep_alive=int(cfg.server.keepalive_timeout) or 1,
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


def cmd_keys_create(args: argparse.Namespace) -> int:
    from .filters.auth import hash_key, new_key

    key = new_key()
    digest = hash_key(key)
    entry = f'  - {{name: {args.name}, hash: "{digest}"}}'
    if args.file:
        path = Path(args.file)
        path.parent.mkdir(parents=True, exist_ok=True)
        existing = path.read_text(encoding="utf-8") if path.exists() else ""
        with path.open("a", encoding="utf-8") as f:
            if "keys:" not in existing:
                f.write("# API key hashes (sha256). The keys themselves are shown once, at creation, and never stored.\nkeys:\n")
            f.write(entry + "\n")
        os.chmod(path, 0o600)
        print(f"Created API key {args.name!r} (hash appended to {path}). It is shown once; store it now:\n\n    {key}\n")
    else:
        print(f"New API key {args.name!r}. It is shown once; store it now:\n\n    {key}\n")
        print("Paste this line under `auth: keys:` in your config:\n")
        print(entry)
    return 0


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
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("check-config", help="validate a config file exactly as serve does, and exit")
    p.add_argument("config")
    p.set_defaults(func=cmd_check_config)

    keys = sub.add_parser("keys", help="manage API keys").add_subparsers(dest="keys_command", required=True)
    p = keys.add_parser("create", help="create a random API key; print it once with its config line")
    p.add_argument("--name", default="default")
    p.add_argument("--file", default=None, help="append the hash to this keys file (see auth.keys_file)")
    p.set_defaults(func=cmd_keys_create)
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
