"""``gateway serve --workers N``: N gateway processes on one port, sharing state through Redis.

The parent process only supervises: it checks the port, starts N children
(``gateway serve --worker-index i``), forwards SIGTERM/SIGINT/SIGHUP to them and restarts one
that dies (with a growing pause). Each child binds its own ``SO_REUSEPORT`` listening socket on
the same address, so the kernel spreads new connections over them, and hands that pre-bound
socket to the server. Worker 0 alone launches and supervises api_servers (``launch:``); the
others run without ``launch`` and learn the launched backends from the store
(``gateway/state/cluster.py``). With the in-memory store, N > 1 is refused: each process would
have its own keys, limits and usage.

The internal key the launched api_servers require is made here, once, and handed to every worker
through an inherited pipe (``--internal-key-fd N``, as ``launcher/shim.py`` hands it to an
api_server): worker 0 launches with it, the others call with it, and Redis, which every worker
shares with whoever else can read it, only ever holds the backends' addresses.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import ipaddress
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from typing import Any

from .config import GatewayConfig

MAX_WORKERS = 256
RESTART_PAUSE_MAX = 30.0


def refusal(cfg: GatewayConfig, workers: int, pin: bool = False) -> str | None:
    if workers < 1 or workers > MAX_WORKERS:
        return f"--workers {workers} is out of range; use 1 to {MAX_WORKERS}"
    if pin and workers < 2:
        return "--pin-workers pins each of N workers to its own CPU; it needs --workers N with N > 1"
    if workers > 1 and not cfg.state.shared:
        return (
            f"--workers {workers} needs the shared state store: with the in-memory store each worker would keep its own keys, "
            "limits and usage (a 60 rpm key would get 60 per worker). Set `state: {redis_url: redis://HOST:6379/0}` in the config, "
            "or run one worker"
        )
    return None


def _family(host: str) -> socket.AddressFamily:
    try:
        return socket.AF_INET6 if ipaddress.ip_address(host.strip("[]")).version == 6 else socket.AF_INET
    except ValueError:
        return socket.AF_INET


def bind_reuseport(host: str, port: int) -> socket.socket:
    """A listening TCP socket on (host, port) that other processes of ours may bind too."""
    sock = socket.socket(_family(host), socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host.strip("[]"), port))
        sock.listen(2048)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


def worker_setup(cfg: GatewayConfig, index: int, host: str, port: int) -> tuple[GatewayConfig, socket.socket]:
    """In a worker: its config (launch only in worker 0) and its pre-bound socket."""
    if index > 0:
        cfg = dataclasses.replace(cfg, launch=())
    return cfg, bind_reuseport(host, port)


def pin_worker(index: int) -> tuple[int, ...] | None:
    """``--pin-workers``: worker ``index`` runs on one CPU of those the gateway was given (in turn,
    worker i on the i-th, modulo their number), so the scheduler does not move it between cores: a
    Python worker that migrates runs on cold caches (measured at c=32 with 2 workers on 2 cores:
    about 10 % more CPU per request). Returns the CPUs it had, for the api_servers it launches
    (they must not share its one core); None when there is nothing to pin (one CPU) or it failed."""
    try:
        cpus = tuple(sorted(os.sched_getaffinity(0)))
        if len(cpus) < 2:
            return None
        os.sched_setaffinity(0, {cpus[index % len(cpus)]})
    except (AttributeError, OSError) as exc:  # not Linux, or a CPU set that changed under us
        print(f"gateway: worker {index} not pinned to a CPU: {exc}", file=sys.stderr)
        return None
    return cpus


def key_pipe(key: str) -> int:
    """The read end of a pipe holding ``key`` (the write end closed): a child that inherits it reads
    the key, which never appears in any argv or environment."""
    r, w = os.pipe()
    try:
        os.write(w, key.encode())  # 64 bytes: far below the pipe's buffer, never blocks
    finally:
        os.close(w)
    return r


def supervise(args: argparse.Namespace, cfg: GatewayConfig, host: str, port: int) -> int:
    n = args.workers
    problem = refusal(cfg, n, getattr(args, "pin_workers", False))
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    try:  # fail here, once and clearly, if the port is taken by something else
        probe = bind_reuseport(host, port)
    except OSError as exc:
        print(f"error: cannot listen on {host}:{port}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    port = probe.getsockname()[1]
    base = [sys.executable, "-m", "gateway", "serve", "--config", args.config, "--host", host, "--port", str(port)]
    if getattr(args, "state_dir", None):
        base += ["--state-dir", args.state_dir]
    children: dict[int, subprocess.Popen[bytes]] = {}
    pauses: dict[int, float] = {}
    stopping: list[int] = []
    # Hex, as the launcher's own key: never read as a flag. The same for a restarted worker, so a
    # restarted worker 0 relaunches with the key the others already use.
    internal_key = secrets.token_hex(32)

    def start(i: int) -> None:
        fd = key_pipe(internal_key)
        try:
            pin = ["--pin-workers"] if getattr(args, "pin_workers", False) else []
            children[i] = subprocess.Popen(base + ["--workers", "1", "--worker-index", str(i), "--internal-key-fd", str(fd), *pin], pass_fds=(fd,))
        finally:
            os.close(fd)

    def forward(signum: int, _frame: Any) -> None:
        if signum != signal.SIGHUP:
            stopping.append(signum)
        for p in children.values():
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    p.send_signal(signal.SIGTERM if signum == signal.SIGINT else signum)

    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(s, forward)
    try:
        for i in range(n):
            start(i)
        probe.close()  # the children hold the port now
        print(f"gateway: {n} workers on {host}:{port} (pids {' '.join(str(p.pid) for p in children.values())})", file=sys.stderr, flush=True)
        restart_at: dict[int, float] = {}
        while True:
            time.sleep(0.2)
            alive = 0
            for i, p in list(children.items()):
                if p.poll() is None:
                    alive += 1
                    continue
                if stopping:
                    continue
                if i not in restart_at:
                    pause = pauses[i] = min(RESTART_PAUSE_MAX, pauses.get(i, 0.5) * 2)
                    restart_at[i] = time.monotonic() + pause
                    print(f"gateway: worker {i} exited with {p.returncode}; restarting in {pause:.0f}s", file=sys.stderr, flush=True)
                elif time.monotonic() >= restart_at[i]:
                    del restart_at[i]
                    start(i)
                    alive += 1
            if stopping and alive == 0:
                break
    finally:
        with contextlib.suppress(OSError):
            probe.close()
        deadline = time.monotonic() + float(cfg.timeouts.drain) + 15.0
        for p in children.values():
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    p.terminate()
        for p in children.values():
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
    codes = [p.returncode for p in children.values()]
    return 0 if all(c in (0, -signal.SIGTERM) for c in codes) else 1

