"""A real redis-server on a free loopback port, started and stopped by the tests.

No persistence, no config file: it lives in a temporary directory and dies with its test.
``stop()`` then ``start()`` restarts it on the same port (the outage tests use that); ``save()``
first makes the restarted one load what the stopped one held (an outage, not a data loss).
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import tempfile
import time

from support import free_port, wait_until


def redis_server_path() -> str:
    path = shutil.which("redis-server")
    if path is None:
        raise RuntimeError("redis-server is not installed: `apt-get install -y redis-server` (./scripts/test does it when run as root)")
    return path


class RedisServer:
    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.dir = tempfile.mkdtemp(prefix="gw-redis-")
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self) -> None:
        argv = [redis_server_path(), "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--dir", self.dir, "--protected-mode", "yes", "--loglevel", "warning"]
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
        wait_until(self.ping, 10, 0.02, f"redis-server on port {self.port}")

    def ping(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
            raise RuntimeError(f"redis-server exited with {self.proc.returncode}: {err[-1000:]}")
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def save(self) -> None:
        """Write dump.rdb into the directory; the next start() loads it."""
        with socket.create_connection(("127.0.0.1", self.port), timeout=5) as s:
            s.sendall(b"SAVE\r\n")
            assert s.recv(16).startswith(b"+OK")

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        if self.proc.stderr:
            self.proc.stderr.close()
        self.proc = None
        # The port is free again once nothing answers on it.
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and self._listening():
            time.sleep(0.02)

    def _listening(self) -> bool:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
            return True
        return False

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> "RedisServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
