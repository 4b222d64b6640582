"""What to run for each instance: the engine choice, the device sets, the exact argv and environment.

Everything here is pure or probes the machine read-only, so the argv and environment built for
any config can be tested without a GPU.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Sequence

from ..config.launch import QUANT_NAMES, VISIBLE_DEVICES_ENV, LaunchGroup
from . import shim

SHIM = str(Path(shim.__file__).resolve())

LOOPBACK = "127.0.0.1"


class LaunchError(Exception):
    """The machine cannot run a launch group as configured (no lmdeploy, too few devices...)."""


# -- probing the machine ----------------------------------------------------------------------------
DeviceProbe = Callable[[str], "tuple[tuple[str, ...] | None, str]"]
LmdeployProbe = Callable[[], "tuple[tuple[str, ...] | None, str]"]


def probe_devices(device: str, env: Mapping[str, str] | None = None) -> tuple[tuple[str, ...] | None, str]:
    """Visible device ids of one type and how they were found; None when the machine cannot tell."""
    env = os.environ if env is None else env
    var = VISIBLE_DEVICES_ENV[device]
    if var in env:
        ids = tuple(x.strip() for x in env[var].split(",") if x.strip() and x.strip() != "-1")
        return ids, f"{var}={env[var]!r}"
    if device == "cuda":
        smi = shutil.which("nvidia-smi")
        if smi:
            try:
                out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=10).stdout
                n = sum(1 for line in out.splitlines() if line.startswith("GPU "))
                return tuple(str(i) for i in range(n)), f"nvidia-smi lists {n} GPU(s)"
            except (OSError, subprocess.SubprocessError):
                pass
        proc = Path("/proc/driver/nvidia/gpus")
        if proc.is_dir():
            n = len(list(proc.iterdir()))
            return tuple(str(i) for i in range(n)), f"{proc} lists {n} GPU(s)"
        return (), "no NVIDIA driver found"
    nodes = {"ascend": r"davinci(\d+)", "camb": r"cambricon_dev(\d+)"}.get(device)
    if nodes is None:
        return None, f"{device} devices cannot be detected; set {var} or list them in gpus"
    ids = sorted(int(m.group(1)) for p in Path("/dev").glob("*") if (m := re.fullmatch(nodes, p.name)))
    return tuple(str(i) for i in ids), f"/dev lists {len(ids)} {device} device(s)"


def probe_lmdeploy(executable: str | None = None, env: Mapping[str, str] | None = None) -> tuple[tuple[str, ...] | None, str]:
    """The command that runs lmdeploy here, and how it was found; None when it is not installed."""
    env = os.environ if env is None else env
    if executable:
        found = shutil.which(executable, path=env.get("PATH"))
        return ((found,), f"executable {found}") if found else (None, f"executable {executable!r} not found")
    found = shutil.which("lmdeploy", path=env.get("PATH"))
    if found:
        return (found,), f"lmdeploy on PATH ({found})"
    try:
        spec = importlib.util.find_spec("lmdeploy")
    except (ImportError, ValueError):
        spec = None
    if spec is not None:
        return (sys.executable, "-m", "lmdeploy"), "lmdeploy importable"
    return None, "lmdeploy is not installed"


# -- the plan for one group ---------------------------------------------------------------------------
@dataclass(frozen=True)
class GroupPlan:
    """What one launch group becomes on this machine."""

    group: LaunchGroup
    engine: str  # lmdeploy | sim
    reason: str  # why this engine, for the start-up log line
    device_sets: tuple[tuple[str, ...], ...]  # per instance; empty tuples for the simulator
    command: tuple[str, ...] = ()  # the lmdeploy command

    @property
    def instances(self) -> int:
        return len(self.device_sets)


def plan_group(group: LaunchGroup, devices: DeviceProbe, lmdeploy: LmdeployProbe) -> GroupPlan:
    """Resolve engine auto and the device sets; raise LaunchError when the machine cannot do it."""
    if group.engine == "sim":
        return GroupPlan(group, "sim", "engine: sim", ((),) * group.sim_instances())
    command, how = lmdeploy()
    visible, seen = devices(group.device)
    if group.engine == "auto":
        if command is None:
            return _sim_plan(group, f"{how}")
        if not visible:
            return _sim_plan(group, f"{how}, but no {group.device} device is visible ({seen})")
        if len(visible) < group.tp:
            return _sim_plan(group, f"{how}, but only {len(visible)} {group.device} device(s) are visible and tp is {group.tp}")
    elif command is None:
        raise LaunchError(f"{group.label}: engine lmdeploy, but {how}; install it (pip install lmdeploy) or use engine: sim")
    ids = _choose_devices(group, visible, seen)
    sets = tuple(tuple(ids[i : i + group.tp]) for i in range(0, len(ids) - len(ids) % group.tp, group.tp))
    reason = f"{how} and {len(ids)} {group.device} device(s) visible ({seen})"
    return GroupPlan(group, "lmdeploy", reason if group.engine == "auto" else "engine: lmdeploy", sets, tuple(command))


def _sim_plan(group: LaunchGroup, why: str) -> GroupPlan:
    return GroupPlan(group, "sim", why, ((),) * group.sim_instances())


def _choose_devices(group: LaunchGroup, visible: tuple[str, ...] | None, seen: str) -> list[str]:
    gpus = group.gpus
    if gpus == "all":
        if visible is None:
            raise LaunchError(f"{group.label}.gpus: 'all' needs the visible devices, but {seen}")
        if len(visible) < group.tp:
            raise LaunchError(f"{group.label}: tp is {group.tp} but only {len(visible)} {group.device} device(s) are visible ({seen})")
        return list(visible)
    if isinstance(gpus, int):
        if visible is not None and len(visible) < gpus:
            raise LaunchError(f"{group.label}.gpus: {gpus} devices asked for, but only {len(visible)} are visible ({seen})")
        return list(visible[:gpus]) if visible is not None else [str(i) for i in range(gpus)]
    ids = [str(i) for i in gpus]
    if visible is not None:
        missing = [i for i in ids if i not in visible]
        if missing:
            raise LaunchError(f"{group.label}.gpus: device(s) {', '.join(missing)} are not visible ({seen})")
    return ids


# -- argv and environment ------------------------------------------------------------------------------
def lmdeploy_argv(plan: GroupPlan, port: int, api_key: str) -> list[str]:
    """``lmdeploy serve api_server MODEL ... --api-keys KEY``: what lmdeploy's parser reads (in-process, see shim.py)."""
    # Last, so no nargs option in extra_args can swallow it.
    return [*plan.command, *lmdeploy_args(plan, port), "--api-keys", api_key]


