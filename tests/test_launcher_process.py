"""The launcher with real subprocesses: the simulator, and a fake `lmdeploy` first on PATH.

Every test stops what it started and checks by pid that nothing survived.
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import random
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest

from gateway.config import HealthConfig
from gateway.config.fields import Problems, Section
from gateway.config.launch import read_launch
from gateway.launcher import Launcher
from gateway.launcher import process as launcher_process
from gateway.launcher.guard import group_members
from gateway.launcher.spawn import SIM_DEFAULT_MAX_BATCH_SIZE
from gateway.routing.pool import Backend, BackendPool
from support import alive, launched
from support import launched_pids as pids_of

ROOT = Path(__file__).resolve().parent.parent
FAKE_LMDEPLOY = ROOT / "tests" / "fixtures" / "fake_lmdeploy"
pytestmark = [pytest.mark.e2e, pytest.mark.asyncio(loop_scope="session")]  # the loop the async fixtures use

FAST = {"health_interval": 0.2, "restart_backoff": 0.05, "restart_backoff_max": 0.2}


def groups(*launch: dict):
    problems = Problems()
    out = read_launch(Section({"launch": list(launch)}, "", problems), env={})
    assert problems.items == []
    return out


def sim_group(**fields) -> dict:
    return {"model": "sim-model", "model_name": "chat", "engine": "sim", **FAST, **fields}


class CheckedLauncher(Launcher):
    """The launcher with its pool's health checker running, started and stopped as the gateway does."""

    async def start(self) -> None:
        self._health_client = httpx.AsyncClient(trust_env=False, timeout=5.0)
        self.pool.start(self._health_client)
        await super().start()

    async def stop(self, grace: float | None = None) -> None:
        await super().stop(grace)
        await self.pool.stop()
        await self._health_client.aclose()


def launcher(tmp_path: Path, *launch: dict, env: dict | None = None, gpus=(), **kwargs) -> tuple[Launcher, BackendPool]:
    pool = BackendPool(HealthConfig(interval=0.1, timeout=1.0))
    kwargs.setdefault("progress", io.StringIO())
    devices = lambda device: (tuple(str(g) for g in gpus), "test devices")  # noqa: E731
    lm = CheckedLauncher(groups(*launch), pool, log_dir=tmp_path / "logs", poll_interval=0.05, stop_grace=5.0, devices=devices, env=env, **kwargs)
    return lm, pool


def fake_lmdeploy_env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PATH": f"{FAKE_LMDEPLOY}{os.pathsep}{os.environ['PATH']}", "FAKE_LMDEPLOY_PYTHON": sys.executable, **extra}


async def until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def chat(model: str = "chat", max_tokens: int = 4, stream: bool = False) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens, "stream": stream}


@pytest.fixture
async def client():
    async with httpx.AsyncClient(trust_env=False, timeout=10.0) as c:
        yield c


# -- start, join, serve, stop --------------------------------------------------------------------------------
async def test_instances_join_the_pool_only_once_healthy_and_answer_only_the_internal_key(tmp_path, client):
    out = io.StringIO()
    lm, pool = launcher(tmp_path, sim_group(instances=3, sim={"startup_delay": 0.5, "initializing_for": 0.3}), progress=out, progress_tty=True)
    t0 = time.monotonic()
    async with launched(lm):
        assert time.monotonic() - t0 < 1.0, "start() must return while instances load"
        assert pool.eligible("chat") == []
        await until(lambda: any(i.state == "loading" for i in lm.instances), 5, "loading")
        assert pool.eligible("chat") == [], "a loading instance is not in rotation"
        assert all(b.health_status != "healthy" for b in pool if b.id in {i.id for i in lm.instances if i.state == "loading"})
        assert await lm.wait_ready(15)
        await until(lambda: lm.status()["healthy"] == 3, 15, "3 healthy instances")
        backends = list(pool)
        assert sorted(b.id for b in backends) == ["chat#0", "chat#1", "chat#2"]
        assert len({b.url for b in backends}) == 3
        for b in backends:
            assert b.healthy and b.origin == "launched" and b.static_models and b.models == frozenset({"chat"})
            assert b.url.startswith("http://127.0.0.1:") and b.api_key == lm.backend_key
            ok = await client.post(f"{b.url}/v1/chat/completions", json=chat(), headers={"authorization": f"Bearer {lm.backend_key}"})
            assert ok.status_code == 200, ok.text
            refused = await client.post(f"{b.url}/v1/chat/completions", json=chat())
            assert refused.status_code == 401
        status = lm.status()
        assert [r["state"] for r in status["instances"]] == ["healthy"] * 3 and status["failed"] == 0
        assert all(r["pid"] for r in status["instances"])
        assert re.fullmatch(r"[0-9a-f]{64}", lm.backend_key), "never a leading '-' that argparse would take for a flag"
        pids = pids_of(lm)
        assert len(pids) == 6  # a guard and an api_server per instance
        await until(lambda: out.getvalue().splitlines()[-1].count(" healthy ") == 3, 3, "the final progress line")
        text = out.getvalue()
        assert "chat#0 loading" in text and "chat#2 healthy" in text
        ports = [int(b.url.rsplit(":", 1)[1]) for b in backends]
    assert len(pool) == 0
    assert all(launcher_process.port_is_free(p) for p in ports), "a second start must find the ports free"
    assert [r["state"] for r in lm.status()["instances"]] == ["stopped"] * 3
    logs = sorted((tmp_path / "logs").glob("*.log"))
    assert [p.name for p in logs] == ["chat_0.log", "chat_1.log", "chat_2.log"]
    assert lm.backend_key not in logs[0].read_text(), "the internal key never reaches the log file"


