"""The README's run command in a fresh copy of the repository, as a new user runs it.

It creates a virtual environment and installs into it, which takes longer than the rest of the
suite together, so it runs only when asked: ``LMDEPLOY_GATEWAY_QUICKSTART=1 pytest tests/test_launcher_quickstart.py``.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import threading
import time

import httpx
import pytest

from support import ROOT, free_port

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(os.environ.get("LMDEPLOY_GATEWAY_QUICKSTART") != "1", reason="set LMDEPLOY_GATEWAY_QUICKSTART=1 to run")]


@pytest.mark.timeout(400)
def test_scripts_run_in_a_fresh_copy_answers_a_chat_request_within_a_minute(tmp_path):
    clone = tmp_path / "lmdeploy-gateway"
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for name in filter(None, files.decode().split("\0")):
        if (ROOT / name).is_file():
            (clone / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, clone / name)
    assert not (clone / ".gateway").exists() and not (clone / ".venv").exists()
    port = free_port()  # the example's 8080 may be taken on a test machine
    example = clone / "config.example.yaml"
    example.write_text(re.sub(r"(?m)^  port: 8080$", f"  port: {port}", example.read_text()))

    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    proc = subprocess.Popen(["./scripts/run"], cwd=clone, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 300  # venv + install
        key = None
        while key is None and time.monotonic() < deadline and proc.poll() is None:
            key = next((m.group(0) for line in list(lines) if (m := re.search(r"\bsk-[A-Za-z0-9_-]{20,}", line))), None)
            time.sleep(0.2)
        assert key, "".join(lines)[-4000:]
        assert key not in (clone / ".gateway" / "keys.yaml").read_text(), "only the hash is stored"
        started = time.monotonic()
        answer = None
        while time.monotonic() - started < 60 and proc.poll() is None:
            try:
                r = httpx.post(
                    f"http://127.0.0.1:{port}/v1/chat/completions",
                    json={"model": "internlm2_5-7b-chat", "messages": [{"role": "user", "content": "Hello!"}]},
                    headers={"authorization": f"Bearer {key}"},
                    timeout=10,
                    trust_env=False,
                )
                if r.status_code == 200:
                    answer = r.json()
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        assert answer is not None, "".join(lines)[-4000:]
        assert answer["choices"][0]["message"]["content"]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
