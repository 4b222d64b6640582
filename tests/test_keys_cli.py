"""``gateway keys`` against keys files (the in-memory store), and the running gateway reloading them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import yaml

from gateway.cli import main as cli_main
from gateway.config import load_config
from support import ROOT, GatewayServer, Sim, free_port, gateway_config, wait_until

pytestmark = pytest.mark.e2e

MODEL = "test-model"


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = cli_main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def _secret(out: str) -> str:
    return next(line.strip() for line in out.splitlines() if line.strip().startswith("sk-"))


@pytest.mark.parametrize("name", ["x\nadmin: true", "a b", "evil}, admin: true, x: {", "", "é", "x" * 65, "- {hash: y}"])
def test_a_name_that_is_not_a_plain_identifier_is_refused_and_nothing_is_written(tmp_path, capsys, name):
    f = tmp_path / "keys.yaml"
    rc, out, err = _run(capsys, "keys", "create", "--name", name, "--file", str(f))
    assert rc == 2 and "is not valid" in err and "sk-" not in out
    assert not f.exists()


def test_create_writes_yaml_that_loads_back_with_every_field(tmp_path, capsys):
    f = tmp_path / "keys.yaml"
    rc, out, _ = _run(capsys, "keys", "create", "--name", "ops@team", "--file", str(f), "--models", "a,b", "--rpm", "10",
                      "--tpm", "1000", "--concurrency", "3", "--admin", "--expires", "2099-01-01", "--budget", "5000", "--budget-period", "day")
    assert rc == 0
    secret = _secret(out)
    assert secret not in f.read_text()  # only the hash is stored
    assert oct(f.stat().st_mode & 0o777) == "0o600"
    cfg_path = tmp_path / "gw.yaml"
    cfg_path.write_text(yaml.safe_dump({"auth": {"keys_file": "keys.yaml"}, "backends": [{"url": "http://127.0.0.1:9"}]}))
    (key,) = load_config(cfg_path).auth.keys
    assert (key.name, key.models, key.rate_limit_rpm, key.rate_limit_tpm, key.max_concurrent, key.admin) == ("ops@team", ("a", "b"), 10, 1000, 3, True)
    assert (key.budget_tokens, key.budget_period) == (5000, "day") and key.expires_at and key.expires_at > 4e9
    from gateway.state.keys import hash_key

    assert key.hash == hash_key(secret)
    # A second key is added to the same file; the first stays as it was.
    _run(capsys, "keys", "create", "--name", "second", "--file", str(f))
    assert [k.name for k in load_config(cfg_path).auth.keys] == ["ops@team", "second"]
    # A duplicate name is refused.
    rc, _, err = _run(capsys, "keys", "create", "--name", "second", "--file", str(f))
    assert rc == 1 and "already exists" in err


def test_routes_and_priority_are_set_validated_and_reset(tmp_path, capsys):
    f = tmp_path / "keys.yaml"
    rc, out, err = _run(capsys, "keys", "create", "--name", "rl", "--file", str(f), "--routes", "/v1/chat/completions,/generate", "--priority", "batch")
    assert rc == 0, err
    (key,) = load_config_keys(f)
    assert key["routes"] == ["/v1/chat/completions", "/generate"] and key["priority"] == 0
    rc, out, err = _run(capsys, "keys", "create", "--name", "admin-route", "--file", str(f), "--routes", "/terminate")
    assert rc == 2 and "'/terminate' is not a forwarded route" in err and "sk-" not in out
    rc, out, err = _run(capsys, "keys", "create", "--name", "urgent", "--file", str(f), "--priority", "urgent")
    assert rc == 2 and "not a priority class" in err
    rc, out, err = _run(capsys, "keys", "update", "rl", "--file", str(f), "--routes", "default", "--priority", "50")
    assert rc == 0, err
    (key,) = load_config_keys(f)
    assert "routes" not in key and key["priority"] == 50


def load_config_keys(path: Path) -> list[dict]:
    return yaml.safe_load(path.read_text())["keys"]


def test_list_show_update_revoke_on_a_keys_file(tmp_path, capsys):
    f = tmp_path / "keys.yaml"
    _run(capsys, "keys", "create", "--name", "svc", "--file", str(f), "--rpm", "5")
    rc, out, _ = _run(capsys, "keys", "list", "--file", str(f), "--json")
    import json

    (row,) = json.loads(out)
    assert (row["name"], row["status"], row["rpm"], row["models"]) == ("svc", "active", 5, "*")
    assert _run(capsys, "keys", "update", row["id"], "--file", str(f), "--rpm", "0", "--tpm", "50", "--rename", "svc2")[0] == 0
    rc, out, _ = _run(capsys, "keys", "show", "svc2", "--file", str(f))
    shown = yaml.safe_load(out)
    assert (shown["rpm"], shown["tpm"], shown["status"]) == (None, 50, "active")
    assert _run(capsys, "keys", "revoke", "svc2", "--file", str(f))[0] == 0
    assert yaml.safe_load(_run(capsys, "keys", "show", "svc2", "--file", str(f))[1])["status"] == "revoked"
    assert _run(capsys, "keys", "show", "nobody", "--file", str(f))[0] == 1
    rc, _, err = _run(capsys, "keys", "update", "svc2", "--file", str(f))
    assert rc == 2 and "nothing to change" in err


def test_create_without_a_target_prints_a_yaml_entry_to_paste(capsys):
    rc, out, _ = _run(capsys, "keys", "create", "--name", "paste-me", "--rpm", "7")
    assert rc == 0
    entry = yaml.safe_load(out[out.index("- name:"):])
    assert entry[0]["name"] == "paste-me" and entry[0]["rate_limit_rpm"] == 7 and entry[0]["hash"].startswith("sha256:")


def test_the_running_gateway_follows_the_keys_file(keys, tmp_path, capsys):
    f = tmp_path / "keys.yaml"
    _run(capsys, "keys", "create", "--name", "first", "--file", str(f))
    with Sim(MODEL, "--ttft", "0", "--tpot", "0", api_key="backend-secret") as sim:
        cfg = gateway_config(keys, [{"url": sim.url, "api_key": "backend-secret"}])
        cfg["auth"] = {"keys": keys.entries, "keys_file": str(f)}
        with GatewayServer(cfg) as gw:
            def status(secret: str) -> int:
                return httpx.post(gw.url + "/v1/chat/completions", headers={"authorization": f"Bearer {secret}"},
                                  json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}).status_code

            rc, out, _ = _run(capsys, "keys", "create", "--name", "added", "--file", str(f))
            added = _secret(out)
            wait_until(lambda: status(added) == 200, 5, 0.05, "the key added to the file accepted")
            assert status(keys.alice) == 200  # the config's inline keys stay
            _run(capsys, "keys", "revoke", "added", "--file", str(f))
            wait_until(lambda: status(added) == 401, 5, 0.05, "the revoked key refused")
            f.write_text("keys: [{name: broken}]\n")  # an invalid file is ignored: the loaded keys stay
            wait_until(lambda: b'result="invalid"' in httpx.get(gw.url + "/metrics", headers={"authorization": f"Bearer {keys.alice}"}).content,
                       5, 0.05, "the invalid reload counted")
            assert status(keys.alice) == 200


def test_sighup_reloads_the_keys_file(keys, tmp_path, capsys):
    f = tmp_path / "keys.yaml"
    rc, out, _ = _run(capsys, "keys", "create", "--name", "admin", "--admin", "--file", str(f))
    admin = _secret(out)
    port = free_port()
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(yaml.safe_dump({"auth": {"keys_file": str(f)}, "backends": [{"url": "http://127.0.0.1:9"}], "server": {"port": port}}))
    proc = subprocess.Popen([sys.executable, "-m", "gateway", "serve", "--config", str(cfg)], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}/metrics"

        def reloads() -> str:
            try:
                return httpx.get(url, headers={"authorization": f"Bearer {admin}"}).text
            except httpx.HTTPError:
                return ""

        wait_until(lambda: "gateway_key_reloads_total" in reloads() or "gateway_requests_total" in reloads(), 30, 0.1, "gateway up")
        os.kill(proc.pid, signal.SIGHUP)
        wait_until(lambda: 'gateway_key_reloads_total{result="ok",source="sighup"} 1.0' in reloads(), 10, 0.05, "a reload by SIGHUP")
        assert proc.poll() is None  # SIGHUP reloads; it does not stop the gateway
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)