async def test_several_groups_serve_several_models_beside_remote_backends_which_are_never_touched(tmp_path):
    lm, pool = launcher(tmp_path, sim_group(instances=1), sim_group(model="other-model", model_name="other", instances=1, max_batch_size=8))
    remote = pool.add(Backend(id="chat#0", url="http://10.0.0.12:23333", api_key="theirs", models=frozenset({"chat"})))
    async with launched(lm):
        await until(lambda: lm.status()["healthy"] == 2, 10, "healthy")
        assert {b.id: b.models for b in pool if b.origin == "launched"} == {"chat#1": frozenset({"chat"}), "other#0": frozenset({"other"})}
        # the balancer is told each launched engine's batch slots: the group's, else the sim's default
        assert {b.id: b.slots for b in pool} == {"chat#0": None, "chat#1": SIM_DEFAULT_MAX_BATCH_SIZE, "other#0": 8}
        assert pool.get("chat#0") is remote and remote.api_key == "theirs"
    assert list(pool) == [remote]


# -- supervision ----------------------------------------------------------------------------------------------
async def test_kill_9_under_load_keeps_serving_from_the_others_and_the_dead_one_rejoins(tmp_path, client):
    lm, pool = launcher(tmp_path, sim_group(instances=3, sim={"ttft": 0.01, "tpot": 0.002}))
    async with launched(lm):
        await until(lambda: lm.status()["healthy"] == 3, 15, "3 healthy instances")
        victim = lm.instances[1]
        served: dict[str, int] = {}
        failures: list[str] = []
        stop = asyncio.Event()

        async def traffic() -> None:
            while not stop.is_set():
                # What the router does: a healthy backend, and another one if the connection fails before any byte.
                for _ in range(3):
                    eligible = pool.eligible("chat")
                    if not eligible:
                        await asyncio.sleep(0.01)
                        continue
                    b = random.choice(eligible)
                    try:
                        r = await client.post(f"{b.url}/v1/chat/completions", json=chat(), headers={"authorization": f"Bearer {b.api_key}"})
                    except httpx.TransportError:
                        pool.report_unreachable(b)
                        continue
                    if r.status_code == 200:
                        served[b.id] = served.get(b.id, 0) + 1
                        break
                else:
                    failures.append("no backend answered")

        workers = [asyncio.ensure_future(traffic()) for _ in range(4)]
        await until(lambda: all(served.get(i.id, 0) >= 3 for i in lm.instances), 10, "traffic to every instance")
        server_pid = next(p for p in group_members(victim.pid) if p != victim.pid)
        os.kill(server_pid, signal.SIGKILL)
        backend = pool.get(victim.id)
        await until(lambda: not backend.healthy and backend.health_status in ("exited", "unreachable"), 1.0, "the dead instance out of rotation")
        before = dict(served)
        await until(lambda: victim.state == "healthy" and victim.restarts == 1, 10, "the dead instance back")
        assert pool.get(victim.id).healthy
        await until(lambda: served.get(victim.id, 0) > before.get(victim.id, 0), 10, "the restarted instance serving")
        stop.set()
        await asyncio.gather(*workers)
        assert failures == []
        assert sum(served.values()) > sum(before.values()), "traffic kept flowing"
        assert served.get(victim.id, 0) > before.get(victim.id, 0), "the restarted instance serves again"
        assert not alive(server_pid)


