"""deploy/ as written: every manifest parses, and its ports, paths, probes, arguments, configs and
metric names agree with the code (the route table, the config loader, the CLI parsers, the
Prometheus registry). Nothing is deployed; what can be checked without a cluster is."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml

from gateway import metrics
from gateway.cli import build_parser
from gateway.config import parse_config
from gateway.state.keys import hash_key
from gateway.routes import ROUTES
from gateway.sim.config import build_parser as sim_parser
from support import ROOT

pytestmark = pytest.mark.unit

DEPLOY = ROOT / "deploy"
ENV = {"ADMIN_KEY_HASH": hash_key("admin"), "BACKEND_KEY": "backend-key"}
MANIFESTS = sorted(DEPLOY.rglob("*.yaml"))


def documents() -> Iterator[tuple[Path, dict[str, Any]]]:
    for path in MANIFESTS:
        for doc in yaml.safe_load_all(path.read_text(encoding="utf-8")):
            if doc:
                yield path, doc


def k8s(kind: str) -> list[dict[str, Any]]:
    return [d for p, d in documents() if "kubernetes" in p.parts and d.get("kind") == kind]


def workloads() -> list[dict[str, Any]]:
    return k8s("Deployment")


def gateway_containers() -> list[tuple[dict[str, Any], dict[str, Any], dict[str, Any]]]:
    """(workload, pod spec, gateway container) for every workload that runs the gateway."""
    out = []
    for w in workloads():
        spec = w["spec"]["template"]["spec"]
        for c in spec["containers"]:
            if c.get("args", [None])[0] == "serve":
                out.append((w, spec, c))
    assert out
    return out


def config_text_for(workload: dict[str, Any]) -> str:
    spec = workload["spec"]["template"]["spec"]
    cm_name = next(v["configMap"]["name"] for v in spec["volumes"] if "configMap" in v)
    cm = next(c for c in k8s("ConfigMap") if c["metadata"]["name"] == cm_name)
    return cm["data"]["config.yaml"]


def load_gateway_config(text: str, tmp_path: Path):
    """Validate exactly as `serve` does; the keys file (a mounted Secret) is stood in for by a local one."""
    data = yaml.safe_load(text)
    keys = tmp_path / "keys.yaml"
    keys.write_text(yaml.safe_dump({"keys": [{"name": "k", "hash": hash_key("k")}]}), encoding="utf-8")
    if "keys_file" in data.get("auth", {}):
        data["auth"]["keys_file"] = str(keys)
    return parse_config(data, base_dir=tmp_path, env=ENV)


def named_port(container: dict[str, Any], name: str) -> int:
    return next(p["containerPort"] for p in container["ports"] if p["name"] == name)


def test_every_manifest_parses():
    assert MANIFESTS and all(doc for _, doc in documents())
    json.loads((DEPLOY / "grafana" / "lmdeploy-gateway.json").read_text(encoding="utf-8"))


def test_every_embedded_gateway_config_validates_like_serve(tmp_path):
    texts = [c["data"]["config.yaml"] for c in k8s("ConfigMap") if "config.yaml" in c.get("data", {})]
    texts.append((DEPLOY / "compose" / "gateway.yaml").read_text(encoding="utf-8"))
    assert len(texts) == 3
    for text in texts:
        cfg = load_gateway_config(text, tmp_path)
        assert cfg.admin.enabled and cfg.admin.key_hash == ENV["ADMIN_KEY_HASH"] and cfg.log.format == "json"


def test_container_ports_and_arguments_match_the_config_and_the_cli(tmp_path):
    for w, _, c in gateway_containers():
        cfg = load_gateway_config(config_text_for(w), tmp_path)
        assert named_port(c, "http") == cfg.server.port and cfg.server.host == "0.0.0.0"
        assert named_port(c, "admin") == cfg.admin.port
        args = build_parser().parse_args(c["args"])
        mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
        assert args.config in mounts and args.state_dir in mounts and not mounts[args.state_dir].get("readOnly")
    for svc in k8s("Service"):
        for port in svc["spec"]["ports"]:
            target = port["targetPort"]
            if isinstance(target, str):
                selected = [w for w in workloads() + k8s("StatefulSet")
                            if all(w["spec"]["template"]["metadata"]["labels"].get(k) == v for k, v in svc["spec"]["selector"].items())]
                assert selected, svc["metadata"]["name"]
                assert all(any(p.get("name") == target for c in w["spec"]["template"]["spec"]["containers"] for p in c["ports"]) for w in selected)


def test_probes_use_the_gateways_unauthenticated_routes():
    unauthenticated = {path for (method, path), r in ROUTES.items() if method == "GET" and not r.auth}
    for _, _, c in gateway_containers():
        assert c["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
        assert c["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
        assert c["startupProbe"]["httpGet"]["path"] == "/health"
    assert {"/ready", "/health"} <= unauthenticated


def test_pods_are_locked_down_and_drain_before_they_stop(tmp_path):
    for w, spec, c in gateway_containers():
        assert spec["securityContext"]["runAsNonRoot"] is True and spec["securityContext"]["runAsUser"] != 0
        assert spec["automountServiceAccountToken"] is False
        sc = c["securityContext"]
        assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False and sc["capabilities"]["drop"] == ["ALL"]
        assert {"cpu", "memory"} <= set(c["resources"]["limits"]) and {"cpu", "memory"} <= set(c["resources"]["requests"])
        pre_stop = c["lifecycle"]["preStop"]["sleep"]["seconds"]
        cfg = load_gateway_config(config_text_for(w), tmp_path)
        assert pre_stop >= 5 and spec["terminationGracePeriodSeconds"] > pre_stop + cfg.timeouts.drain
        writable = {m["mountPath"] for m in c["volumeMounts"] if not m.get("readOnly")}
        assert {"/tmp", "/var/lib/lmdeploy-gateway"} <= writable
    assert next(w for w in workloads() if w["metadata"]["name"] == "lmdeploy-gateway")["spec"]["replicas"] >= 2


def test_keys_and_the_admin_key_come_from_a_secret():
    for _, spec, c in gateway_containers():
        env = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in c["env"]}
        assert env["ADMIN_KEY_HASH"] == {"name": "lmdeploy-gateway-keys", "key": "admin-key-hash"}
        keys = next(v for v in spec["volumes"] if v["name"] == "keys")
        assert keys["secret"]["secretName"] == "lmdeploy-gateway-keys"


def test_images_and_bases_are_pinned():
    images = [c["image"] for w in workloads() + k8s("StatefulSet") for c in w["spec"]["template"]["spec"]["containers"]]
    compose = yaml.safe_load((DEPLOY / "compose" / "docker-compose.yaml").read_text(encoding="utf-8"))
    images += [s["image"] for s in compose["services"].values() if "image" in s]
    images += re.findall(r"^FROM\s+(\S+)", (DEPLOY / "Dockerfile").read_text() + (DEPLOY / "Dockerfile.gpu").read_text(), re.M)
    for image in images:
        tag = image.rsplit("/", 1)[-1].partition(":")[2]
        assert tag and tag != "latest" and re.search(r"\d", tag), image


def test_monitoring_authenticates_and_every_dashboard_metric_exists():
    (monitor,) = k8s("ServiceMonitor")
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] == "admin" and endpoint["path"] == "/metrics"
    assert endpoint["authorization"] == {"type": "Bearer", "credentials": {"name": "lmdeploy-gateway-keys", "key": "admin-key"}}
    admin_svc = next(s for s in k8s("Service") if s["metadata"]["name"] == "lmdeploy-gateway-admin")
    assert all(admin_svc["metadata"]["labels"].get(k) == v for k, v in monitor["spec"]["selector"]["matchLabels"].items())
    scrape = yaml.safe_load(next(c for c in k8s("ConfigMap") if c["metadata"]["name"] == "lmdeploy-gateway-scrape-config")["data"]["scrape.yaml"])
    assert scrape["scrape_configs"][0]["authorization"]["type"] == "Bearer" and scrape["scrape_configs"][0]["metrics_path"] == "/metrics"

    from gateway.launcher import supervisor

    if hasattr(supervisor, "_metrics"):  # the launcher registers its metrics when first used
        supervisor._metrics()
    exported = {m.name for m in metrics.REGISTRY.collect()}
    dashboard = (DEPLOY / "grafana" / "lmdeploy-gateway.json").read_text(encoding="utf-8")
    used = set(re.findall(r"\b(gateway_[a-z_]+)", dashboard))
    assert used
    for name in used:
        base = re.sub(r"_(bucket|count|sum|total)$", "", name)
        assert base in exported, name


def test_backends_are_reachable_only_from_the_gateway(tmp_path):
    policy = next(p for p in k8s("NetworkPolicy") if p["metadata"]["name"] == "lmdeploy-api-server-only-from-gateway")
    api = next(s for s in k8s("StatefulSet") if s["metadata"]["name"] == "lmdeploy-api-server")
    gateway = next(w for w in workloads() if w["metadata"]["name"] == "lmdeploy-gateway")
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= api["spec"]["template"]["metadata"]["labels"].items()
    (rule,) = policy["spec"]["ingress"]
    assert rule["from"][0]["podSelector"]["matchLabels"].items() <= gateway["spec"]["template"]["metadata"]["labels"].items()
    cfg = load_gateway_config(config_text_for(gateway), tmp_path)
    (discover,) = cfg.discover
    assert rule["ports"] == [{"port": discover.port, "protocol": "TCP"}]
    headless = next(s for s in k8s("Service") if s["metadata"]["name"] == "lmdeploy-api-server")
    assert headless["spec"]["clusterIP"] == "None" and discover.dns.startswith("lmdeploy-api-server.")
    gw_policy = next(p for p in k8s("NetworkPolicy") if p["metadata"]["name"] == "lmdeploy-gateway")
    admin_rule = next(r for r in gw_policy["spec"]["ingress"] if r["ports"] == [{"port": cfg.admin.port, "protocol": "TCP"}])
    assert admin_rule["from"]  # the admin port is not open to everyone


def test_dockerfile_installs_dependencies_first_and_runs_as_a_user_with_a_writable_state_dir():
    for name in ("Dockerfile", "Dockerfile.gpu"):
        text = (DEPLOY / name).read_text(encoding="utf-8")
        lines = [line.strip() for line in text.splitlines()]
        first_deps = next(i for i, line in enumerate(lines) if "pip install ." in line)
        code = next(i for i, line in enumerate(lines) if line.startswith("COPY gateway"))
        assert first_deps < code, name
        user = re.search(r"^USER (\S+)", text, re.M).group(1)
        assert not user.startswith(("0", "root"))
        assert "chown 10001:10001 /var/lib/lmdeploy-gateway" in text and user.startswith("10001")
        assert "127.0.0.1:8080/health" in text and re.search(r"^EXPOSE 8080 8081$", text, re.M)
        cmd = json.loads(re.search(r"^CMD (\[.*\])$", text, re.M).group(1))
        args = build_parser().parse_args(cmd)
        assert args.state_dir == "/var/lib/lmdeploy-gateway"
        ignore = (DEPLOY / f"{name}.dockerignore").read_text().split()
        assert {".git", ".venv", "tests"} <= set(ignore) and "README.md" not in ignore
    assert (ROOT / ".dockerignore").read_text() == (DEPLOY / "Dockerfile.dockerignore").read_text()


def test_compose_runs_the_gateway_redis_and_simulated_backends(tmp_path):
    compose = yaml.safe_load((DEPLOY / "compose" / "docker-compose.yaml").read_text(encoding="utf-8"))
    services = compose["services"]
    assert {"gateway", "redis", "sim-0", "sim-1"} <= set(services)
    cfg = load_gateway_config((DEPLOY / "compose" / "gateway.yaml").read_text(encoding="utf-8"), tmp_path)
    assert cfg.state.redis_url == "redis://redis:6379/0"
    for backend in cfg.backends:
        host, port = backend.url.removeprefix("http://").split(":")
        sim = services[host]
        command = [arg.replace("${BACKEND_KEY:-compose-backend-key}", "k") for arg in sim["command"]]
        assert command[0] == "sim"
        args = sim_parser().parse_args(command[1:])
        assert args.port == int(port) and args.host == "0.0.0.0" and backend.models == tuple(args.models)
    gw = services["gateway"]
    assert gw["ports"] == [f"127.0.0.1:{cfg.server.port}:{cfg.server.port}", f"127.0.0.1:{cfg.admin.port}:{cfg.admin.port}"]
    assert gw["read_only"] is True and gw["cap_drop"] == ["ALL"] and gw["ulimits"]["nofile"]["soft"] >= 65536
    assert build_parser().parse_args(gw["command"]).state_dir in {v.split(":")[1] for v in gw["volumes"]}
    assert gw["stop_grace_period"] == "45s" and cfg.timeouts.drain < 45


def test_systemd_unit_raises_the_fd_limit_and_passes_its_state_dir():
    unit = (DEPLOY / "systemd" / "lmdeploy-gateway.service").read_text(encoding="utf-8")
    fields = dict(line.split("=", 1) for line in unit.splitlines() if "=" in line and not line.startswith("#"))
    assert int(fields["LimitNOFILE"]) >= 65536
    assert fields["StateDirectory"] == "lmdeploy-gateway"
    argv = shlex.split(fields["ExecStart"])
    assert argv[0].endswith("/gateway")
    args = build_parser().parse_args(argv[1:])
    assert args.state_dir == "${STATE_DIRECTORY}"  # systemd expands it to /var/lib/lmdeploy-gateway
    check = shlex.split(fields["ExecStartPre"])
    assert build_parser().parse_args(check[1:]).config == args.config
