"""The simulator's DistServe side on its own: lmdeploy's JSON shapes, held blocks, migration, frees."""

from __future__ import annotations

import json

import pytest

from support import Sim, wait_until

pytestmark = pytest.mark.e2e

INFO_KEYS = {"tp_size", "ep_size", "dp_size", "pp_size", "dp_rank", "block_size", "num_cpu_blocks", "num_gpu_blocks"}


@pytest.fixture
def pair():
    p = Sim("m", "--role", "Prefill", "--cache-hold-seconds", "0.5", "--ttft", "0", "--tpot", "0.001")
    d = Sim("m", "--role", "Decode", "--ttft", "0", "--tpot", "0.001")
    try:
        yield p, d
    finally:
        p.stop()
        d.stop()


def info(sim) -> dict:
    r = sim.client.get("/distserve/engine_info")
    assert r.status_code == 200
    raw = r.json()
    assert isinstance(raw, str)  # lmdeploy returns model_dump_json(): a JSON string inside JSON
    return json.loads(raw)


def connect(p, d) -> None:
    pi, di = info(p), info(d)

    def init(local, lcfg, remote, rcfg):
        return {"local_engine_id": local.url, "local_engine_config": lcfg, "remote_engine_id": remote.url, "remote_engine_config": rcfg,
                "protocol": 2, "rank": None, "tcp_config": None, "rdma_config": {"with_gdr": True, "link_type": 2}, "nvlink_config": None}

    pr = p.client.post("/distserve/p2p_initialize", json=init(p, pi, d, di)).json()
    dr = d.client.post("/distserve/p2p_initialize", json=init(d, di, p, pi)).json()
    for r in (pr, dr):
        assert r["status"] == 1 and r["engine_endpoint_info"]["zmq_address"].startswith("tcp://")
        assert r["kvtransfer_endpoint_info"][0]["protocol"] == 2
    for b, remote, rr in ((p, d, dr), (d, p, pr)):
        body = {"protocol": 2, "remote_engine_id": remote.url, "remote_engine_endpoint_info": rr["engine_endpoint_info"],
                "remote_kvtransfer_endpoint_info": rr["kvtransfer_endpoint_info"]}
        assert b.client.post("/distserve/p2p_connect", json=body).json() == {"status": 1}


def prefill(p, text="hello " * 100) -> dict:
    body = {"model": "m", "prompt": text, "max_tokens": 1, "stream": False, "with_cache": True, "preserve_cache": True}
    r = p.client.post("/v1/completions", json=body)
    assert r.status_code == 200
    return r.json()


def decode_body(p, pre: dict, text="hello " * 100) -> dict:
    return {"model": "m", "prompt": text, "max_tokens": 4, "migration_request": {
        "protocol": 2, "remote_engine_id": p.url, "remote_session_id": int(pre["id"]), "remote_token_id": pre["remote_token_ids"][-1],
        "remote_block_ids": pre["cache_block_ids"], "is_dummy_prefill": False}}


def ds(sim) -> dict:
    return sim.client.get("/_sim/distserve").json()


def test_engine_info_has_lmdeploys_fields(pair):
    p, _ = pair
    cfg = info(p)
    assert set(cfg) == INFO_KEYS and cfg["pp_size"] is None and cfg["num_gpu_blocks"] * cfg["block_size"] <= 200_000


def test_prefill_answers_with_blocks_and_holds_them_until_expiry(pair):
    p, _ = pair
    pre = prefill(p)
    assert int(pre["id"]) >= 1 and len(pre["cache_block_ids"]) >= 1 and len(pre["remote_token_ids"]) == 1
    assert pre["usage"]["completion_tokens"] == 1
    assert ds(p)["held"] == [int(pre["id"])]
    assert p.stats()["kv_reserved_tokens"] > 0
    wait_until(lambda: ds(p)["held"] == [], 5, 0.05, "expiry")
    assert ds(p)["frees"][-1] == {**ds(p)["frees"][-1], "session_id": int(pre["id"]), "why": "expired", "held": True}
    assert p.stats()["kv_reserved_tokens"] == 0


def test_free_cache_answers_like_lmdeploy_and_is_recorded(pair):
    p, _ = pair
    pre = prefill(p)
    r = p.client.post("/distserve/free_cache", json={"remote_engine_id": p.url, "remote_session_id": int(pre["id"])})
    assert r.json() == {"status": "SUCCESS"}
    r = p.client.post("/distserve/free_cache", json={"remote_engine_id": p.url, "remote_session_id": 12345})
    assert r.json() == {"status": "SUCCESS"}  # lmdeploy only logs "Invalid Free session"
    frees = ds(p)["frees"]
    assert [(f["session_id"], f["held"]) for f in frees] == [(int(pre["id"]), True), (12345, False)]
    r = p.client.post("/distserve/free_cache", json={"remote_session_id": 1})
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "remote_engine_id"]


def test_connect_needs_initialize_first(pair):
    p, d = pair
    body = {"protocol": 2, "remote_engine_id": d.url, "remote_engine_endpoint_info": {"zmq_address": "tcp://x:1"}, "remote_kvtransfer_endpoint_info": []}
    assert p.client.post("/distserve/p2p_connect", json=body).status_code == 500


def test_decode_refuses_a_migration_from_a_prefill_it_is_not_connected_to(pair):
    p, d = pair
    pre = prefill(p)
    r = d.client.post("/v1/completions", json=decode_body(p, pre))
    assert r.status_code == 500 and "no connection" in r.text
    assert ds(d)["refused_migrations"] == 1 and ds(p)["held"] == [int(pre["id"])]


def test_connected_decode_migrates_skips_prefill_and_the_prefill_frees(pair):
    p, d = pair
    connect(p, d)
    pre = prefill(p)
    r = d.client.post("/v1/completions", json=decode_body(p, pre))
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    stats = d.stats()
    assert stats["cached_tokens"] == stats["prompt_tokens"]  # no prefill on the decode instance
    assert ds(p)["held"] == [] and ds(p)["frees"][-1]["why"] == "migrated" and ds(d)["migrations"] == 1
    # Dropping the link: the next migration over it is refused.
    assert d.client.post("/distserve/p2p_drop_connect", json={"engine_id": d.url, "remote_engine_id": p.url}).json() == {"success": True}
    pre = prefill(p)
    assert d.client.post("/v1/completions", json=decode_body(p, pre)).status_code == 500


def test_distserve_faults_can_be_armed(pair):
    p, _ = pair
    p.client.post("/_sim/distserve", json={"fail_next": {"engine_info": 1}}).raise_for_status()
    assert p.client.get("/distserve/engine_info").status_code == 500
    assert p.client.get("/distserve/engine_info").status_code == 200
    assert p.client.post("/_sim/distserve", json={"fail_next": {"nope": 1}}).status_code == 400
