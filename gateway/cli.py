"""Command line: ``gateway serve | check-config | config | keys | usage | sim``.

``check-config`` runs exactly the validation ``serve`` runs. Configuration problems are printed
all at once, one per line, and exit with status 2: never a traceback.
"""

from __future__ import annotations

import argparse
import logging
import dataclasses
import signal
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


def cmd_config(args: argparse.Namespace) -> int:
    from .config.reference import reference, schema_text

    sys.stdout.write(reference() if args.what == "reference" else schema_text())
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    cfg = _load(args.config)
    if cfg is None:
        return EXIT_CONFIG
    from .app import Gateway

    from . import logs

    logs.configure(cfg.log.format, cfg.server.log_level)
    if args.state_dir:
        cfg = dataclasses.replace(cfg, state_dir=args.state_dir)
    host = args.host or cfg.server.host
    port = args.port if args.port is not None else cfg.server.port
    if args.pin_workers and args.workers == 1 and args.worker_index is None:
        from .workers import refusal

        print(f"error: {refusal(cfg, 1, pin=True)}", file=sys.stderr)
        return 2
    if args.workers != 1 and args.worker_index is None:  # the parent of --workers N: supervises only
        from .workers import supervise

        return supervise(args, cfg, host, port)
    internal_key = None
    if args.internal_key_fd is not None:  # from the --workers parent: the key of the launched api_servers
        internal_key = _read_key_pipe(args.internal_key_fd)
    if args.worker_index:  # one admin listener per host: worker 0's
        cfg = dataclasses.replace(cfg, admin=dataclasses.replace(cfg.admin, enabled=False))
    busy = _busy_ports([(cfg.admin.host, cfg.admin.port)] if cfg.admin.enabled else [])
    if busy:  # before anything starts or is announced
        print(f"gateway serve: {busy}; is another gateway running? Stop it, or choose another port (admin.port)", file=sys.stderr)
        return 1
    signal.signal(signal.SIGHUP, _on_sighup)  # a closed terminal must not stop the gateway without a word
    from . import server

    if args.worker_index is not None:  # one of N workers: its own SO_REUSEPORT socket on the shared port
        from .workers import worker_setup

        cfg, sock = worker_setup(cfg, args.worker_index, host, port)
        sockets = [sock]
    else:
        # Bind before start-up: a busy port is reported at once, before any backend is launched.
        try:
            sockets = [server.bind(host, port)]
        except server.PortBusy as exc:
            print(f"gateway serve: {exc}", file=sys.stderr)
            return 1
    gateway = Gateway(cfg)
    gateway.follow_backends = bool(args.worker_index)  # workers > 0 learn launched backends from worker 0
    gateway.internal_key = internal_key
    if args.pin_workers and args.worker_index is not None:
        from .workers import pin_worker

        gateway.launch_cpus = pin_worker(args.worker_index)
    return server.run(gateway.asgi(), cfg.server, drain=cfg.timeouts.drain, host=host, port=port, sockets=sockets)


def _read_key_pipe(fd: int) -> str:
    from .launcher.shim import read_key  # the one reader of a key pipe (it also validates the key)

    try:
        return read_key(fd)
    except (SystemExit, OSError) as exc:
        raise SystemExit(f"gateway serve: no usable internal key on --internal-key-fd {fd} ({exc}); only `gateway serve --workers N` sets it") from None


def cmd_keys_hash(args: argparse.Namespace) -> int:
    from .state.keys import hash_key

    key = sys.stdin.readline().strip() if args.key == "-" else args.key
    print(hash_key(key))
    return 0


def _busy_ports(addresses: list[tuple[str, int]]) -> str | None:
    from .admin.server import bind

    for host, port in addresses:
        if port == 0:
            continue
        try:
            bind(host, port).close()
        except OSError as exc:
            return str(exc)
    return None


def _on_sighup(signum: int, frame: object) -> None:
    logging.getLogger("gateway").warning(
        "SIGHUP (the terminal closed?): the gateway keeps running; stop it with Ctrl-C or SIGTERM"
        " (with auth.keys_file set, SIGHUP reloads the keys file instead)"
    )


def cmd_admin_key(args: argparse.Namespace) -> int:
    """A new admin-listener key, as env-file lines: the key for you (and Prometheus), its hash for the config."""
    from .state.keys import hash_key, new_key

    key = new_key()
    print(f"ADMIN_KEY={key}\nADMIN_KEY_HASH={hash_key(key)}")
    print("# Keep ADMIN_KEY secret (it opens the admin listener); put ADMIN_KEY_HASH in the config:"
          ' admin: {key_hash: "${ADMIN_KEY_HASH}"}', file=sys.stderr)
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
    p.add_argument("--workers", type=int, default=1, help="processes serving the port (needs state.redis_url when more than 1)")
    p.add_argument("--pin-workers", action="store_true",
                   help="with --workers N: run each worker on its own CPU (worker i on the i-th the gateway may use); launched api_servers keep all of them")
    p.add_argument("--worker-index", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--internal-key-fd", type=int, default=None, help=argparse.SUPPRESS)  # a pipe from the --workers parent
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("check-config", help="validate a config file exactly as serve does, and exit")
    p.add_argument("config")
    p.set_defaults(func=cmd_check_config)

    p = sub.add_parser("config", help="print the configuration reference (Markdown) or its JSON Schema, both generated from the settings")
    p.add_argument("what", choices=("reference", "schema"))
    p.set_defaults(func=cmd_config)

    keys = sub.add_parser("keys", help="manage API keys").add_subparsers(dest="keys_command", required=True)
    from .state.admin import add_commands as add_key_commands

    add_key_commands(keys, sub)  # create|list|show|revoke|update, and `gateway usage` (gateway/state/admin.py)
    p = keys.add_parser("hash", help="print the stored form of an existing key ('-' reads it from stdin)")
    p.add_argument("key")
    p.set_defaults(func=cmd_keys_hash)

    p = sub.add_parser("admin-key", help="make a key for the admin listener; prints ADMIN_KEY=... and ADMIN_KEY_HASH=... (env-file lines)")
    p.set_defaults(func=cmd_admin_key)

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
