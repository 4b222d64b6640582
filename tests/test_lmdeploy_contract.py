"""The contract with the real backend, checked by LMDeploy's own code where it is importable.

- Every launcher argv (hybrid and prefill/decode, each engine option) goes through lmdeploy's own
  ``lmdeploy serve api_server`` parser.
- Every body the gateway forwards (what the simulator received through a real gateway) is
  validated by lmdeploy's own request models for its route.

lmdeploy needs torch, so it is not a test dependency: the interpreter is
``$LMDEPLOY_GATEWAY_TEST_LMDEPLOY_PYTHON``, else ``.venv-lmdeploy/bin/python`` in the checkout
(git-ignored; ``python3 -m venv .venv-lmdeploy && .venv-lmdeploy/bin/pip install lmdeploy``), else
this one. Without lmdeploy in any of them the tests are skipped, and say so.
"""

from __future__ import annotations

import base64
import json
import subprocess

import httpx
import pytest

from gateway.config import parse_config
from gateway.state.keys import hash_key, new_key
from gateway.launcher.spawn import lmdeploy_args, plan_group
from support import GatewayServer, Sim, lmdeploy_python

pytestmark = pytest.mark.e2e


def run_in_lmdeploy(script: str, payload: object) -> object:
    python = lmdeploy_python()
    if python is None:
        pytest.skip("lmdeploy is not importable (no $LMDEPLOY_GATEWAY_TEST_LMDEPLOY_PYTHON, no .venv-lmdeploy/, not in this venv): the contract with its own parser and request models is not checked here")
    out = subprocess.run([python, "-c", script], input=json.dumps(payload), capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


# -- launcher argv -----------------------------------------------------------------------------------

PARSE_ARGV = """
import json, sys
from lmdeploy.cli.cli import CLI
from lmdeploy.cli.serve import SubCliServe
CLI.add_parsers()
SubCliServe.add_parsers()
out = []
for argv in json.load(sys.stdin):
    try:
        ns = CLI.parser.parse_args(argv)
    except SystemExit as exc:
        out.append({"error": f"argparse exit {exc.code}"})
        continue
    out.append({k: v for k, v in vars(ns).items() if isinstance(v, (str, int, float, bool, list, type(None)))})
print(json.dumps(out))
"""

GROUPS = [
    {"model": "/models/m", "model_name": "m", "engine": "lmdeploy", "gpus": [0]},
    {"model": "/models/m", "model_name": "m", "engine": "lmdeploy", "gpus": [0, 1], "tp": 2, "backend": "turbomind",
     "cache_max_entry_count": 0.5, "session_len": 32768, "max_batch_size": 64, "quant_policy": "int8",
     "enable_prefix_caching": True, "dtype": "bfloat16"},
    {"model": "/models/m", "model_name": "m", "engine": "lmdeploy", "gpus": [0], "backend": "pytorch", "eager_mode": True,
     "quant_policy": "fp8", "device": "cuda"},
    {"model": "/models/m", "model_name": "m", "engine": "lmdeploy", "gpus": [0], "backend": "pytorch", "device": "ascend"},
    {"model": "/models/m", "model_name": "pd", "engine": "lmdeploy", "gpus": [0], "backend": "pytorch", "role": "prefill", "migration_backend": "DLSlime"},
    {"model": "/models/m", "model_name": "pd", "engine": "lmdeploy", "gpus": [1], "backend": "pytorch", "role": "decode", "migration_backend": "Mooncake"},
]  # fmt: skip


def test_lmdeploys_own_parser_accepts_every_launcher_argv():
    # One config per hybrid group (each may take every device); the prefill/decode pair together.
    configs = [[g] for g in GROUPS if "role" not in g] + [[g for g in GROUPS if "role" in g]]
    launch = [
        group
        for groups in configs
        for group in parse_config({"auth": {"disabled": True}, "launch": groups, "models": {"pd": {"serving": "distserve"}} if "role" in groups[0] else {}}, env={}).launch
    ]
    plans = [plan_group(g, lambda d: (("0", "1"), "test"), lambda: (("lmdeploy",), "test")) for g in launch]
    argvs = [[*lmdeploy_args(p, 23333), "--api-keys", "k"] for p in plans]  # what the shim hands lmdeploy's CLI
    parsed = run_in_lmdeploy(PARSE_ARGV, argvs)
    for group, argv, ns in zip(GROUPS, argvs, parsed):
        assert "error" not in ns, (argv, ns)
        assert ns["server_port"] == 23333 and ns["server_name"] == "127.0.0.1" and ns["api_keys"] == ["k"]
        assert ns["model_name"] == group["model_name"]
        assert ns["backend"] == group.get("backend", "turbomind")
        for field in ("tp", "session_len", "max_batch_size", "cache_max_entry_count", "dtype", "device", "migration_backend"):
            if field in group:
                assert ns[field] == group[field], (field, ns[field])
        if "role" in group:
            assert ns["role"] == group["role"].capitalize()
        assert not ns.get("allow_terminate_by_client") and not ns.get("proxy_url")


# -- forwarded bodies ---------------------------------------------------------------------------------

VALIDATE_BODIES = """
import json, sys
from lmdeploy.serve.openai import protocol as p
from lmdeploy.serve.openai.responses.protocol import ResponsesRequest
from lmdeploy.serve.anthropic.protocol import MessagesRequest
models = {
    "/v1/chat/completions": p.ChatCompletionRequest,
    "/v1/completions": p.CompletionRequest,
    "/v1/responses": ResponsesRequest,
    "/v1/messages": MessagesRequest,
    "/generate": p.GenerateReqInput,
    "/pooling": p.PoolingRequest,
    "/v1/encode": p.EncodeRequest,
    "/get_ppl": p.PPLRequest,
}
out = []
for path, body in json.load(sys.stdin):
    try:
        models[path].model_validate(body)
        out.append(None)
    except Exception as exc:
        out.append(f"{type(exc).__name__}: {exc}"[:600])
print(json.dumps(out))
"""

PNG = "data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n\x1a\n" + b"\x00" * 32).decode()
EXTRA_ROUTES = ["/generate", "/pooling", "/v1/encode", "/get_ppl"]
REQUESTS = [
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}),
    ("/v1/chat/completions", {"model": "m", "stream": True, "stream_options": {"include_usage": True}, "temperature": 0.2, "top_p": 0.9,
                              "messages": [{"role": "system", "content": "be brief"},
                                           {"role": "user", "content": [{"type": "text", "text": "what is this?"},
                                                                        {"type": "image_url", "image_url": {"url": PNG}}]}]}),
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "weather?"}], "tool_choice": "auto",
                              "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}],
                              "session_id": 7, "input_ids": [1, 2]}),  # engine knobs: dropped by the gateway
    ("/v1/completions", {"model": "m", "prompt": "Once upon a time", "max_tokens": 4, "stream": False}),
    ("/v1/messages", {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "describe"}, {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG.split(",", 1)[1]}}]}]}),
    ("/generate", {"model": "m", "prompt": "hello", "max_tokens": 3}),
    ("/generate", {"model": "m", "input_ids": [1, 2, 3], "max_tokens": 3}),
    ("/pooling", {"model": "m", "input": "hello"}),
    ("/v1/encode", {"model": "m", "input": ["a b", "c"]}),
    ("/get_ppl", {"model": "m", "input": [1, 2, 3]}),
]  # fmt: skip


