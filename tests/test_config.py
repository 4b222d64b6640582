"""Config validation: every problem at once, word for word, exit 2, never a traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gateway.config import ConfigError, parse_config
from gateway.state.keys import hash_key

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parent.parent
HASH = hash_key("sk-test")
GOOD = {"auth": {"keys": [{"name": "a", "hash": HASH}]}, "backends": [{"url": "http://127.0.0.1:23333"}]}


def problems(data, env=None) -> list[str]:
    with pytest.raises(ConfigError) as exc:
        parse_config(data, env=env or {})
    return exc.value.problems


def test_good_config_parses_with_defaults():
    cfg = parse_config(GOOD, env={})
    assert cfg.server.port == 8080
    assert cfg.limits.max_body_bytes == 32 * 1024 * 1024
    assert cfg.backends[0].url == "http://127.0.0.1:23333"
    assert cfg.auth.keys[0].hash == HASH


def test_every_problem_is_reported_at_once_word_for_word():
    data = {
        "server": {"prot": 80, "log_level": " LOUD "},
        "auth": {"keys": [{"name": "a", "hash": HASH}]},
        "backends": [{"url": "ftp://x"}, {"url": "http://h:1/v1"}],
        "balancer": {"policy": "Round-Robin"},
        "limits": {"max_body_bytes": "big"},
        "timeouts": {"connect": -1},
    }
    assert problems(data) == [
        "server.log_level: ' LOUD ' is not a valid choice; choose one of: critical, error, warning, info, debug",
        "server.prot: unknown field (did you mean 'port'?); valid fields: access_log, body_timeout, cors, header_timeout, host, keepalive_timeout, linger_bytes, linger_timeout, log_level, max_connections, max_header_bytes, max_headers, max_request_line_bytes, port",
        "backends[0].url: 'ftp://x' must start with http:// or https://",
        "backends[1].url: 'http://h:1/v1' must be a base URL with no path, query or fragment",
        "limits.max_body_bytes: expected an integer, got 'big'",
        "timeouts.connect: -1 is out of range; must be > 0",
        "balancer.policy: 'Round-Robin' is not a valid choice; choose one of: min_expected_latency, least_in_flight, round_robin, random, least_load (did you mean 'round_robin'?)",
    ]


def test_the_retired_transport_and_server_settings_say_what_replaced_them(tmp_path):
    """One upstream client and one HTTP server remain: an old YAML naming another is an error, never ignored."""
    from gateway.config import load_config

    path = tmp_path / "gw.yaml"
    path.write_text(
        "server: {http: uvicorn}\n"
        "upstream: {transport: aiohttp, max_connections: 64}\n"
        f"auth: {{keys: [{{name: a, hash: '{HASH}'}}]}}\n"
        "backends: [{url: 'http://127.0.0.1:23333'}]\n"
    )
    with pytest.raises(ConfigError) as exc:
        load_config(path, env={})
    assert exc.value.problems == [
        "server.http: this setting was retired; the gateway has one HTTP server (its own, which enforces the server.max_* bounds); remove this line",
        "upstream.transport: this setting was retired; the gateway has one upstream client (the native one); remove this line",
        "upstream.max_connections: this setting was retired; it bounded the aiohttp client, which is gone; remove this line",
    ]
    # even the value that was the default is refused: the line has no job left
    path.write_text(f"server: {{http: native}}\nupstream: {{transport: native}}\nauth: {{keys: [{{name: a, hash: '{HASH}'}}]}}\n")
    with pytest.raises(ConfigError) as exc:
        load_config(path, env={})
    assert [p.split(":")[0] for p in exc.value.problems] == ["server.http", "upstream.transport"]


def test_enum_values_are_normalised_before_checking():
    cfg = parse_config({**GOOD, "server": {"log_level": "  WARNING "}}, env={})
    assert cfg.server.log_level == "warning"


def test_unknown_top_level_section_gets_a_did_you_mean():
    assert problems({**GOOD, "backend": []}) == [
        "backend: unknown field (did you mean 'backends'?); valid fields: admin, auth, backends, balancer, health, launch, limits, log, media, models, server, state, state_dir, timeouts, tracing, upstream"
    ]


def test_missing_environment_variable_is_named():
    data = {**GOOD, "backends": [{"url": "http://10.0.0.5:23333", "api_key": "${REMOTE_KEY}"}]}
    assert problems(data) == ["backends[0].api_key: environment variable 'REMOTE_KEY' is not set (referenced as ${REMOTE_KEY})"]
    cfg = parse_config(data, env={"REMOTE_KEY": "s3cret"})
    assert cfg.backends[0].api_key == "s3cret"


def test_no_keys_refuses_to_start_unless_auth_disabled_explicitly():
    assert problems({"backends": GOOD["backends"]}) == [
        "auth: no API keys configured; add one with `gateway keys create`, or set `auth: {disabled: true}` to run without authentication"
    ]
    assert parse_config({"auth": {"disabled": True}, "backends": GOOD["backends"]}, env={}).auth.disabled


def test_raw_key_in_place_of_a_hash_is_refused_without_echoing_it():
    msgs = problems({"auth": {"keys": [{"name": "a", "hash": "sk-abcdefsecret"}]}, "backends": GOOD["backends"]})
    assert msgs[0] == "auth.keys[0].hash: looks like a raw API key; store its hash instead (`gateway keys hash` prints it)"
    assert "abcdefsecret" not in "\n".join(msgs)


def test_no_backends_is_an_error():
    assert problems({"auth": GOOD["auth"]}) == ["backends: no backends: configure `backends` (URLs) or `launch` (instances to start)"]


@pytest.mark.parametrize("name", ["\x00kv\x00sim-0", "a\nb", "x" * 129])
def test_a_backend_name_is_printable_and_short(name):
    # Names are backend ids, also on the load exchange, whose other fields start with NUL.
    (msg,) = problems({"auth": GOOD["auth"], "backends": [{"url": "http://127.0.0.1:1", "name": name}]})
    assert msg.startswith("backends[0].name: ") and "not a valid backend name" in msg
    assert parse_config({"auth": GOOD["auth"], "backends": [{"url": "http://127.0.0.1:1", "name": "sim0-x2 (fast)"}]}, env={}).backends[0].name == "sim0-x2 (fast)"


def test_keys_file_is_read_relative_to_the_config(tmp_path):
    (tmp_path / "keys.yaml").write_text(f'keys:\n  - {{name: k, hash: "{HASH}"}}\n')
    cfg_path = tmp_path / "gw.yaml"
    cfg_path.write_text("auth: {keys_file: keys.yaml}\nbackends: [{url: 'http://127.0.0.1:1'}]\n")
    from gateway.config import load_config

    assert load_config(cfg_path, env={}).auth.keys[0].name == "k"


def run_cli(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gateway", *args], cwd=cwd, capture_output=True, text=True, timeout=60)


def test_check_config_exits_2_with_all_problems_and_no_traceback(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("server: {port: 99999}\nbalancer: {policy: fastest}\nauth: {keys: []}\nbackends: [{url: 'http://127.0.0.1:1'}]\n")
    r = run_cli("check-config", str(bad))
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    assert r.stderr.splitlines() == [
        f"{bad}: 3 configuration problems:",
        "  - server.port: 99999 is out of range; must be >= 0 and <= 65535",
        "  - auth: no API keys configured; add one with `gateway keys create`, or set `auth: {disabled: true}` to run without authentication",
        "  - balancer.policy: 'fastest' is not a valid choice; choose one of: min_expected_latency, least_in_flight, round_robin, random, least_load",
    ]


def test_check_config_reports_invalid_yaml_with_its_position(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("server: {port: 1\n")
    r = run_cli("check-config", str(bad))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "invalid YAML at line" in r.stderr


def test_serve_refuses_bad_config_the_same_way(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("backends: [{url: 'http://127.0.0.1:1'}]\n")
    r = run_cli("serve", "--config", str(bad))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "auth: no API keys configured" in r.stderr


def test_keys_create_prints_key_once_and_stores_only_its_hash(tmp_path):
    keys_file = tmp_path / "keys.yaml"
    r = run_cli("keys", "create", "--name", "ci", "--file", str(keys_file))
    assert r.returncode == 0
    key = next(w for w in r.stdout.split() if w.startswith("sk-"))
    stored = keys_file.read_text()
    assert key not in stored and hash_key(key) in stored
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(f"auth: {{keys_file: {keys_file}}}\nbackends: [{{url: 'http://127.0.0.1:1'}}]\n")
    assert run_cli("check-config", str(cfg)).returncode == 0
