"""bench/overhead.py's CPU placement (--proxy-cpus / --load-cpus) and the fake backend's workers."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import pytest

from bench.overhead import cpu_list, descendants, free_port, pinned, process, wait_http

pytestmark = pytest.mark.e2e  # the pinning and the backend's workers are checked in real processes


def test_cpu_lists_parse_ranges_and_refuse_cpus_this_process_may_not_use():
    mine = sorted(os.sched_getaffinity(0))
    assert cpu_list(None) is None and cpu_list("") is None
    assert cpu_list(str(mine[0])) == {mine[0]}
    assert cpu_list(f"{mine[0]}-{mine[0]},{mine[-1]}") == {mine[0], mine[-1]}
    with pytest.raises(SystemExit, match="not available"):
        cpu_list(str(max(mine) + 1000))


def test_a_pinned_child_runs_on_its_cpus_only():
    cpu = min(os.sched_getaffinity(0))
    out = subprocess.run([sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"], preexec_fn=pinned({cpu}),
                         capture_output=True, text=True, timeout=30).stdout
    assert out.strip() == f"[{cpu}]"
    assert pinned(None) is None


def test_the_fake_backend_serves_from_several_workers_on_one_port():
    port = free_port()
    with process([sys.executable, "bench/fake_backend.py", "--port", str(port), "--workers", "3"]) as proc:
        wait_http(f"http://127.0.0.1:{port}/health", proc=proc)
        assert len(descendants(proc.pid)) == 2  # the first process and two forks share the port
        for _ in range(6):  # fresh connections: the kernel spreads them over the workers
            r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json={"model": "bench-model"}, timeout=5)
            assert r.status_code == 200 and r.json()["object"] == "chat.completion"
    assert proc.poll() is not None  # stopped with its process group, the forks with it
