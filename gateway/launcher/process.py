"""Starting and stopping one instance's process group, its log file, and free loopback ports.

Every instance runs as ``guard -> api_server`` in a process group of its own
(``start_new_session``): stopping signals the whole group, so the api_server's workers stop with
it. The guard asks for PR_SET_PDEATHSIG itself, first thing, and exits if its parent is already
not the gateway, so no preexec_fn runs in the forked child (unsafe with threads). The death
signal fires when the *thread* that forked exits: spawn from the event loop's thread (the main
thread under uvicorn), never from a short-lived worker thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

from . import guard

GUARD = [sys.executable, "-I", "-S", str(Path(guard.__file__).resolve())]  # stdlib only: isolated and quick


def pick_port(avoid: set[int] | frozenset[int] = frozenset(), prefer: int | None = None) -> int:
    """A loopback port free right now (the child binds it a moment later; a lost race is retried)."""
    if prefer and prefer not in avoid and port_is_free(prefer):
        return prefer
    for _ in range(50):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in avoid:
            return port
    raise OSError("no free loopback port")


def port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: TIME_WAIT does not count
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


async def spawn(
    argv: Sequence[str], env: dict[str, str], log_path: Path, *, grace: float = 10.0, pass_fds: Sequence[int] = (),
    cpus: Sequence[int] | None = None,
) -> asyncio.subprocess.Process:
    """Start ``argv`` under the guard, in a new session, with stdout and stderr appended to log_path.

    ``pass_fds`` (the key pipe) are inherited by the guard and, through its exec, by the server.
    ``cpus``: the CPUs the server runs on (the guard sets them), when not this process's own.
    """
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)  # the api_server may log its key
    try:
        return await asyncio.create_subprocess_exec(
            *GUARD,
            "--grace",
            f"{grace:g}",
            "--parent",
            str(os.getpid()),
            *(("--cpus", ",".join(str(c) for c in cpus)) if cpus else ()),
            "--",
            *argv,
            stdin=subprocess.DEVNULL,
            stdout=fd,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            close_fds=True,
            pass_fds=tuple(pass_fds),
        )
    finally:
        os.close(fd)


def signal_group(pgid: int, sig: int) -> bool:
    try:
        os.killpg(pgid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


async def terminate(proc: asyncio.subprocess.Process, grace: float) -> int | None:
    """SIGTERM the process group, SIGKILL it after grace; return the exit status."""
    if proc.returncode is None:
        signal_group(proc.pid, signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), grace)
        except asyncio.TimeoutError:
            pass
    # The guard is gone (or stuck): whatever is left in the group goes now.
    signal_group(proc.pid, signal.SIGKILL)
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(proc.wait(), 5.0)
    return proc.returncode


def describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        code = 128 - code
    if code > 128:
        try:
            return f"killed by {signal.Signals(code - 128).name}"
        except ValueError:
            pass
    return f"exited with code {code}"


# -- log files --------------------------------------------------------------------------------------
class InstanceLog:
    """One append-only log file per instance, rotated by size (copy, then truncate in place).

    The process writes with O_APPEND straight to the file, so the gateway is never in its output
    path; truncating in place keeps its descriptor valid.
    """

    def __init__(self, path: Path, max_bytes: int = 20 * 1024 * 1024, backups: int = 3):
        self.path = path
        self.max_bytes = max_bytes
        self.backups = backups
        self.mark = 0  # where the current run's output starts

    def begin(self, header: str) -> None:
        """Start a run: rotate if large, write a header, and remember where this run starts."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.rotate_if_large()
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            stamp = time.strftime("%Y-%m-%d %H:%M:%S")
            os.write(fd, f"\n===== {stamp} {header} =====\n".encode())
        finally:
            os.close(fd)
        self.mark = self.size()

    def size(self) -> int:
        try:
            return self.path.stat().st_size
        except OSError:
            return 0

    def rotate_if_large(self) -> None:
        if self.size() <= self.max_bytes:
            return
        for i in range(self.backups - 1, 0, -1):
            older = self.path.with_name(f"{self.path.name}.{i}")
            if older.exists():
                older.replace(self.path.with_name(f"{self.path.name}.{i + 1}"))
        try:
            shutil.copyfile(self.path, self.path.with_name(f"{self.path.name}.1"))
            os.truncate(self.path, 0)
        except OSError:
            return
        self.mark = 0

    def tail(self, lines: int = 20, max_bytes: int = 16384) -> list[str]:
        """The last lines this run wrote."""
        try:
            with open(self.path, "rb") as f:
                end = f.seek(0, os.SEEK_END)
                start = max(self.mark if self.mark <= end else 0, end - max_bytes)
                f.seek(start)
                data = f.read(end - start)
        except OSError:
            return []
        text = data.decode("utf-8", errors="replace").splitlines()
        return [line for line in text if line.strip()][-lines:]
