"""The internal key stays secret: no launched process (guard, shim, api_server, its workers) holds it
in its command line, which every local user can read in /proc/PID/cmdline.

Instances are launched through the gateway's launcher, both engines: the simulator and the fake
lmdeploy console script (which parses the flags the way lmdeploy does, in-process).
"""

from __future__ import annotations

import asyncio
import io
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from gateway.config import HealthConfig
from gateway.config.fields import Problems, Section
from gateway.config.launch import read_launch
from gateway.launcher import Launcher, LaunchError
from gateway.launcher.guard import group_members
from gateway.launcher.spawn import SHIM, launch_argv, plan_group, python_of
from gateway.routing.pool import BackendPool
from support import ROOT, alive, lmdeploy_python

pytestmark = pytest.mark.e2e

FAKE_LMDEPLOY = ROOT / "tests" / "fixtures" / "fake_lmdeploy"
FAST = {"health_interval": 0.2, "restart_backoff": 0.05, "restart_backoff_max": 0.2}
ASYNC = pytest.mark.asyncio(loop_scope="session")


def groups(*launch: dict):
    problems = Problems()
    out = read_launch(Section({"launch": list(launch)}, "", problems), env={})
    assert problems.items == []
    return out


def cmdlines_holding(secret: str) -> list[tuple[int, str]]:
    """Every process on the machine whose argv contains the secret (scans all of /proc)."""
    needle = secret.encode()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if needle in cmdline:
            found.append((int(name), cmdline.replace(b"\0", b" ").decode(errors="replace")))
    return found


async def until(predicate, timeout: float, what: str) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while asyncio.get_running_loop().time() < deadline:
        if predicate():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


