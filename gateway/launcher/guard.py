"""A tiny parent for one api_server: nothing it started outlives the gateway.

``python -m gateway.launcher.guard --grace S -- ARGV...`` runs ARGV in the guard's own process
group (the launcher made the guard a session leader). The kernel tells the guard when the gateway
dies, even by SIGKILL (PR_SET_PDEATHSIG); the guard then stops the whole group, the api_server's
worker processes included, which a death signal on the api_server alone would orphan. As a child
subreaper it also collects workers that left the group's parent chain.

Signals: a SIGTERM/SIGINT from the launcher reaches the whole group at once, so the guard only
waits for its child (a second SIGTERM would make uvicorn skip its graceful shutdown). The guard
exits with its child's status; when the child ends, whatever it left behind is killed.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import sys
import time

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
PARENT_DIED = signal.SIGUSR2  # distinct from the launcher's SIGTERM


def prctl(option: int, arg: int) -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(option, arg, 0, 0, 0) == 0
    except (OSError, AttributeError):  # not Linux: process groups still work, death signals do not
        return False


def set_parent_death_signal(sig: int, expected_parent: int | None = None) -> None:
    """Ask the kernel for ``sig`` when our parent exits; exit at once if it already has."""
    prctl(PR_SET_PDEATHSIG, int(sig))
    if expected_parent is not None and os.getppid() != expected_parent:
        os._exit(1)


def group_members(pgid: int) -> list[int]:
    """Live pids in a process group other than ours (read from /proc)."""
    me = os.getpid()
    out = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return out
    for name in entries:
        if not name.isdigit() or int(name) == me:
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2 :].split()
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] != b"Z":
            out.append(int(name))
    return out


def children_of(pid: int) -> list[int]:
    out = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(x) for x in f.read().split()]
    except OSError:
        pass
    return out


def _kill(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _reap_all() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gateway.launcher.guard")
    parser.add_argument("--grace", type=float, default=10.0)
    parser.add_argument("--parent", type=int, default=None, help="the launcher's pid; exit if it is already gone")
    # A launcher pinned to one CPU (``gateway serve --workers N --pin-workers``) gives its api_servers
    # the CPUs it had before: they must not share the worker's one core.
    parser.add_argument("--cpus", default=None, help="comma-separated CPUs the api_server may run on")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command")

    parent_died = False

    def on_parent_death(signum: int, frame: object) -> None:
        nonlocal parent_died
        parent_died = True

    signal.signal(PARENT_DIED, on_parent_death)
    # The launcher's SIGTERM/SIGINT went to the whole group; the child handles its own.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    launcher = args.parent or os.getppid()
    set_parent_death_signal(PARENT_DIED, launcher)  # before anything is started: nothing can be orphaned
    prctl(PR_SET_CHILD_SUBREAPER, 1)

    if args.cpus:
        try:
            os.sched_setaffinity(0, {int(c) for c in args.cpus.split(",")})
        except (OSError, ValueError) as exc:  # the api_server still runs, on the launcher's CPUs
            os.write(2, f"guard: cannot set CPUs {args.cpus!r}: {exc}\n".encode())
    me = os.getpid()
    pid = os.fork()
    if pid == 0:  # the api_server: dies with the guard whatever happens to it
        try:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            signal.signal(PARENT_DIED, signal.SIG_DFL)
            set_parent_death_signal(signal.SIGKILL, me)
            os.execvp(command[0], command)
        except BaseException as exc:  # noqa: BLE001 - report and leave, never return into the guard's code
            try:
                os.write(2, f"guard: cannot run {command[0]!r}: {exc}\n".encode())
            finally:
                os._exit(127)

    status = None
    deadline = None
    while status is None:
        if parent_died and deadline is None:
            # The gateway is gone: stop the api_server gracefully, then everything.
            _kill([pid], signal.SIGTERM)
            deadline = time.monotonic() + args.grace
        if deadline is not None and time.monotonic() >= deadline:
            _kill([pid], signal.SIGKILL)
        try:
            got, st = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            status = 1
            break
        if got == pid:
            status = st
            break
        if os.getppid() != launcher:
            parent_died = True
        time.sleep(0.05)

    # Workers left behind: the rest of our group, and orphans re-parented to us.
    for _ in range(3):
        left = set(group_members(os.getpgrp())) | set(children_of(me))
        if not left:
            break
        _kill(sorted(left), signal.SIGKILL)
        time.sleep(0.05)
        _reap_all()
    if os.WIFSIGNALED(status):
        return 128 + os.WTERMSIG(status)
    return os.WEXITSTATUS(status) if os.WIFEXITED(status) else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
