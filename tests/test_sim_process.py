"""The shared process helper (gateway/sim/process.py) that tests and the routing bench start simulators with."""

from __future__ import annotations

import socket
import sys

import pytest

from gateway.sim.process import LoopbackProcess, SimProcess, group_members

pytestmark = pytest.mark.e2e

# Forks a grandchild in the same process group, prints its pid, then both wait for a signal.
FORKING = "import os, sys, time\npid = os.fork()\nif pid:\n    print(pid, flush=True)\ntime.sleep(60)\n"


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def test_a_sim_is_ready_on_its_port_and_stop_leaves_nothing_behind():
    sim = SimProcess("--ttft", "0", model="m")
    try:
        assert sim.http.get("/health").json()["status"] == "healthy"
        assert [m["id"] for m in sim.http.get("/v1/models").json()["data"]] == ["m"]
        sim.control(health="unhealthy")
        assert sim.http.get("/health").status_code == 503
    finally:
        code = sim.stop()
    assert code == 0, sim.output()  # SIGTERM is a graceful exit for the simulator
    assert group_members(sim.pid) == set()
    assert port_is_free(sim.port)


def test_a_sim_that_exits_before_ready_fails_at_once_with_its_output():
    with pytest.raises(RuntimeError, match=r"(?s)exited with 2 before /health.*--tpot=-1.0: must be >= 0"):
        SimProcess("--tpot", "-1", ready_timeout=30)


def test_a_sim_not_ready_in_time_is_stopped_and_says_so():
    with pytest.raises(TimeoutError, match="timed out after 0.3s"):
        SimProcess("--startup-delay", "30", ready_timeout=0.3)


def test_stop_ends_the_whole_process_group_not_only_the_leader(tmp_path):
    proc = LoopbackProcess([sys.executable, "-c", FORKING], "forking", log=tmp_path / "out.log")
    try:
        proc.wait_for(lambda: (tmp_path / "out.log").read_text().strip() != "", 10, "the grandchild's pid")
        grandchild = int((tmp_path / "out.log").read_text().split()[0])
        assert group_members(proc.pid) == {proc.pid, grandchild}
    finally:
        proc.stop(grace=5)
    assert group_members(proc.pid) == set()


def test_kill_is_a_crash_and_stop_after_it_still_cleans_up():
    sim = SimProcess(model="m")
    try:
        sim.kill()
        assert sim.proc.returncode == -9
    finally:
        sim.stop()
    assert group_members(sim.pid) == set()
