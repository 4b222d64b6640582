"""The simulator's command line, parsed once into a typed ``SimConfig``.

Flag names follow ``lmdeploy serve api_server`` where the real server has the same knob
(``--api-keys``, ``--allow-terminate-by-client``, ``--max-batch-size``, ``--session-len`` ...),
so a launcher can build both command lines from one description. Every check runs before the
port opens and all problems are reported together.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SimConfig:
    host: str
    port: int
    models: tuple[str, ...]
    api_keys: tuple[str, ...]
    allow_terminate_by_client: bool
    enable_abort_handling: bool
    backend: str
    disable_docs: bool
    disable_metrics: bool
    # timing (seconds, at speed 1)
    ttft: float
    tpot: float
    speed: float
    prefill_tokens_per_s: float
    batch_slowdown: float
    startup_delay: float
    initializing_for: float
    # engine capacity
    max_batch_size: int
    kv_capacity_tokens: int
    block_tokens: int
    session_len: int
    default_output_tokens: int
    # observability and lifecycle
    metrics_interval: float
    record_limit: int
    graceful_timeout: float
    log_level: str
    # PD disaggregation (lmdeploy's --role / --migration-backend spellings)
    role: str = "Hybrid"
    migration_backend: str = "DLSlime"
    cache_hold_seconds: float = 60.0
    # a cold engine (see engine.Timing)
    cold_steps: int = 0
    cold_factor: float = 1.0

    @property
    def model(self) -> str:
        """The main served model; the others act like LoRA adapters."""
        return self.models[0]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m gateway.sim",
        description="Simulated `lmdeploy serve api_server`: same routes, a continuous-batching timing model, no GPU.",
    )
    a = p.add_argument_group("server")
    a.add_argument("--host", default="127.0.0.1")
    a.add_argument("--port", type=int, required=True, help="0 picks a free port (printed in the ready line)")
    a.add_argument("--model", dest="models", action="append", required=True, metavar="NAME",
                   help="served model name; repeat it: the first is the main model, the others are listed like LoRA adapters")
    a.add_argument("--api-keys", nargs="*", default=None, metavar="KEY",
                   help="like lmdeploy: every route but /health, /docs, /redoc, /nodes needs `Authorization: Bearer KEY`")
    a.add_argument("--allow-terminate-by-client", action="store_true", help="GET /terminate really stops the process")
    a.add_argument("--enable-abort-handling", action="store_true", help="POST /abort_request works (else 501)")
    a.add_argument("--backend", choices=("pytorch", "turbomind"), default="pytorch",
                   help="turbomind answers 501 on the distributed weight-update routes, like lmdeploy")
    a.add_argument("--disable-fastapi-docs", dest="disable_docs", action="store_true", help="no GET / and /openapi.json")
    a.add_argument("--disable-metrics", action="store_true", help="no GET /metrics")
    a.add_argument("--log-level", default="warning", type=str.lower, choices=("critical", "error", "warning", "info", "debug"),
                   help="uvicorn's log level (lmdeploy spells it in capitals; both work)")

    t = p.add_argument_group("timing (seconds at --speed 1; --ttft 0 --tpot 0 answers instantly, bypassing the scheduler)")
    t.add_argument("--ttft", type=float, default=0.02, help="fixed extra latency before a request reaches the engine")
    t.add_argument("--tpot", type=float, default=0.005, help="decode step time at batch size 1")
    t.add_argument("--speed", type=float, default=1.0, help="divides every compute time: a faster or slower GPU")
    t.add_argument("--prefill-tokens-per-s", type=float, default=20000.0, help="prefill rate for uncached prompt tokens")
    t.add_argument("--batch-slowdown", type=float, default=0.02, help="decode step = tpot * (1 + batch_size * this)")
    t.add_argument("--cold-steps", type=int, default=0,
                   help="the engine's first N steps are slow (kernels not yet warm, as a real api_server's first batches)")
    t.add_argument("--cold-factor", type=float, default=1.0, help="how many times slower those first steps are")
    t.add_argument("--startup-delay", type=float, default=0.0, help="sleep before opening the port, like model loading")
    t.add_argument("--initializing-for", type=float, default=0.0,
                   help="after the port opens, /health answers 503 initializing for this long")

    e = p.add_argument_group("engine")
    e.add_argument("--max-batch-size", type=int, default=64, help="batch slots; more requests wait in the queue")
    e.add_argument("--kv-capacity-tokens", type=int, default=200_000,
                   help="KV cache size: bounds running tokens (prompt + output, reserved at admission) and the prefix cache")
    e.add_argument("--block-size", dest="block_tokens", type=int, default=64, help="prefix-cache block, in tokens")
    e.add_argument("--session-len", type=int, default=32768,
                   help="context window: longer prompts get 400 context_length_exceeded, outputs are capped to fit")
    e.add_argument("--default-output-tokens", type=int, default=16, help="output length when the request sets no maximum")

    d = p.add_argument_group("PD disaggregation (lmdeploy's flags)")
    d.add_argument("--role", default="Hybrid", choices=("Hybrid", "Prefill", "Decode"),
                   help="Prefill: answers with_cache requests with cache_block_ids and holds the blocks; Decode: takes migration_request")
    d.add_argument("--migration-backend", default="DLSlime", choices=("DLSlime", "Mooncake"))
    d.add_argument("--cache-hold-seconds", type=float, default=60.0,
                   help="a prefill instance frees preserved blocks nobody migrated or freed after this long")

    o = p.add_argument_group("observability")
    o.add_argument("--metrics-interval", type=float, default=10.0,
                   help="seconds between refreshes of the /metrics gauges (lmdeploy: 10); 0 refreshes on every scrape")
    o.add_argument("--record-limit", type=int, default=10_000, help="requests kept for GET /_sim/requests (oldest dropped)")
    o.add_argument("--graceful-timeout", type=float, default=5.0,
                   help="on SIGTERM, wait this long for in-flight requests before cancelling them")
    return p


def parse_args(argv: list[str] | None = None) -> SimConfig:
    parser = build_parser()
    ns = parser.parse_args(argv)
    errors = _check(ns)
    if errors:
        parser.error("; ".join(errors))  # exits 2, like lmdeploy's argparse errors
    return SimConfig(
        host=ns.host,
        port=ns.port,
        models=tuple(dict.fromkeys(ns.models)),
        # lmdeploy drops empty strings; an empty list means no auth.
        api_keys=tuple(k for k in (ns.api_keys or ()) if k),
        allow_terminate_by_client=ns.allow_terminate_by_client,
        enable_abort_handling=ns.enable_abort_handling,
        backend=ns.backend,
        disable_docs=ns.disable_docs,
        disable_metrics=ns.disable_metrics,
        ttft=ns.ttft,
        tpot=ns.tpot,
        speed=ns.speed,
        prefill_tokens_per_s=ns.prefill_tokens_per_s,
        batch_slowdown=ns.batch_slowdown,
        startup_delay=ns.startup_delay,
        initializing_for=ns.initializing_for,
        max_batch_size=ns.max_batch_size,
        kv_capacity_tokens=ns.kv_capacity_tokens,
        block_tokens=ns.block_tokens,
        session_len=ns.session_len,
        default_output_tokens=ns.default_output_tokens,
        metrics_interval=ns.metrics_interval,
        record_limit=ns.record_limit,
        graceful_timeout=ns.graceful_timeout,
        log_level=ns.log_level,
        role=ns.role,
        migration_backend=ns.migration_backend,
        cache_hold_seconds=ns.cache_hold_seconds,
        cold_steps=ns.cold_steps,
        cold_factor=ns.cold_factor,
    )


def _check(ns: argparse.Namespace) -> list[str]:
    errors: list[str] = []

    def need(ok: bool, flag: str, value: object, rule: str) -> None:
        if not ok:
            errors.append(f"{flag}={value!r}: must be {rule}")

    need(0 <= ns.port <= 65535, "--port", ns.port, "in 0..65535")
    for name in ns.models:
        need(bool(name.strip()), "--model", name, "a non-empty name")
    for flag in ("ttft", "tpot", "batch_slowdown", "startup_delay", "initializing_for", "metrics_interval", "graceful_timeout"):
        value = getattr(ns, flag)
        need(value >= 0, "--" + flag.replace("_", "-"), value, ">= 0")
    need(ns.speed > 0, "--speed", ns.speed, "> 0")
    need(ns.cold_steps >= 0, "--cold-steps", ns.cold_steps, ">= 0")
    need(ns.cold_factor >= 1, "--cold-factor", ns.cold_factor, ">= 1")
    need(ns.prefill_tokens_per_s > 0, "--prefill-tokens-per-s", ns.prefill_tokens_per_s, "> 0")
    need(ns.max_batch_size >= 1, "--max-batch-size", ns.max_batch_size, ">= 1")
    need(ns.block_tokens >= 1, "--block-size", ns.block_tokens, ">= 1")
    need(ns.kv_capacity_tokens >= ns.block_tokens, "--kv-capacity-tokens", ns.kv_capacity_tokens, ">= --block-size")
    need(ns.session_len >= 2, "--session-len", ns.session_len, ">= 2")
    need(ns.default_output_tokens >= 1, "--default-output-tokens", ns.default_output_tokens, ">= 1")
    need(ns.cache_hold_seconds > 0, "--cache-hold-seconds", ns.cache_hold_seconds, "> 0")
    need(ns.role == "Hybrid" or ns.backend == "pytorch", "--role", ns.role, "Hybrid with --backend turbomind (PD needs pytorch)")
    need(ns.record_limit >= 0, "--record-limit", ns.record_limit, ">= 0")
    return errors
