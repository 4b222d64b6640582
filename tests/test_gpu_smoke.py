"""deploy/gpu_smoke.py, the GPU end-to-end check, run here on the simulator (GPU_SMOKE_ENGINE=sim):
the same flow of checks through a real gateway process, so the script cannot rot between the
sessions that have a GPU. It must pass every check and leave nothing running."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parent.parent


def test_the_gpu_smoke_check_passes_on_the_simulator(tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, GPU_SMOKE_ENGINE="sim", OUT=str(out), GPU_SMOKE_WORK=str(tmp_path / "work"), PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "deploy/gpu_smoke.py"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    checks = summary["checks"]
    assert summary["ok"] and not summary["failed_required"] and not summary["failed_optional"] and summary["left_running"] == []
    for name in ("chat_completion", "chat_stream", "image_request_text_model", "no_key_401", "bad_key_401", "terminate_refused",
                 "nodes_add_refused", "gateway_metrics_plain_key_403", "backend_metrics_parsed", "load_gateway_cold",
                 "gateway_no_queue_started", *(f"load_{path}_{i}" for i in (1, 2, 3) for path in ("gateway", "direct", "gateway_no_queue")),
                 "disconnect_aborts"):
        assert checks[name]["ok"], (name, checks[name])
    assert checks["load_gateway_cold"]["result"]["errors"] == 0 and checks["disconnect_aborts"]["result"]["tokens_generated"] < 1800
    warm = summary["load_warm_median"]
    assert set(warm) == {"gateway", "direct", "gateway_no_queue"} and all(w["runs"] == 3 and w["errors"] == 0 for w in warm.values())
    learnt = [json.loads(line) for line in (out / "balancer_state.jsonl").read_text().splitlines()]
    assert any(line.get("policy") == "min_expected_latency" and "tiny-chat#0" in line.get("backends", {}) for line in learnt)
