"""The ``launch:`` section: api_server instances the gateway starts, watches and stops.

One group serves one model on a set of GPUs: ``instances = len(gpus) / tp``, each instance on
its own GPU set. ``engine: auto`` picks lmdeploy when it is installed and GPUs are visible, the
simulator otherwise; the choice is made at start (``gateway.launcher``), since it depends on the
machine, but everything that can be refused is refused here, before anything starts.

The rules mirror what ``lmdeploy serve api_server`` would refuse after minutes of loading, so a
mistake costs a config check instead of a model load.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any, Mapping

from .fields import Problems, Section, _type_name
from .settings import internal, read_fields, setting

ENGINES = ("auto", "lmdeploy", "sim")
BACKENDS = ("turbomind", "pytorch")
DEVICES = ("cuda", "ascend", "maca", "camb")
DTYPES = ("auto", "float16", "bfloat16")

# lmdeploy's QuantPolicy (messages.py): names and values both accepted by --quant-policy.
QUANT_POLICIES = {"none": 0, "int4": 4, "int8": 8, "fp8": 16, "fp8_e4m3": 16, "fp8_e5m2": 17, "turbo_quant": 42}
QUANT_NAMES = {0: "none", 4: "int4", 8: "int8", 16: "fp8", 17: "fp8_e5m2", 42: "turbo_quant"}
TURBOMIND_REFUSED_QUANT = (16, 17)  # TurbomindEngineConfig asserts: FP8 KV cache is not supported
QUANT_DEVICES = ("cuda", "ascend")  # PytorchEngineConfig: kv cache quantization only on CUDA and Ascend

# The variable that picks the devices an instance sees, per device type.
VISIBLE_DEVICES_ENV = {
    "cuda": "CUDA_VISIBLE_DEVICES",
    "ascend": "ASCEND_RT_VISIBLE_DEVICES",
    "maca": "MACA_VISIBLE_DEVICES",
    "camb": "MLU_VISIBLE_DEVICES",
}

# Environment overrides, applied to every launch group and validated like the field they replace.
ENV_OVERRIDES = {"engine": "LMDEPLOY_GATEWAY_ENGINE", "backend": "LMDEPLOY_GATEWAY_BACKEND", "device": "LMDEPLOY_GATEWAY_DEVICE"}

# api_server flags the launcher owns or must never pass: refused in extra_args, with the reason.
MANAGED_FLAGS = {
    "server-name": "the launcher binds every instance to 127.0.0.1",
    "server-port": "the launcher picks a free loopback port per instance",
    "api-keys": "the launcher passes an internal key that only the gateway holds",
    "allow-terminate-by-client": "it would let any key holder stop the backend",
    "proxy-url": "the gateway is the proxy; instances must not register anywhere else",
    "ssl": "the gateway talks plain HTTP to loopback instances",
    "dp": "dp > 1 starts its own api_servers on ports the gateway does not know; use gpus and tp",
    "nnodes": "multi-node serving is not launched by the gateway; add it under backends by URL",
    "node-rank": "multi-node serving is not launched by the gateway; add it under backends by URL",
    "model-name": "set `model_name` instead",
    "tp": "set `tp` instead",
    "backend": "set `backend` instead",
    "device": "set `device` instead",
    "cache-max-entry-count": "set `cache_max_entry_count` instead",
    "session-len": "set `session_len` instead",
    "max-batch-size": "set `max_batch_size` instead",
    "quant-policy": "set `quant_policy` instead",
    "enable-prefix-caching": "set `enable_prefix_caching` instead",
    "dtype": "set `dtype` instead",
    "chat-template": "set `chat_template` instead",
    "eager-mode": "set `eager_mode` instead",
    "role": "set `role` instead (and the model's `serving: distserve`)",
    "migration-backend": "set `migration_backend` instead",
}

# Flags in the api_server's "PyTorch engine arguments" group that TurboMind does not have.
PYTORCH_ONLY_FLAGS = frozenset(
    {
        "adapters",
        "eager-mode",
        "logprobs-mode",
        "dllm-block-length",
        "dllm-unmasking-strategy",
        "dllm-denoising-steps",
        "dllm-confidence-threshold",
        "enable-return-routed-experts",
        "distributed-executor-backend",
        "kernel-block-size",
        "prefix-cache-state-budget",
        "prefix-cache-decode-state-interval",
        "enable-microbatch",
        "enable-eplb",
        "role",
        "migration-backend",
        "cudagraph-capture-batch-sizes",
    }
)
TURBOMIND_ONLY_FLAGS = frozenset(
    {"cp", "rope-scaling-factor", "num-tokens-per-iter", "max-prefill-iters", "async", "communicator", "dist-init-addr"}
)

# Options of the simulated api_server (`python -m gateway.sim --help`) a group may set under `sim:`;
# the value says the type and lower bound. backend, max_batch_size and session_len come from the group.
SIM_OPTIONS: dict[str, tuple[str, float, bool]] = {
    "startup_delay": ("number", 0, False),  # seconds before the port opens, like model loading
    "initializing_for": ("number", 0, False),  # then /health answers 503 initializing this long
    "ttft": ("number", 0, False),
    "tpot": ("number", 0, False),
    "speed": ("number", 0, True),
    "prefill_tokens_per_s": ("number", 0, True),
    "batch_slowdown": ("number", 0, False),
    "kv_capacity_tokens": ("int", 1, False),
    "default_output_tokens": ("int", 1, False),
    "graceful_timeout": ("number", 0, False),
}

DEFAULT_SIM_INSTANCES = 2
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass(frozen=True)
class LaunchGroup:
    """One model served by one or more identical api_server instances the gateway starts, supervises and stops: `len(gpus) / tp` instances, each on its own devices."""

    model: str = setting(doc="A local path or a hub id, as `lmdeploy serve api_server` takes it.")
    model_name: str | None = setting(None, "The name clients use; default: the model path itself.")
    engine: str = setting("auto", "`lmdeploy`, `sim` (the bundled simulator), or `auto`: lmdeploy when it is installed and GPUs are visible, else the simulator.", choices=ENGINES)
    gpus: str | int | tuple[int, ...] = setting("all", "`all` visible devices, a count, or a list of device ids.", custom={"anyOf": [{"const": "all"}, {"type": "integer", "minimum": 1}, {"type": "array", "items": {"type": "integer", "minimum": 0}}, {"type": "string", "pattern": "^\\s*\\d+(\\s*,\\s*\\d+)*\\s*$"}]}, type_name="`all` \\| count \\| device ids")
    tp: int = setting(1, "Devices per instance (tensor parallelism).", min=1, max=64)
    instances: int | None = setting(None, f"Simulator instances (engine `sim`, or `auto` without GPUs); default {DEFAULT_SIM_INSTANCES}.", min=1, max=64)
    backend: str = setting("turbomind", "lmdeploy's engine; default `turbomind` on CUDA, `pytorch` on other devices.", choices=BACKENDS, shown_default="`turbomind` (cuda), `pytorch`")
    device: str = setting("cuda", "The accelerator type.", choices=DEVICES)
    cache_max_entry_count: float | None = setting(None, "Share of free device memory for the KV cache (`--cache-max-entry-count`).", min=0, max=1, exclusive=True)
    session_len: int | None = setting(None, "Longest sequence, prompt and output (`--session-len`).", min=1)
    max_batch_size: int | None = setting(None, "Sequences per batch (`--max-batch-size`); the balancer learns it as the batch slots.", min=1)
    quant_policy: int | None = setting(None, "KV cache quantization (`--quant-policy`); fp8 needs the pytorch backend.", custom={"anyOf": [{"enum": list(QUANT_POLICIES)}, {"enum": list(QUANT_NAMES)}]}, type_name=" \\| ".join(f"`{q}`" for q in QUANT_POLICIES))
    enable_prefix_caching: bool = setting(False, "Reuse the KV cache of shared prompt prefixes (`--enable-prefix-caching`).")
    dtype: str | None = setting(None, "Weights' dtype (`--dtype`).", choices=DTYPES)
    chat_template: str | None = setting(None, "A chat template name or JSON file (`--chat-template`).")
    eager_mode: bool = setting(False, "pytorch backend: no CUDA graphs (`--eager-mode`).")
    extra_args: tuple[str, ...] = setting((), "Further api_server flags, validated: flags the launcher owns (ports, keys, `--tp`, ...) are refused.")
    env: tuple[tuple[str, str], ...] = setting((), "Extra environment for every instance (the visible-devices variable is set by the launcher).", custom={"type": "object", "additionalProperties": {"type": ["string", "number", "boolean"]}}, type_name="mapping of name to value", shown_default="none")
    role: str = setting("hybrid", "lmdeploy's `--role`: `prefill` or `decode` for PD disaggregation (the model's `serving: distserve`).", choices=("hybrid", "prefill", "decode"))
    migration_backend: str = setting("DLSlime", "lmdeploy's `--migration-backend`, for role prefill or decode.", choices={"dlslime": "DLSlime", "mooncake": "Mooncake"})
    executable: str | None = setting(None, "The lmdeploy command; default `lmdeploy` on PATH, else `python -m lmdeploy`.")
    sim: tuple[tuple[str, Any], ...] = setting((), "Simulator options: " + ", ".join(SIM_OPTIONS) + " (see `gateway sim --help`).", custom={"type": "object", "properties": {k: {"type": "integer" if kind == "int" else "number", ("exclusiveMinimum" if excl else "minimum"): low} for k, (kind, low, excl) in SIM_OPTIONS.items()}, "additionalProperties": False}, type_name="mapping", shown_default="none")
    start_timeout: float = setting(900.0, "Seconds from spawn to a healthy /health (loading a big model takes minutes).", min=0, exclusive=True)
    max_restarts: int = setting(5, "Restarts in a row without a stable run; then the instance is given up.", min=0, max=1000)
    restart_backoff: float = setting(1.0, "Seconds before the first restart; doubles each time.", min=0, exclusive=True)
    restart_backoff_max: float = setting(60.0, "Longest delay between restarts.", min=0, exclusive=True)
    health_interval: float = setting(5.0, "Seconds between health checks of a healthy instance of this group.", min=0, exclusive=True)
    unhealthy_after: float = setting(30.0, "Seconds a live process may fail /health before it is restarted.", min=0, exclusive=True)
    stable_after: float = setting(300.0, "Seconds healthy that reset the restart count.", min=0, exclusive=True)
    index: int = internal(0)  # position under `launch`, for messages

    @property
    def served_name(self) -> str:
        return self.model_name or self.model

    @property
    def label(self) -> str:
        return f"launch[{self.index}]"

    def sim_instances(self) -> int:
        return self.instances if self.instances is not None else DEFAULT_SIM_INSTANCES


def read_launch(root: Section, env: Mapping[str, str] | None = None) -> tuple[LaunchGroup, ...]:
    """Every group under ``launch`` (a list, or one mapping); all problems are recorded on root."""
    env = os.environ if env is None else env
    overrides = _read_overrides(env, root.problems)
    groups = []
    for i, sub in enumerate(root.sections("launch")):
        g = _read_group(sub, i, overrides)
        if g is not None:
            groups.append(g)
    _check_across_groups(groups, root.problems)
    return tuple(groups)


def _read_overrides(env: Mapping[str, str], problems: Problems) -> dict[str, str]:
    """LMDEPLOY_GATEWAY_* variables, checked with the same enum rules as the fields."""
    choices = {"engine": ENGINES, "backend": BACKENDS, "device": DEVICES}
    present = {var: env[var] for var in ENV_OVERRIDES.values() if env.get(var, "").strip()}
    if not present:
        return {}
    sec = Section(present, "environment", problems)
    out = {}
    for key, var in ENV_OVERRIDES.items():
        if var in present:
            value = sec.enum(var, choices[key], None)
            if value is not None:
                out[key] = value
    return out


def _origin(key: str, overrides: dict[str, str]) -> str:
    """Where a value came from, for messages: the field, or the environment variable that replaced it."""
    return f"{ENV_OVERRIDES[key]} (environment)" if key in overrides else key


def _read_gpus(sub: Section) -> str | int | tuple[int, ...]:
    value = sub.raw("gpus", "all")
    if isinstance(value, str):
        norm = value.strip().lower()
        if norm == "all":
            return "all"
        if re.fullmatch(r"\d+(\s*,\s*\d+)*", norm):
            ids = [int(x) for x in norm.split(",")]
            value = ids if "," in norm else ids[0]
        else:
            sub.error("gpus", f"{value!r} is not valid; use 'all', a count (e.g. 2) or a list of device ids (e.g. [0, 1])")
            return "all"
    if isinstance(value, bool):
        sub.error("gpus", f"expected 'all', a count or a list of device ids, got {value!r}")
        return "all"
    if isinstance(value, int):
        if value < 1:
            sub.error("gpus", f"{value!r} is out of range; a count must be >= 1 (or use 'all')")
            return "all"
        return value
    if isinstance(value, list):
        ids: list[int] = []
        for j, item in enumerate(value):
            if isinstance(item, str) and item.strip().isdigit():
                item = int(item.strip())
            if isinstance(item, bool) or not isinstance(item, int) or item < 0:
                sub.problems.add(f"{sub.where('gpus')}[{j}]", f"expected a device id (an integer >= 0), got {item!r}")
                continue
            if item in ids:
                sub.problems.add(f"{sub.where('gpus')}[{j}]", f"device {item} is listed twice")
                continue
            ids.append(item)
        if not value:
            sub.error("gpus", "the list is empty; use 'all', a count or device ids")
        return tuple(ids) if ids else "all"
    sub.error("gpus", f"expected 'all', a count or a list of device ids, got {_type_name(value)}")
    return "all"


def _read_quant(sub: Section) -> int | None:
    value = sub.raw("quant_policy", None)
    if value is None:
        return None
    choices = ", ".join(QUANT_POLICIES) + " (or " + "/".join(str(v) for v in QUANT_NAMES) + ")"
    if isinstance(value, bool):
        sub.error("quant_policy", f"{value!r} is not a valid choice; choose one of: {choices}")
        return None
    if isinstance(value, int):
        if value in QUANT_NAMES:
            return value
    elif isinstance(value, str):
        norm = value.strip().lower()
        if norm in QUANT_POLICIES:
            return QUANT_POLICIES[norm]
        if norm.isdigit() and int(norm) in QUANT_NAMES:
            return int(norm)
    sub.error("quant_policy", f"{value!r} is not a valid choice; choose one of: {choices}")
    return None


def _read_env(sub: Section) -> tuple[tuple[str, str], ...]:
    value = sub.raw("env", None)
    if value is None:
        return ()
    if not isinstance(value, dict):
        sub.error("env", f"expected a mapping of variable names to values, got {_type_name(value)}")
        return ()
    out = []
    for k, v in value.items():
        name = str(k)
        where = f"{sub.where('env')}.{name}"
        if not _ENV_NAME.match(name):
            sub.problems.add(where, "is not a valid environment variable name")
        elif name in VISIBLE_DEVICES_ENV.values():
            sub.problems.add(where, f"{name} is set per instance by the launcher; choose devices with `gpus` and `tp`")
        elif isinstance(v, (dict, list)) or v is None:
            sub.problems.add(where, f"expected a string, got {_type_name(v)}")
        else:
            out.append((name, ("true" if v else "false") if isinstance(v, bool) else str(v)))
    return tuple(out)


def _read_sim(sub: Section) -> tuple[tuple[str, Any], ...]:
    s = sub.section("sim")
    out: list[tuple[str, Any]] = []
    for name, (kind, low, exclusive) in SIM_OPTIONS.items():
        if kind == "int":
            v = s.int(name, None, min=int(low))
        else:
            v = s.number(name, None, min=low, exclusive=exclusive)
        if v is not None:
            out.append((name, v))
    s.finish()
    return tuple(out)


def flag_name(arg: str) -> str | None:
    """The canonical name of an api_server flag (``--Session_Len=9`` -> ``session-len``); None for a value."""
    if not arg.startswith("-") or arg == "-" or re.fullmatch(r"-\d+(\.\d+)?", arg):
        return None
    # FlexibleArgumentParser treats '_' and '-' alike; `--a.b x` sets nested JSON under `a`.
    return arg.lstrip("-").split("=", 1)[0].split(".", 1)[0].replace("_", "-").lower()


def _read_group(sub: Section, index: int, overrides: dict[str, str]) -> LaunchGroup | None:
    before = len(sub.problems.items)
    # backend and migration_backend: None tells "not set" (derived below) from a choice.
    v = read_fields(LaunchGroup, sub, defaults={"backend": None, "migration_backend": None})
    model, engine, tp, instances, backend, device = v["model"], v["engine"], v["tp"], v["instances"], v["backend"], v["device"]
    eager, extra, executable, role, migration_backend = v["eager_mode"], list(v["extra_args"]), v["executable"], v["role"], v["migration_backend"]
    backoff, backoff_max = v["restart_backoff"], v["restart_backoff_max"]
    gpus = _read_gpus(sub)
    quant = _read_quant(sub)
    env = _read_env(sub)
    sim = _read_sim(sub)
    sub.finish()

    engine = overrides.get("engine", engine)
    device = overrides.get("device", device)
    explicit_backend = "backend" in overrides or backend is not None
    backend = overrides.get("backend", backend)
    if backend is None:
        backend = "turbomind" if device == "cuda" else "pytorch"  # TurboMind is CUDA-only

    # Cross-field rules; each message says why, and what to set instead.
    if explicit_backend and backend == "turbomind" and device != "cuda":
        sub.error(
            _origin("backend", overrides),
            f"turbomind runs only on CUDA GPUs, but {_origin('device', overrides)} is {device!r}; use backend: pytorch",
        )
    if quant is not None and quant in TURBOMIND_REFUSED_QUANT and backend == "turbomind":
        sub.error(
            "quant_policy",
            f"{QUANT_NAMES[quant]!r} is a PyTorch-engine option: TurboMind has no FP8 KV cache; use backend: pytorch, or int4/int8",
        )
    if quant and device not in QUANT_DEVICES:
        sub.error("quant_policy", f"KV cache quantization works only on cuda and ascend, not on device {device!r}")
    if eager and backend == "turbomind":
        sub.error("eager_mode", "is a PyTorch-engine option (it turns off CUDA graphs); TurboMind has none; use backend: pytorch")
    if instances is not None and engine == "lmdeploy":
        sub.error("instances", "applies to the simulator only; lmdeploy runs one instance per `tp` GPUs (choose them with `gpus`)")
    if isinstance(gpus, tuple) and gpus:
        n = len(gpus)
        if n < tp:
            sub.error("gpus", f"{n} device(s) listed but tp is {tp}: one instance needs {tp}")
        elif n % tp:
            sub.error("gpus", f"{n} devices do not split into instances of tp={tp}; {n % tp} would sit idle")
    elif isinstance(gpus, int):
        if gpus < tp:
            sub.error("gpus", f"a count of {gpus} is less than tp={tp}: one instance needs {tp}")
        elif gpus % tp:
            sub.error("gpus", f"{gpus} devices do not split into instances of tp={tp}; {gpus % tp} would sit idle")
    if backoff_max is not None and backoff is not None and backoff_max < backoff:
        sub.error("restart_backoff_max", f"{backoff_max:g} is less than restart_backoff ({backoff:g})")
    _check_extra_args(sub, extra, backend)
    if migration_backend is not None and role == "hybrid":
        sub.error("migration_backend", "applies only to role: prefill or role: decode")
    if executable is not None and engine == "sim":
        sub.error("executable", "names the lmdeploy command; engine sim runs the built-in simulator")

    if model is None or len(sub.problems.items) > before:
        return None
    return LaunchGroup(
        **{
            **v,
            "engine": engine,
            "backend": backend,
            "device": device,
            "role": role or "hybrid",
            "migration_backend": migration_backend or LaunchGroup.migration_backend,
        },
        gpus=gpus,
        quant_policy=quant,
        env=env,
        sim=sim,
        index=index,
    )


def _check_extra_args(sub: Section, extra: list[str], backend: str) -> None:
    for j, arg in enumerate(extra):
        name = flag_name(arg)
        if name is None:
            continue
        where = f"{sub.where('extra_args')}[{j}]"
        if name in MANAGED_FLAGS:
            sub.problems.add(where, f"{arg!r} is not allowed: {MANAGED_FLAGS[name]}")
        elif backend == "turbomind" and name in PYTORCH_ONLY_FLAGS:
            sub.problems.add(where, f"{arg!r} is a PyTorch-engine option that TurboMind does not have; use backend: pytorch")
        elif backend == "pytorch" and name in TURBOMIND_ONLY_FLAGS:
            sub.problems.add(where, f"{arg!r} is a TurboMind option that the PyTorch engine does not have; use backend: turbomind")


def _check_across_groups(groups: list[LaunchGroup], problems: Problems) -> None:
    names: dict[str, LaunchGroup] = {}
    for g in groups:
        other = names.get(g.served_name)
        if other is not None and other.model != g.model:
            problems.add(
                f"{g.label}.model_name",
                f"{g.served_name!r} is already served by {other.label} from a different model ({other.model!r}); "
                "one name must mean one model",
            )
        names.setdefault(g.served_name, g)
    # Two groups must not claim the same device: each instance assumes the whole device is its own.
    real = [g for g in groups if g.engine != "sim"]
    by_device: dict[str, dict[int, LaunchGroup]] = {}
    all_claims: dict[str, LaunchGroup] = {}
    for g in real:
        if g.gpus == "all" or isinstance(g.gpus, int):
            first = all_claims.get(g.device)
            if first is not None:
                problems.add(
                    f"{g.label}.gpus",
                    f"both {first.label} and {g.label} take {g.device} devices by count or 'all'; list each group's device ids",
                )
            all_claims.setdefault(g.device, g)
    for g in real:
        if isinstance(g.gpus, tuple):
            claimed = by_device.setdefault(g.device, {})
            for gpu in g.gpus:
                if gpu in claimed:
                    problems.add(f"{g.label}.gpus", f"device {gpu} is also used by {claimed[gpu].label}")
                claimed.setdefault(gpu, g)
            if g.device in all_claims:
                problems.add(
                    f"{g.label}.gpus",
                    f"{all_claims[g.device].label} takes {g.device} devices by count or 'all'; list each group's device ids",
                )


__all__ = ["LaunchGroup", "read_launch", "flag_name"]