async def test_an_instance_that_never_becomes_healthy_fails_with_the_reason(tmp_path, caplog):
    caplog.set_level(logging.INFO, "gateway.launcher")
    lm, pool = launcher(tmp_path, sim_group(instances=1, start_timeout=3.0, max_restarts=0, sim={"initializing_for": 60}))
    async with launched(lm) as pids:
        await until(lambda: lm.instances[0].state == "loading" and lm.instances[0].health == "initializing", 10, "initializing")
        pids |= pids_of(lm)  # the instance fails and is stopped before the end
        assert await lm.wait_ready(10) is False
        inst = lm.instances[0]
        assert inst.state == "failed"
        assert "not healthy within start_timeout=3s (last /health: initializing)" in inst.error
        assert lm.failed_count() == 1 and lm.status()["failed"] == 1
        assert len(pool) == 0
        errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        assert any("last lines of" in m and "sim ready on http://127.0.0.1" in m for m in errors), errors


async def test_a_crash_loop_stops_after_max_restarts_and_is_reported(tmp_path, caplog):
    from gateway.metrics import REGISTRY

    caplog.set_level(logging.INFO, "gateway.launcher")
    record = tmp_path / "launches.jsonl"
    env = fake_lmdeploy_env(FAKE_LMDEPLOY_EXIT="3", FAKE_LMDEPLOY_RECORD=str(record))
    lm, pool = launcher(tmp_path, {"model": "m", "model_name": "crashy", "engine": "lmdeploy", "max_restarts": 2, **FAST}, env=env, gpus=[0])
    async with launched(lm, processes=False):
        await until(lambda: lm.instances[0].state == "crash_loop", 15, "crash_loop")
        inst = lm.instances[0]
        assert inst.restarts == 2
        assert record.exists(), inst.log.path.read_text()
        assert len(record.read_text().splitlines()) == 3, "N restarts, then it stops"
        assert "exited with code 3 before it became healthy; gave up after 3 attempt(s) in a row" in inst.error
        assert lm.failed_count() == 1
        assert await lm.wait_ready(1) is False
        errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        assert any("AssertionError: invalid cache_max_entry_count (fake lmdeploy)" in m for m in errors)
        assert any("-> crash_loop" in m for m in errors)
        lm.update_metrics()
        assert REGISTRY.get_sample_value("gateway_launched_instance_state", {"instance": "crashy#0", "state": "crash_loop"}) == 1
        assert REGISTRY.get_sample_value("gateway_launched_instance_restarts_total", {"instance": "crashy#0"}) == 2
        await until(lambda: inst.task is not None and inst.task.done(), 5, "its supervisor to end: nothing left to retry")
        assert len(record.read_text().splitlines()) == 3, "no more attempts once given up"


async def test_a_live_instance_that_turns_unhealthy_leaves_rotation_then_is_restarted(tmp_path, client):
    lm, pool = launcher(tmp_path, sim_group(instances=1, unhealthy_after=0.6))
    async with launched(lm):
        await until(lambda: lm.status()["healthy"] == 1, 10, "healthy")
        inst, backend = lm.instances[0], pool.get("chat#0")
        first_pid = inst.pid
        r = await client.post(f"{backend.url}/_sim/control", json={"health": "unhealthy"})
        assert r.status_code == 200
        await until(lambda: not backend.healthy, 1.0, "out of rotation")
        assert backend.health_status == "unhealthy"
        await until(lambda: inst.state == "unhealthy", 1.0, "the launcher reading the pool's verdict")
        await until(lambda: inst.state == "healthy" and inst.restarts == 1, 10, "restarted")
        assert inst.pid != first_pid and not alive(first_pid)
        assert pool.get("chat#0").healthy


