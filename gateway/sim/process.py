"""The simulator as a subprocess on loopback, for tests and benchmarks alike.

``SimProcess`` starts ``python -m gateway.sim`` on a free loopback port in a process group of its
own, waits (with a deadline) until ``/health`` answers 200, and ``stop()`` ends the whole group:
SIGTERM, then SIGKILL after a bounded grace, then it checks that no member of the group is left.
``LoopbackProcess`` is the same lifecycle for any other command (the routing bench runs its
gateways with it). Every wait here has a deadline; nothing outlives ``stop()``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Any, Callable

import httpx

ROOT = Path(__file__).resolve().parents[2]
LOOPBACK = "127.0.0.1"


def free_port(host: str = LOOPBACK) -> int:
    """A port free right now on ``host`` (the child binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def group_members(pgid: int) -> set[int]:
    """The live (not zombie) processes of process group ``pgid``; empty where /proc is missing."""
    members: set[int] = set()
    with contextlib.suppress(OSError):
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    stat = f.read()
            except OSError:
                continue
            fields = stat[stat.rfind(b")") + 2 :].split()  # state, ppid, pgrp, ...
            if len(fields) > 2 and fields[0] != b"Z" and int(fields[2]) == pgid:
                members.add(int(name))
    return members


class LoopbackProcess:
    """A command in its own session (so its process group is its own); output goes to ``log`` or a temp file."""

    def __init__(self, argv: list[str], what: str, *, log: Path | None = None, env: dict[str, str] | None = None, cwd: Path = ROOT):
        self.what = what
        self.log = log
        self._out: IO[bytes] = open(log, "w+b") if log is not None else tempfile.TemporaryFile()
        self.proc = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=self._out, stderr=subprocess.STDOUT, start_new_session=True)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def output(self) -> str:
        """Everything the process wrote so far (stdout and stderr together)."""
        if self.log is not None:
            return self.log.read_text(errors="replace")
        if self._out.closed:
            return ""
        self._out.seek(0)
        return self._out.read().decode(errors="replace")

    def wait_for(self, ok: Callable[[], bool], timeout: float, what: str, interval: float = 0.05) -> None:
        """Poll ``ok`` until true; fail early with the output if the process exits, or after ``timeout``.

        ``ok`` raising ``httpx.TransportError`` counts as not yet (the port is not open).
        """
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.what} exited with {self.proc.returncode} before {what}: {self.output()[-2000:]}")
            try:
                if ok():
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{self.what}: timed out after {timeout}s waiting for {what}")
            time.sleep(interval)

    def stop(self, grace: float = 5.0) -> int:
        """End the process group: SIGTERM, SIGKILL after ``grace``; then check nothing of it is left."""
        pgid = self.proc.pid
        if self.proc.poll() is None:
            self._signal_group(signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self._signal_group(signal.SIGKILL)
                self.proc.wait(5)
        self._reap_group(pgid)
        self._out.close()
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL the whole group at once (a crash, as a test wants it); ``stop()`` may follow."""
        self._signal_group(signal.SIGKILL)
        self.proc.wait(5)

    def _signal_group(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)

    @staticmethod
    def _reap_group(pgid: int, timeout: float = 5.0) -> None:
        # The leader is gone; anything it forked must go too, or the caller hears about it.
        deadline = time.monotonic() + timeout
        while members := group_members(pgid):
            if time.monotonic() >= deadline:
                raise RuntimeError(f"processes {sorted(members)} of group {pgid} survived stop()")
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGKILL)
            time.sleep(0.02)

    def __enter__(self) -> "LoopbackProcess":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


class SimProcess(LoopbackProcess):
    """``python -m gateway.sim`` on a free loopback port (``host`` may be another 127.x address); ready
    (``/health`` 200) when the constructor returns."""

    def __init__(
        self,
        *args: str,
        model: str = "sim-model",
        api_key: str | None = None,
        host: str = LOOPBACK,
        port: int | None = None,
        ready: bool = True,
        ready_timeout: float = 15.0,
        log: Path | None = None,
        env: dict[str, str] | None = None,
    ):
        self.model = model
        self.api_key = api_key
        self.port = port or free_port(host)
        self.url = f"http://{host}:{self.port}"
        argv = [sys.executable, "-m", "gateway.sim", "--host", host, "--port", str(self.port), "--model", model, *args]
        if api_key:
            argv += ["--api-keys", api_key]
        super().__init__(argv, f"sim on port {self.port}", log=log, env=env)
        # /_sim/* needs no key; a test that wants the key on a real route passes the header itself.
        self.http = httpx.Client(base_url=self.url, timeout=10.0, trust_env=False)
        if ready:
            try:
                self.wait_ready(ready_timeout)
            except BaseException:
                self.stop()
                raise

    def wait_ready(self, timeout: float = 15.0) -> None:
        self.wait_for(lambda: self.http.get("/health").status_code == 200, timeout, "/health to answer 200")

    # -- the simulator's own control routes ------------------------------------------------------
    def control(self, **settings: Any) -> dict[str, Any]:
        r = self.http.post("/_sim/control", json=settings)
        r.raise_for_status()
        return r.json() if r.content else {}

    def stats(self) -> dict[str, Any]:
        return self.http.get("/_sim/stats").json()

    def requests(self) -> list[dict[str, Any]]:
        return self.http.get("/_sim/requests").json()

    def clear(self) -> None:
        self.http.delete("/_sim/requests")

    def stop(self, grace: float = 5.0) -> int:
        self.http.close()
        return super().stop(grace)

    def __enter__(self) -> "SimProcess":
        return self