def lmdeploy_args(plan: GroupPlan, port: int) -> list[str]:
    """The arguments after the command, bound to loopback; the key is added by the shim."""
    g = plan.group
    argv = ["serve", "api_server", g.model, "--server-name", LOOPBACK, "--server-port", str(port)]
    argv += ["--model-name", g.served_name, "--backend", g.backend, "--tp", str(g.tp)]
    if g.backend == "pytorch":
        argv += ["--device", g.device]  # TurboMind ignores it
    if g.cache_max_entry_count is not None:
        argv += ["--cache-max-entry-count", f"{g.cache_max_entry_count:g}"]
    if g.session_len is not None:
        argv += ["--session-len", str(g.session_len)]
    if g.max_batch_size is not None:
        argv += ["--max-batch-size", str(g.max_batch_size)]
    if g.quant_policy is not None:
        argv += ["--quant-policy", QUANT_NAMES[g.quant_policy]]
    if g.enable_prefix_caching:
        argv.append("--enable-prefix-caching")
    if g.dtype is not None:
        argv += ["--dtype", g.dtype]
    if g.chat_template is not None:
        argv += ["--chat-template", g.chat_template]
    if g.eager_mode:
        argv.append("--eager-mode")
    if g.role != "hybrid":  # lmdeploy's spelling: --role Prefill|Decode --migration-backend DLSlime|Mooncake
        argv += ["--role", g.role.capitalize(), "--migration-backend", g.migration_backend]
    argv += g.extra_args
    return argv


# The simulator's --max-batch-size when the group sets none (gateway/sim/config.py; a test keeps them equal).
SIM_DEFAULT_MAX_BATCH_SIZE = 64