async def test_a_sleeping_instance_is_out_of_rotation_but_not_restarted(tmp_path, client):
    lm, pool = launcher(tmp_path, sim_group(instances=1, unhealthy_after=0.3))
    async with launched(lm):
        await until(lambda: lm.status()["healthy"] == 1, 10, "healthy")
        inst, backend = lm.instances[0], pool.get("chat#0")
        headers = {"authorization": f"Bearer {lm.backend_key}"}
        assert (await client.post(f"{backend.url}/sleep", json={}, headers=headers)).status_code == 200
        await until(lambda: not backend.healthy, 1.0, "out of rotation")
        # Not a fixed sleep: the pool probes it again and again (each probe moves next_check), well
        # past unhealthy_after, and the supervisor reads each verdict within its poll interval.
        probes = {backend.next_check}
        await until(lambda: probes.add(backend.next_check) or len(probes) > 4, 10, "four more probes of the sleeping instance")
        assert inst.restarts == 0 and backend.health_status == "sleeping"
        assert (await client.post(f"{backend.url}/wakeup", json={}, headers=headers)).status_code == 200
        await until(lambda: backend.healthy, 2.0, "back in rotation")


async def test_a_port_taken_before_the_instance_binds_is_retried_on_another(tmp_path, monkeypatch):
    squatter = socket.socket()
    squatter.bind(("127.0.0.1", 0))
    squatter.listen()
    taken = squatter.getsockname()[1]
    real_pick = launcher_process.pick_port
    picks = iter([taken])
    monkeypatch.setattr(launcher_process, "pick_port", lambda avoid, prefer=None: next(picks, None) or real_pick(avoid))
    lm, pool = launcher(tmp_path, sim_group(instances=1, max_restarts=0))
    with squatter:
        async with launched(lm):
            await until(lambda: lm.status()["healthy"] == 1 or lm.failed_count(), 10, "healthy")
            inst = lm.instances[0]
            assert inst.state == "healthy" and inst.port != taken and inst.failures == 0


# -- shutdown -------------------------------------------------------------------------------------------------
async def test_sigterm_lets_a_streaming_request_finish_before_the_instance_exits(tmp_path, client, caplog):
    caplog.set_level(logging.INFO, "gateway.launcher")
    lm, pool = launcher(tmp_path, sim_group(instances=1, sim={"tpot": 0.03, "graceful_timeout": 10}))
    async with launched(lm) as pids:
        await until(lambda: lm.status()["healthy"] == 1, 10, "healthy")
        backend = pool.get("chat#0")
        pids |= pids_of(lm)
        headers = {"authorization": f"Bearer {lm.backend_key}"}
        chunks: list[str] = []
        stopping: asyncio.Future | None = None
        async with client.stream("POST", f"{backend.url}/v1/chat/completions", json=chat(max_tokens=40, stream=True), headers=headers) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    chunks.append(line[6:])
                    if stopping is None:
                        stopping = asyncio.ensure_future(lm.stop(8))
                        sigterm = lambda: any("stopping 1 instance(s)" in m.getMessage() for m in caplog.records)  # noqa: E731
                        await until(sigterm, 5, "SIGTERM on its way")
                        assert not stopping.done(), "stop() waits for the stream"
        assert chunks[-1] == "[DONE]"
        assert len(chunks) > 20, "the whole stream arrived"
        await stopping


GATEWAY_SCRIPT = textwrap.dedent(
    """
    import asyncio, json, sys
    import httpx
    from gateway.config import HealthConfig
    from gateway.config.fields import Problems, Section
    from gateway.config.launch import read_launch
    from gateway.launcher import Launcher
    from gateway.launcher.guard import group_members
    from gateway.routing.pool import BackendPool

    async def main():
        problems = Problems()
        launch = {"model": "m", "model_name": "chat", "engine": "lmdeploy", "gpus": [0, 1], "health_interval": 0.2}
        groups = read_launch(Section({"launch": launch}, "", problems), env={})
        pool = BackendPool(HealthConfig(interval=0.1))
        pool.start(httpx.AsyncClient(trust_env=False))  # as the gateway does: the pool owns health
        lm = Launcher(groups, pool, log_dir=sys.argv[1], poll_interval=0.05, devices=lambda d: (("0", "1"), "test"))
        await lm.start()
        while lm.status()["healthy"] < 2:
            await asyncio.sleep(0.05)
        pids = sorted({p for i in lm.instances for p in (i.pid, *group_members(i.pid))})
        print(json.dumps({"pids": pids, "ports": [i.port for i in lm.instances]}), flush=True)
        await asyncio.sleep(60)

    asyncio.run(main())
    """
)