def test_every_forwarded_body_is_valid_for_lmdeploys_own_request_models():
    if lmdeploy_python() is None:
        run_in_lmdeploy("", None)  # skips, saying why
    key = new_key()
    sim = Sim("m", api_key="backend-secret")
    try:
        cfg = {
            "auth": {"keys": [{"name": "k", "hash": hash_key(key), "routes": ["/v1/chat/completions", "/v1/completions", "/v1/messages", *EXTRA_ROUTES]}]},
            "backends": [{"url": sim.url, "api_key": "backend-secret"}],
            "health": {"interval": 0.2, "timeout": 1.0},
            "models": {"m": {"routes": EXTRA_ROUTES}},
        }
        with GatewayServer(cfg) as gw:
            sim.clear()
            for path, body in REQUESTS:
                headers = {"authorization": f"Bearer {key}", "anthropic-version": "2023-06-01"}
                r = httpx.post(gw.url + path, headers=headers, json=body, timeout=30, trust_env=False)
                assert r.status_code == 200, (path, r.text)
            received = [(rec["path"], rec["body"]) for rec in sim.requests() if rec["method"] == "POST"]
    finally:
        sim.stop()
    assert [p for p, _ in received] == [p for p, _ in REQUESTS]
    assert "session_id" not in received[2][1] and "input_ids" not in received[2][1]  # dropped before lmdeploy sees them
    assert received[6][1]["input_ids"] == [1, 2, 3]  # kept on /generate only
    problems = run_in_lmdeploy(VALIDATE_BODIES, received)
    assert problems == [None] * len(received), [(p, why) for (p, _), why in zip(received, problems) if why]
