#!/usr/bin/env bash
# GPU end-to-end smoke check: the gateway launching a real lmdeploy api_server (pytorch backend)
# on a tiny random-weight model, and OpenAI SDK requests through it. See deploy/gpu_smoke.py.
#
#   bash deploy/gpu_smoke.sh            # from the repo root, on a machine with one CUDA GPU
#
# Missing Python packages are installed from .whl/ into /tmp/site, with no index (cp312 wheels:
# lmdeploy without TurboMind, the gateway's and lmdeploy's dependencies, openai; fill it beforehand,
# with network: bash deploy/gpu_smoke_wheels.sh). Results go to $OUT (summary.json, smoke.log,
# gateway.log, api_server.log, vlm_server.log, backend_metrics.txt, gateway_metrics.txt,
# balancer_state.jsonl).
# Environment: GPU_SMOKE_ENGINE=sim (no GPU: the bundled simulator), GPU_SMOKE_BUILD=1 (with sim: build
# the tiny models anyway), GPU_SMOKE_VLM=0 (no tiny Qwen2-VL), GPU_SMOKE_BUDGET (seconds, default 360),
# GPU_SMOKE_PYTHON (default python3).
set -u -o pipefail
cd "$(dirname "$0")/.." || exit 2
export OUT="${OUT:-/tmp/gpu_smoke_out}"
mkdir -p "$OUT"
PY="${GPU_SMOKE_PYTHON:-python3}"
LOG="$OUT/smoke.log"
: >"$LOG"
if compgen -G ".whl/*.whl" >/dev/null; then
  echo "installing $(ls .whl/*.whl | wc -l) wheels from .whl/ into /tmp/site" | tee -a "$LOG"
  timeout 300 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >>"$LOG" 2>&1 \
    || { echo "pip install from .whl/ failed:"; tail -20 "$LOG"; exit 3; }
  export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
  export PATH="/tmp/site/bin:$PATH"
else
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
budget="${GPU_SMOKE_BUDGET:-360}"
# The script stops itself within its budget; timeout is the backstop (SIGTERM, then SIGKILL 30 s later).
timeout -k 30 $((budget + 30)) "$PY" deploy/gpu_smoke.py 2>&1 | tee -a "$LOG"
rc=${PIPESTATUS[0]}
echo "gpu_smoke exit status: $rc" | tee -a "$LOG"
exit "$rc"
