"""The launcher: starts every instance, restarts it when it dies, and stops them all. It knows
processes; it knows nothing about routing, and it never probes ``/health`` itself.

Health has one owner, the pool: each instance is in the pool from its spawn, out of rotation until
the pool's checker reads ``healthy`` from its ``/health``. The launcher reads that status to drive
its states, and tells the pool what only it can know: a process exited (``pool.mark_down``), a new
process of the same instance started (``pool.readmit``), an instance gave up or stopped
(``pool.remove``). One supervisor task per instance runs this cycle::

    spawn -> starting -> loading (/health not "healthy" yet) -> healthy (in rotation)
          -> exited (out of rotation at once) / unhealthy too long -> restarting (backoff) -> spawn ...

A cycle that fails ``max_restarts + 1`` times in a row ends in ``crash_loop`` (it kept exiting)
or ``failed`` (it never became healthy in time, or cannot be started at all), and is reported
instead of retried.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import secrets
import shlex
import time
from pathlib import Path
from typing import Any, Callable, Sequence, TextIO

from .. import metrics
from ..config.launch import LaunchGroup
from ..routing.pool import Backend, BackendPool
from . import process
from .progress import report_progress
from .spawn import (
    LOOPBACK,
    GroupPlan,
    LaunchError,
    instance_argv,
    instance_env,
    launch_argv,
    launched_slots,
    plan_group,
    probe_devices,
    probe_lmdeploy,
    redact,
)

log = logging.getLogger("gateway.launcher")

STATES = ("starting", "loading", "healthy", "unhealthy", "restarting", "failed", "crash_loop", "stopped")
GIVEN_UP = frozenset({"failed", "crash_loop"})
_BIND_FAILED = re.compile(r"address already in use|errno 98\b", re.IGNORECASE)
BIND_RETRIES = 3


class Instance:
    """One api_server process slot: the same id, log file and pool entry across restarts."""

    def __init__(self, plan: GroupPlan, ordinal: int, id: str, devices: tuple[str, ...], log_dir: Path):
        self.plan = plan
        self.group: LaunchGroup = plan.group
        self.ordinal = ordinal
        self.id = id
        self.devices = devices
        self.state = "starting"
        self.since = time.monotonic()  # entered the current state
        self.spawned_at = self.since  # the current process started
        self.pid: int | None = None
        self.port: int | None = None
        self.restarts = 0  # since the gateway started
        self.failures = 0  # in a row; reset by a stable run
        self.error: str | None = None
        self.health: str = "unknown"  # the last /health status seen
        self.proc: Any = None
        self.task: asyncio.Task[None] | None = None
        safe = re.sub(r"[^A-Za-z0-9._-]+", "_", id)
        self.log = process.InstanceLog(log_dir / f"{safe}.log")

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def elapsed(self, now: float | None = None) -> float:
        return (time.monotonic() if now is None else now) - self.since

    def snapshot(self, now: float) -> dict[str, Any]:
        return {
            "id": self.id,
            "model": self.group.served_name,
            "engine": self.plan.engine,
            "state": self.state,
            "pid": self.pid,
            "restarts": self.restarts,
            "elapsed": round(self.elapsed(now), 1),
            "devices": list(self.devices),
            "error": self.error,
        }


class Launcher:
    """Starts, watches, restarts and stops the api_server instances of every launch group."""

    def __init__(
        self,
        groups: Sequence[LaunchGroup],
        pool: BackendPool,
        *,
        log_dir: Path | str | None = None,
        stop_grace: float = 10.0,
        poll_interval: float = 0.5,
        devices: Callable[[str], tuple[tuple[str, ...] | None, str]] | None = None,
        lmdeploy: Callable[[str | None], tuple[tuple[str, ...] | None, str]] | None = None,
        env: dict[str, str] | None = None,
        progress: TextIO | None = None,
        progress_tty: bool | None = None,
        backend_key: str | None = None,
        cpus: Sequence[int] | None = None,
    ):
        self.groups = tuple(groups)
        self.pool = pool
        self.log_dir = Path(log_dir if log_dir is not None else os.environ.get("LMDEPLOY_GATEWAY_LOG_DIR") or ".gateway/logs")
        self.stop_grace = stop_grace
        self.cpus = cpus  # the api_servers' CPUs when this process is pinned to fewer (--pin-workers)
        self.poll_interval = poll_interval
        self._env = env
        self._devices = devices or (lambda device: probe_devices(device, env))
        self._lmdeploy = lmdeploy or (lambda executable: probe_lmdeploy(executable, env))
        self._progress_stream = progress
        self._progress_tty = progress_tty
        # The key every instance requires; only this process holds it (and, under --workers, the other
        # workers: the parent hands it to each), and a new start makes a new one.
        # Hex, not token_urlsafe: a key starting with "-" would read as a flag to argparse.
        self.backend_key = backend_key or secrets.token_hex(32)
        self.plans: list[GroupPlan] = []
        self.instances: list[Instance] = []
        self._stopping = False
        self._progress: asyncio.Task[None] | None = None

    # -- lifecycle ----------------------------------------------------------------------------------
    def plan(self) -> list[GroupPlan]:
        """Decide the engine and devices of every group; raise LaunchError if this machine cannot."""
        return [plan_group(g, self._devices, lambda g=g: self._lmdeploy(g.executable)) for g in self.groups]

    async def start(self) -> None:
        """Spawn every instance and return; they join the pool as they become healthy."""
        if not self.pool.checking:
            raise RuntimeError("start the pool's health checker first: it is the only prober of the instances' /health")
        self.plans = self.plan()
        self.log_dir.mkdir(parents=True, exist_ok=True)
        counts: dict[str, int] = {}
        for plan in self.plans:
            g = plan.group
            msg = "%s %s: engine %s, %d instance(s)%s (%s)"
            args = (g.label, g.served_name, plan.engine, plan.instances, f" of tp={g.tp}" if plan.engine == "lmdeploy" else "", plan.reason)
            if plan.engine == "sim" and g.engine == "auto":
                log.warning(msg + "; replies come from the SIMULATOR, not a model", *args)
            else:
                log.info(msg, *args)
            for devices in plan.device_sets:
                n = counts.get(g.served_name, 0)
                while self.pool.get(f"{g.served_name}#{n}") is not None:  # a remote backend named like ours
                    n += 1
                counts[g.served_name] = n + 1
                self.instances.append(Instance(plan, n, f"{g.served_name}#{n}", devices, self.log_dir))
        for inst in self.instances:
            inst.task = asyncio.get_running_loop().create_task(self._supervise(inst), name=f"launch {inst.id}")
        self._progress = asyncio.get_running_loop().create_task(
            report_progress(self._rows, self._progress_stream, tty=self._progress_tty, interval=max(self.poll_interval, 0.25)),
            name="launch progress",
        )

    async def wait_ready(self, timeout: float) -> bool:
        """True as soon as one instance is healthy; False at timeout or when every one has given up."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(i.state == "healthy" for i in self.instances):
                return True
            if self.instances and all(i.state in GIVEN_UP for i in self.instances):
                return False
            await asyncio.sleep(0.05)
        return any(i.state == "healthy" for i in self.instances)

    async def stop(self, grace: float | None = None) -> None:
        """SIGTERM every instance's process group, SIGKILL what is left after grace; leave the pool."""
        grace = self.stop_grace if grace is None else grace
        self._stopping = True
        tasks = [i.task for i in self.instances if i.task is not None]
        if self._progress is not None:
            tasks.append(self._progress)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        live = [i for i in self.instances if i.proc is not None and i.proc.returncode is None]
        if live:
            log.info("stopping %d instance(s) (grace %.0fs)", len(live), grace)
        await asyncio.gather(*(process.terminate(i.proc, grace) for i in live), return_exceptions=True)
        for inst in self.instances:
            self.pool.remove(inst.id)
            inst.pid = None
            self._set_state(inst, "stopped")

    async def restart(self, instance_id: str) -> bool:
        """An operator's restart: end the instance's process and start a fresh one (not a failure)."""
        inst = next((i for i in self.instances if i.id == instance_id), None)
        if inst is None or self._stopping:
            return False
        if inst.task is not None:
            inst.task.cancel()
            await asyncio.gather(inst.task, return_exceptions=True)
        self.pool.mark_down(inst.id, "restarting")
        if inst.proc is not None and inst.proc.returncode is None:
            await process.terminate(inst.proc, self.stop_grace)
        inst.failures, inst.error = 0, None
        inst.restarts += 1
        metrics.LAUNCHED_RESTARTS.labels(instance=inst.id).inc()
        self._set_state(inst, "restarting", "requested through the admin listener")
        inst.task = asyncio.get_running_loop().create_task(self._supervise(inst), name=f"launch {inst.id}")
        return True

    # -- reporting ----------------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        now = time.monotonic()
        rows = [i.snapshot(now) for i in self.instances]
        return {
            "instances": rows,
            "healthy": sum(1 for r in rows if r["state"] == "healthy"),
            "failed": sum(1 for r in rows if r["state"] in GIVEN_UP),
            "total": len(rows),
        }

    def failed_count(self) -> int:
        return sum(1 for i in self.instances if i.state in GIVEN_UP)

    def update_metrics(self) -> None:
        for inst in self.instances:
            self._export_state(inst)

    def _rows(self) -> list[tuple[str, str, float]]:
        now = time.monotonic()  # time since spawn: how long the load has taken, or took
        return [(i.id, i.state, now - i.spawned_at) for i in self.instances]

    def _export_state(self, inst: Instance) -> None:
        for state in STATES:
            metrics.LAUNCHED_STATE.labels(instance=inst.id, state=state).set(1 if inst.state == state else 0)

    def _set_state(self, inst: Instance, state: str, detail: str = "") -> None:
        if inst.state == state:
            return
        previous, elapsed = inst.state, inst.elapsed()
        inst.state, inst.since = state, time.monotonic()
        level = logging.ERROR if state in GIVEN_UP else logging.INFO
        log.log(
            level, "instance %s: %s -> %s after %.1fs%s", inst.id, previous, state, elapsed, f" ({detail})" if detail else "",
            extra={"fields": {"event": "instance_state", "instance": inst.id, "from": previous, "to": state, "after_s": round(elapsed, 3), "detail": detail or None}},
        )
        self._export_state(inst)

    # -- one instance -------------------------------------------------------------------------------
    async def _supervise(self, inst: Instance) -> None:
        bind_retries = 0
        while not self._stopping:
            try:
                outcome, detail = await self._run_once(inst)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a bug here must not leave an instance unsupervised and silent
                log.exception("instance %s: supervisor error", inst.id)
                outcome, detail = "error", f"{exc.__class__.__name__}: {exc}"
            if self._stopping:
                return
            if inst.proc is not None and inst.proc.returncode is None:
                await process.terminate(inst.proc, self.stop_grace)
            tail = inst.log.tail()
            if outcome == "exited" and bind_retries < BIND_RETRIES and any(_BIND_FAILED.search(line) for line in tail):
                bind_retries += 1  # lost the race for the port we picked: try another one, not a failure
                log.info("instance %s: port %s was taken before it bound; picking another", inst.id, inst.port)
                inst.port = None
                continue
            bind_retries = 0
            inst.failures += 1
            inst.error = detail
            g = inst.group
            shown = "\n".join("    " + line for line in tail) or "    (no output)"
            log.error(
                "instance %s: %s; last lines of %s:\n%s", inst.id, detail, inst.log.path, shown,
                extra={"fields": {"event": "instance_failed", "instance": inst.id, "detail": detail, "log": str(inst.log.path)}},
            )
            if outcome == "spawn_error" or inst.failures > g.max_restarts:
                if outcome in ("spawn_error", "timeout"):
                    final = "failed"
                else:
                    final = "crash_loop"
                inst.error = f"{detail}; gave up after {inst.failures} attempt(s) in a row" if outcome != "spawn_error" else detail
                self._set_state(inst, final, inst.error)
                self.pool.remove(inst.id)  # its port may be reused by anything now
                inst.pid = None
                return
            delay = min(g.restart_backoff * 2 ** (inst.failures - 1), g.restart_backoff_max)
            self._set_state(inst, "restarting", f"{detail}; restart {inst.failures}/{g.max_restarts} in {delay:.1f}s")
            inst.restarts += 1
            metrics.LAUNCHED_RESTARTS.labels(instance=inst.id).inc()
            await asyncio.sleep(delay)

    async def _run_once(self, inst: Instance) -> tuple[str, str]:
        """One process lifetime; returns (outcome, detail) when it ends or must be replaced."""
        g = inst.group
        avoid = {i.port for i in self.instances if i is not inst and i.port is not None}
        inst.port = process.pick_port(avoid, prefer=inst.port)
        env = instance_env(inst.plan, inst.devices, self._env)
        inst.health = "unknown"
        self._set_state(inst, "starting")
        # The key travels in a pipe the server inherits (shim.py), never in any argv.
        key_fd, key_w = os.pipe()
        try:
            os.write(key_w, self.backend_key.encode())
        finally:
            os.close(key_w)
        try:
            try:
                argv = launch_argv(inst.plan, inst.port, key_fd, env)
            except LaunchError as exc:
                return "spawn_error", str(exc)
            shown = redact(instance_argv(inst.plan, inst.port, self.backend_key), self.backend_key)
            inst.log.begin(f"start {inst.restarts + 1}: " + shlex.join(shown) + " (key from a pipe, through gateway.launcher.shim)")
            spawning = asyncio.ensure_future(process.spawn(argv, env, inst.log.path, grace=self.stop_grace, pass_fds=(key_fd,), cpus=self.cpus))
            try:
                inst.proc = await asyncio.shield(spawning)
            except asyncio.CancelledError:
                # Stopping while the fork is under way: keep the process so stop() can end it.
                inst.proc = await spawning
                inst.pid = inst.proc.pid
                raise
            except OSError as exc:
                return "spawn_error", f"cannot start {argv[0]!r}: {exc}"
        finally:
            os.close(key_fd)  # the child has its own copy
        inst.pid = inst.proc.pid
        inst.spawned_at = time.monotonic()
        self._enter_pool(inst)
        exited = asyncio.ensure_future(inst.proc.wait())
        try:
            outcome, detail = await self._wait_healthy(inst, exited)
            if outcome != "healthy":
                self.pool.mark_down(inst.id, outcome)
                return outcome, detail
            healthy_at = time.monotonic()
            self._set_state(inst, "healthy")
            inst.error = None
            outcome, detail = await self._watch(inst, exited)
            if time.monotonic() - healthy_at >= g.stable_after:
                inst.failures = 0  # a long healthy run: this is not a crash loop
            return outcome, detail
        finally:
            if not exited.done():
                exited.cancel()

    def _health(self, inst: Instance) -> str:
        """The pool's reading of the instance's /health (the pool is its only prober)."""
        backend = self.pool.get(inst.id)
        status = backend.health_status if backend is not None else "unknown"
        if backend is not None and status == "healthy" and not backend.healthy:
            status = "unknown"  # cannot happen through the pool's methods; never read it as healthy
        inst.health = status
        return status

    async def _wait_healthy(self, inst: Instance, exited: asyncio.Future[int]) -> tuple[str, str]:
        g = inst.group
        deadline = time.monotonic() + g.start_timeout
        while True:
            if exited.done():
                return "exited", f"{process.describe_exit(inst.proc.returncode)} before it became healthy"
            status = self._health(inst)
            if status == "healthy":
                return "healthy", ""
            if inst.state == "starting" and status != "unknown":
                self._set_state(inst, "loading")  # the pool's checker has looked at it: not ready yet
            if time.monotonic() >= deadline:
                return "timeout", f"not healthy within start_timeout={g.start_timeout:g}s (last /health: {status})"
            await asyncio.wait({exited}, timeout=min(self.poll_interval, max(deadline - time.monotonic(), 0.01)))

    async def _watch(self, inst: Instance, exited: asyncio.Future[int]) -> tuple[str, str]:
        """While it runs: the process is watched continuously, its health read from the pool."""
        g = inst.group
        bad_since: float | None = None
        while True:
            await asyncio.wait({exited}, timeout=self.poll_interval)
            if exited.done():
                self.pool.mark_down(inst.id, "exited")
                return "exited", process.describe_exit(inst.proc.returncode)
            inst.log.rotate_if_large()
            status = self._health(inst)
            if status == "healthy":
                if bad_since is not None:
                    bad_since = None
                    self._set_state(inst, "healthy")
                continue
            if bad_since is None:
                bad_since = time.monotonic()
                self._set_state(inst, "unhealthy", f"/health: {status}")
            if status != "sleeping" and time.monotonic() - bad_since >= g.unhealthy_after:
                return "unhealthy", f"/health said {status!r} for {time.monotonic() - bad_since:.0f}s"

    def _enter_pool(self, inst: Instance) -> None:
        """In the pool from its spawn, out of rotation until the pool's checker reads it healthy."""
        if self.pool.get(inst.id) is None:
            self.pool.add(
                Backend(
                    id=inst.id,
                    url=inst.url,
                    api_key=self.backend_key,
                    models=frozenset({inst.group.served_name}),
                    static_models=True,
                    origin="launched",
                    health_status="unknown",
                    check_interval=inst.group.health_interval,
                    role=inst.group.role,
                    slots=launched_slots(inst.plan),
                )
            )
        else:
            self.pool.readmit(inst.id, inst.url)  # a new process: the old one's failures are not its own


__all__ = ["Launcher", "LaunchError", "Instance", "STATES"]