def launched_slots(plan: GroupPlan) -> int | None:
    """An instance's batch slots as the balancer should assume them: the group's ``max_batch_size``,
    else the simulator's default; None for lmdeploy without it (its default depends on the device)."""
    if plan.group.max_batch_size is not None:
        return plan.group.max_batch_size
    return SIM_DEFAULT_MAX_BATCH_SIZE if plan.engine == "sim" else None


def sim_argv(plan: GroupPlan, port: int, api_key: str) -> list[str]:
    """The simulated api_server's argv as its parser reads it: the key like lmdeploy's (same code path)."""
    return [sys.executable, "-m", "gateway.sim", *sim_args(plan, port), "--api-keys", api_key]


def sim_args(plan: GroupPlan, port: int) -> list[str]:
    g = plan.group
    argv = ["--host", LOOPBACK, "--port", str(port), "--model", g.served_name]
    argv += ["--backend", g.backend]
    if g.max_batch_size is not None:
        argv += ["--max-batch-size", str(g.max_batch_size)]
    if g.session_len is not None:
        argv += ["--session-len", str(g.session_len)]
    if g.role != "hybrid":  # the same flags as lmdeploy's api_server
        argv += ["--role", g.role.capitalize(), "--migration-backend", g.migration_backend]
    for name, value in g.sim:
        argv += [f"--{name.replace('_', '-')}", f"{value:g}" if isinstance(value, float) else str(value)]
    return argv


def instance_argv(plan: GroupPlan, port: int, api_key: str) -> list[str]:
    return lmdeploy_argv(plan, port, api_key) if plan.engine == "lmdeploy" else sim_argv(plan, port, api_key)


def python_of(executable: str, env: Mapping[str, str] | None = None) -> str | None:
    """The interpreter of a Python console script (from its ``#!`` line), or None if it is not one."""
    try:
        with open(executable, "rb") as f:
            first = f.readline(512)
    except OSError:
        return None
    if not first.startswith(b"#!"):
        return None
    words = first[2:].decode("utf-8", errors="replace").split()
    if not words:
        return None
    interp = words[0]
    if os.path.basename(interp) == "env":
        names = [w for w in words[1:] if not w.startswith("-")]
        found = shutil.which(names[0], path=(os.environ if env is None else env).get("PATH")) if names else None
        if found is None:
            return None
        interp = found
    return interp if "python" in os.path.basename(interp) else None


def launch_argv(plan: GroupPlan, port: int, key_fd: int, env: Mapping[str, str] | None = None) -> list[str]:
    """What is exec'd: the key shim, which reads the key from ``key_fd`` and runs the server in-process.

    The key is in no process's argv (``/proc/PID/cmdline`` is readable by every local user).
    """
    if plan.engine == "sim":
        return [sys.executable, SHIM, "--key-fd", str(key_fd), "--module", "gateway.sim", "--", *sim_args(plan, port)]
    command, args = plan.command, lmdeploy_args(plan, port)
    if len(command) == 3 and command[1] == "-m":
        return [command[0], SHIM, "--key-fd", str(key_fd), "--module", command[2], "--", *args]
    interp = python_of(command[0], env) if len(command) == 1 else None
    if interp is None:
        raise LaunchError(
            f"{plan.group.label}: {shlex.join(command)} is not a Python script; the internal key can only be handed to "
            "lmdeploy in-process (never in its command line). Point `executable` at lmdeploy's console script or its Python"
        )
    return [interp, SHIM, "--key-fd", str(key_fd), "--script", command[0], "--", *args]


def instance_env(plan: GroupPlan, devices: Sequence[str], base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The instance's environment: the gateway's, the group's `env`, and its own device set."""
    env = dict(os.environ if base is None else base)
    env.update(plan.group.env)
    env["PYTHONUNBUFFERED"] = "1"  # log lines reach the log file as they happen
    if plan.engine == "lmdeploy":
        env[VISIBLE_DEVICES_ENV[plan.group.device]] = ",".join(devices)
    return env


def redact(argv: Sequence[str], secret: str) -> list[str]:
    """argv for logs: the internal key never appears."""
    return ["***" if a == secret else a for a in argv]
