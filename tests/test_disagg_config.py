"""PD disaggregation config: serving mode, roles, migration settings; the launcher's argv for them."""

from __future__ import annotations

import importlib.util

import pytest

from gateway.config import ConfigError, parse_config
from gateway.state.keys import hash_key, new_key
from gateway.launcher.spawn import instance_argv, plan_group
from gateway.routing.disagg import _engine_config, parse_prefill
from gateway.sim.config import parse_args as sim_parse_args

pytestmark = pytest.mark.unit

KEYS = {"keys": [{"name": "k", "hash": hash_key(new_key())}]}


def group(role: str, **kw):
    return {"model": "/models/m", "model_name": "m", "engine": "sim", "backend": "pytorch", "role": role, **kw}


def problems(cfg) -> list[str]:
    with pytest.raises(ConfigError) as err:
        parse_config({"auth": KEYS, **cfg}, env={})
    return err.value.problems


def test_a_distserve_model_with_a_prefill_and_a_decode_group_loads():
    cfg = parse_config(
        {
            "auth": KEYS,
            "launch": [group("prefill", migration_backend="Mooncake"), group("decode")],
            "models": {"m": {"serving": "distserve", "migration_protocol": "NVLink", "rdma": {"link_type": "IB", "with_gdr": False}}},
        },
        env={},
    )
    m = cfg.models["m"]
    assert m.distserve and m.migration_protocol == "NVLINK" and m.rdma.link_type == "IB" and m.rdma.with_gdr is False
    assert m.rdma.wire() == {"with_gdr": False, "link_type": 1}  # lmdeploy dumps RDMALinkType.IB by value
    assert [(g.role, g.migration_backend) for g in cfg.launch] == [("prefill", "Mooncake"), ("decode", "DLSlime")]


def test_pd_rules_each_get_one_clear_message():
    got = problems(
        {
            "launch": [group("prefill", backend="turbomind"), group("hybrid"), {**group("decode"), "model_name": "h"}],
            "models": {"m": {"serving": "distserve"}},
        }
    )
    assert "launch[0].backend: role 'prefill' needs the PyTorch engine (lmdeploy's PD disaggregation); set backend: pytorch" in got
    assert any(p.startswith("launch[1].role: serves 'm', a distserve model, as a hybrid instance; set role: prefill or role: decode") for p in got)
    assert "models.m: serving: distserve needs at least one decode instance (a launch group or backend with role: decode)" in got
    assert "launch[2].role: 'decode' needs the model to be served disaggregated; set models.h.serving: distserve" in got


def test_bad_choices_name_the_valid_ones():
    got = problems(
        {
            "launch": [group("prefil", migration_backend="nixl"), group("decode")],
            "models": {"m": {"serving": "disagg", "migration_protocol": "tcp"}},
        }
    )
    assert "launch[0].role: 'prefil' is not a valid choice; choose one of: hybrid, prefill, decode (did you mean 'prefill'?)" in got
    assert "launch[0].migration_backend: 'nixl' is not a valid choice; choose one of: dlslime, mooncake" in got
    assert any(p.startswith("models.m.serving: 'disagg' is not a valid choice; choose one of: hybrid, distserve") for p in got)
    assert "models.m.migration_protocol: 'tcp' is not a valid choice; choose one of: rdma, nvlink" in got


def test_role_and_migration_backend_are_refused_in_extra_args():
    got = problems({"launch": [{**group("hybrid"), "extra_args": ["--role", "Prefill", "--migration-backend=Mooncake"]}]})
    assert "launch[0].extra_args[0]: '--role' is not allowed: set `role` instead (and the model's `serving: distserve`)" in got
    assert "launch[0].extra_args[2]: '--migration-backend=Mooncake' is not allowed: set `migration_backend` instead" in got


def test_remote_backends_declare_their_role():
    cfg = parse_config(
        {
            "auth": KEYS,
            "backends": [{"url": "http://10.0.0.1:23333", "models": ["m"], "role": "prefill"}, {"url": "http://10.0.0.2:23333", "models": ["m"], "role": "decode"}],
            "models": {"m": {"serving": "distserve"}},
        },
        env={},
    )
    assert [b.role for b in cfg.backends] == ["prefill", "decode"]
    got = problems({"backends": [{"url": "http://10.0.0.1:1", "role": "prefill"}, {"url": "http://10.0.0.2:1", "models": ["m"]}], "models": {"m": {"serving": "distserve"}}})
    assert "backends[0].models: a prefill backend must list the models it serves (role and model decide its place in PD dispatch)" in got
    assert any(p.startswith("backends[1].role: serves 'm', a distserve model, as a hybrid instance") for p in got)


def _plans():
    cfg = parse_config({"auth": KEYS, "launch": [group("prefill", engine="lmdeploy", gpus=[0]), group("decode", engine="lmdeploy", gpus=[1], migration_backend="mooncake")],
                        "models": {"m": {"serving": "distserve"}}}, env={})
    lm = lambda: (("lmdeploy",), "test")  # noqa: E731
    return [plan_group(g, lambda device: (("0", "1"), "test"), lm) for g in cfg.launch]


def test_launcher_argv_carries_role_and_migration_backend():
    prefill, decode = (instance_argv(p, 23333, "k") for p in _plans())
    assert prefill[prefill.index("--role") + 1] == "Prefill" and prefill[prefill.index("--migration-backend") + 1] == "DLSlime"
    assert decode[decode.index("--role") + 1] == "Decode" and decode[decode.index("--migration-backend") + 1] == "Mooncake"
    assert prefill[prefill.index("--backend") + 1] == "pytorch"


def test_simulator_takes_the_same_role_flags():
    cfg = parse_config({"auth": KEYS, "launch": [group("prefill"), group("decode")], "models": {"m": {"serving": "distserve"}}}, env={})
    for g, role in zip(cfg.launch, ("Prefill", "Decode")):
        argv = instance_argv(plan_group(g, lambda d: ((), ""), lambda: (None, "")), 1234, "k")
        assert sim_parse_args(argv[3:]).role == role


@pytest.mark.skipif(importlib.util.find_spec("lmdeploy") is None, reason="lmdeploy is not installed here: its own CLI parser cannot check the argv")
def test_lmdeploys_own_parser_accepts_the_prefill_and_decode_argv():
    from lmdeploy.cli.cli import CLI
    from lmdeploy.cli.serve import SubCliServe

    CLI.add_parsers()
    SubCliServe.add_parsers()
    for plan, role in zip(_plans(), ("Prefill", "Decode")):
        argv = instance_argv(plan, 23333, "k")
        args = CLI.parser.parse_args(argv[1:])  # drop the executable
        assert args.role == role and args.backend == "pytorch"
        assert args.migration_backend in ("DLSlime", "Mooncake")


def test_prefill_answers_and_engine_info_are_validated():
    assert parse_prefill(b'{"id": "12", "cache_block_ids": [3, 4], "remote_token_ids": [1001]}').session_id == 12
    assert parse_prefill(b'{"id": "chatcmpl-x", "cache_block_ids": [3]}') is None
    assert parse_prefill(b'{"id": "1", "cache_block_ids": [-1]}') is None
    assert parse_prefill(b'{"id": "1", "cache_block_ids": "3"}') is None
    info = '{"tp_size":1,"ep_size":1,"dp_size":1,"pp_size":null,"dp_rank":0,"block_size":64,"num_cpu_blocks":0,"num_gpu_blocks":10}'
    assert _engine_config(info)["num_gpu_blocks"] == 10  # a JSON string inside JSON, as lmdeploy answers
    with pytest.raises(Exception):
        _engine_config({"tp_size": "1"})