async def launch_and_check(tmp_path: Path, group: dict, env: dict[str, str] | None = None, gpus=()) -> None:
    pool = BackendPool(HealthConfig(interval=0.1, timeout=1.0))
    health_client = httpx.AsyncClient(trust_env=False)
    pool.start(health_client)  # as the gateway does: the pool owns health
    devices = lambda device: (tuple(str(g) for g in gpus), "test devices")  # noqa: E731
    lm = Launcher(groups(group), pool, log_dir=tmp_path / "logs", poll_interval=0.05, stop_grace=5.0, devices=devices, env=env, progress=io.StringIO())
    await lm.start()
    pids: set[int] = set()
    try:
        await until(lambda: lm.status()["healthy"] == len(lm.instances), 20, "every instance healthy")
        for inst in lm.instances:
            pids |= {inst.pid, *group_members(inst.pid)}
        assert len(pids) >= 2 * len(lm.instances)  # the guard and the server, at least
        # The server got the key (it refuses anything else) ...
        async with httpx.AsyncClient(trust_env=False, timeout=10) as c:
            for inst in lm.instances:
                body = {"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
                ok = await c.post(f"{inst.url}/v1/chat/completions", json=body, headers={"authorization": f"Bearer {lm.backend_key}"})
                assert ok.status_code == 200
                refused = await c.post(f"{inst.url}/v1/chat/completions", json=body)
                assert refused.status_code == 401
        # ... and no command line on the machine holds it.
        assert cmdlines_holding(lm.backend_key) == []
        for pid in pids:  # the scan saw these processes: they are live and readable
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                assert f.read()
        logs = "".join(p.read_text() for p in (tmp_path / "logs").glob("*.log"))
        assert lm.backend_key not in logs
        assert "--api-keys '***'" in logs  # the log shows where the key goes, not the key
    finally:
        await lm.stop(5)
        await pool.stop()
        await health_client.aclose()
    await until(lambda: not any(alive(p) for p in pids), 5, "every launched process gone")


@ASYNC
async def test_simulator_instances_never_show_the_key_in_any_cmdline(tmp_path):
    await launch_and_check(tmp_path, {"model": "sim-model", "model_name": "chat", "engine": "sim", "instances": 2, **FAST})


@ASYNC
async def test_fake_lmdeploy_instances_never_show_the_key_in_any_cmdline(tmp_path):
    env = {**os.environ, "PATH": f"{FAKE_LMDEPLOY}{os.pathsep}{os.environ['PATH']}", "FAKE_LMDEPLOY_PYTHON": sys.executable, "FAKE_LMDEPLOY_WORKER": "1"}
    group = {"model": "internlm/internlm2_5-7b-chat", "model_name": "chat", "engine": "lmdeploy", "gpus": [0], **FAST}
    await launch_and_check(tmp_path, group, env=env, gpus=[0])


def test_the_shim_reads_the_key_from_a_pipe_and_appends_it_last(tmp_path):
    script = tmp_path / "show.py"
    script.write_text("import sys, os\nprint(repr(sys.argv))\nprint(open(f'/proc/{os.getpid()}/cmdline','rb').read().count(b'SECRETKEY'))\n")
    r, w = os.pipe()
    os.write(w, b"SECRETKEY\n")
    os.close(w)
    try:
        out = subprocess.run([sys.executable, SHIM, "--key-fd", str(r), "--script", str(script), "--", "--adapters", "a", "b"],
                             pass_fds=(r,), capture_output=True, text=True, timeout=30)  # fmt: skip
    finally:
        os.close(r)
    assert out.returncode == 0, out.stderr
    argv_line, count = out.stdout.splitlines()
    assert argv_line == repr([str(script), "--adapters", "a", "b", "--api-keys", "SECRETKEY"]) and count == "0"


def test_the_shim_refuses_an_empty_key_pipe(tmp_path):
    r, w = os.pipe()
    os.close(w)
    try:
        out = subprocess.run([sys.executable, SHIM, "--key-fd", str(r), "--module", "json.tool", "--"], pass_fds=(r,), capture_output=True, text=True, timeout=30)
    finally:
        os.close(r)
    assert out.returncode != 0 and "no usable key" in out.stderr


def test_a_non_python_lmdeploy_command_is_refused_with_the_reason(tmp_path):
    wrapper = tmp_path / "lmdeploy"
    wrapper.write_text("#!/bin/sh\nexec lmdeploy-real \"$@\"\n")
    wrapper.chmod(0o755)
    assert python_of(str(wrapper)) is None
    group = groups({"model": "m", "model_name": "chat", "engine": "lmdeploy", "gpus": [0]})[0]
    plan = plan_group(group, lambda d: (("0",), "test"), lambda: ((str(wrapper),), "test"))
    with pytest.raises(LaunchError, match="not a Python script; the internal key can only be handed to lmdeploy in-process"):
        launch_argv(plan, 1234, 5)


def test_a_console_script_runs_under_its_own_interpreter(tmp_path):
    script = tmp_path / "lmdeploy"
    script.write_text(f"#!{sys.executable}\nfrom lmdeploy.cli import run\nrun()\n")
    group = groups({"model": "m", "model_name": "chat", "engine": "lmdeploy", "gpus": [0]})[0]
    plan = plan_group(group, lambda d: (("0",), "test"), lambda: ((str(script),), "test"))
    argv = launch_argv(plan, 1234, 7)
    assert argv[:7] == [sys.executable, SHIM, "--key-fd", "7", "--script", str(script), "--"]
    assert argv[7:10] == ["serve", "api_server", "m"] and "--api-keys" not in argv
    module = plan_group(group, lambda d: (("0",), "test"), lambda: ((sys.executable, "-m", "lmdeploy"), "test"))
    assert launch_argv(module, 1234, 7)[:7] == [sys.executable, SHIM, "--key-fd", "7", "--module", "lmdeploy", "--"]


# -- the contract with the real lmdeploy CLI, where an interpreter with lmdeploy is at hand ------------------
LMDEPLOY_PROBE = """
import json, os, sys
from lmdeploy.cli.serve import SubCliServe

def api_server(args):  # stands in for serving: report what lmdeploy's own parser read
    cmdline = open(f"/proc/{os.getpid()}/cmdline", "rb").read()
    print(json.dumps({"api_keys": args.api_keys, "server_name": args.server_name, "server_port": args.server_port,
                      "model_name": args.model_name, "backend": args.backend, "tp": args.tp,
                      "key_in_cmdline": args.api_keys[0].encode() in cmdline}))

SubCliServe.api_server = staticmethod(api_server)
from lmdeploy.cli import run
run()
"""


def test_lmdeploys_own_parser_reads_the_key_the_shim_hands_it(tmp_path):
    python = lmdeploy_python()
    if python is None:
        pytest.skip("lmdeploy is not importable (no $LMDEPLOY_GATEWAY_TEST_LMDEPLOY_PYTHON, no .venv-lmdeploy/, not in this venv)")
    model = tmp_path / "model"
    model.mkdir()  # a local path: lmdeploy's entry point would try to download anything else
    probe = tmp_path / "probe.py"
    probe.write_text(LMDEPLOY_PROBE)
    group = groups({"model": str(model), "model_name": "chat", "engine": "lmdeploy", "gpus": [0]})[0]
    plan = plan_group(group, lambda d: (("0",), "test"), lambda: ((python, "-m", "lmdeploy"), "test"))
    r, w = os.pipe()
    os.write(w, b"0123abcd" * 8)
    os.close(w)
    try:
        argv = launch_argv(plan, 23456, r)
        assert argv[4:6] == ["--module", "lmdeploy"]
        argv[4:6] = ["--script", str(probe)]  # lmdeploy's CLI, with serving replaced by a report
        out = subprocess.run(argv, pass_fds=(r,), capture_output=True, text=True, timeout=300)
    finally:
        os.close(r)
    assert out.returncode == 0, out.stderr[-2000:]
    import json

    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen == {"api_keys": ["0123abcd" * 8], "server_name": "127.0.0.1", "server_port": 23456, "model_name": "chat",
                    "backend": "turbomind", "tp": 1, "key_in_cmdline": False}  # fmt: skip