async def test_a_gateway_killed_with_sigkill_leaves_no_process_behind(tmp_path):
    env = fake_lmdeploy_env(FAKE_LMDEPLOY_WORKER="1")
    proc = subprocess.Popen([sys.executable, "-c", GATEWAY_SCRIPT, str(tmp_path)], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    try:
        line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 20)
        info = json.loads(line)
        pids = set(info["pids"])
        assert len(pids) == 6, "a guard, an api_server and its worker, per instance"
        proc.kill()
        proc.wait(5)
        deadline = time.monotonic() + 15
        while any(alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(alive(p) for p in pids), f"orphans: {sorted(p for p in pids if alive(p))}"
        assert all(launcher_process.port_is_free(p) for p in info["ports"])
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
        proc.stdout.close()


# -- the fake lmdeploy: the spawn/ready/restart path without a GPU ------------------------------------------------
async def test_fake_lmdeploy_gets_the_exact_argv_and_devices_then_restarts_after_a_crash(tmp_path, client):
    record = tmp_path / "launches.jsonl"
    env = fake_lmdeploy_env(FAKE_LMDEPLOY_RECORD=str(record), FAKE_LMDEPLOY_LOAD="0.3")
    group = {"model": "internlm/internlm2_5-7b-chat", "model_name": "chat", "engine": "lmdeploy", "gpus": [0, 1, 2, 3], "tp": 2,
             "cache_max_entry_count": 0.5, **FAST}  # fmt: skip
    lm, pool = launcher(tmp_path, group, env=env, gpus=[0, 1, 2, 3])
    async with launched(lm):
        await until(lambda: lm.status()["healthy"] == 2, 15, "2 healthy instances")
        launches = [json.loads(line) for line in record.read_text().splitlines()]
        by_port = {str(i.port): i for i in lm.instances}
        for rec in launches:
            argv = rec["argv"]
            port = argv[argv.index("--server-port") + 1]
            inst = by_port[port]
            assert argv == [
                "serve", "api_server", "internlm/internlm2_5-7b-chat", "--server-name", "127.0.0.1", "--server-port", port,
                "--model-name", "chat", "--backend", "turbomind", "--tp", "2", "--cache-max-entry-count", "0.5",
                "--api-keys", lm.backend_key,
            ]  # fmt: skip
            assert rec["env"] == {"CUDA_VISIBLE_DEVICES": ",".join(inst.devices)}
        assert sorted(rec["env"]["CUDA_VISIBLE_DEVICES"] for rec in launches) == ["0,1", "2,3"]
        victim = lm.instances[0]
        r = await client.post(f"{pool.get(victim.id).url}/_sim/control", json={"exit": 1})
        assert r.status_code == 200
        await until(lambda: not pool.get(victim.id).healthy, 2.0, "out of rotation")
        await until(lambda: victim.state == "healthy" and victim.restarts == 1, 10, "back")
        relaunch = json.loads(record.read_text().splitlines()[-1])
        assert relaunch["env"] == {"CUDA_VISIBLE_DEVICES": ",".join(victim.devices)}
        ok = await client.post(f"{pool.get(victim.id).url}/v1/chat/completions", json=chat(), headers={"authorization": f"Bearer {lm.backend_key}"})
        assert ok.status_code == 200


async def test_engine_auto_says_which_engine_and_why_in_one_line(tmp_path, caplog):
    caplog.set_level(logging.INFO, "gateway.launcher")
    lm, _ = launcher(tmp_path, {"model": "m", "model_name": "auto-chat", "engine": "auto", "instances": 1, **FAST}, env={**os.environ, "PATH": "/nonexistent"})
    lm._lmdeploy = lambda executable: (None, "lmdeploy is not installed")
    async with launched(lm, processes=False):  # stopped before the instance may have spawned
        lines = [r for r in caplog.records if "engine" in r.getMessage() and "launch[0]" in r.getMessage()]
        assert len(lines) == 1
        assert lines[0].levelno == logging.WARNING
        assert lines[0].getMessage() == (
            "launch[0] auto-chat: engine sim, 1 instance(s) (lmdeploy is not installed); replies come from the SIMULATOR, not a model"
        )
