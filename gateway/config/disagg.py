"""The ``models:`` section: per served model, how it is served and which extra routes it offers.

```yaml
models:
  internlm2_5-7b-chat:
    serving: distserve          # hybrid (default) | distserve: prefill/decode disaggregation
    routes: [/generate, /pooling]   # lmdeploy's extra routes this model serves (default: none)
    migration_protocol: RDMA    # RDMA | NVLINK (lmdeploy's MigrationProtocol)
    rdma: {link_type: RoCE, with_gdr: true}   # lmdeploy's DistServeRDMAConfig
```

The names and choices are lmdeploy's (``pytorch/disagg/config.py``, ``conn/protocol.py``,
``cli/serve.py``): ``--role Hybrid|Prefill|Decode``, ``--migration-backend DLSlime|Mooncake``,
``--migration-protocol RDMA|NVLINK``, ``--link-type RoCE|IB``. On the wire lmdeploy's pydantic
models dump these enums by value (``enum.auto()``), so the numbers are kept here too.

Cross-section rules (``check_serving``) need the launch groups and remote backends, so they run
after those sections are read: a distserve model needs at least one prefill and one decode
instance, no hybrid one, and the PyTorch engine; a prefill or decode instance needs a distserve model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..routes import EXTRA_ROUTES
from .fields import Problems, Section
from .settings import internal, read_fields, setting

SERVING = ("hybrid", "distserve")
ROLES = ("hybrid", "prefill", "decode")
# lmdeploy's spellings (cli/utils.py ArgumentHelper.role / migration_backend, cli/serve.py proxy flags).
ROLE_FLAG = {"hybrid": "Hybrid", "prefill": "Prefill", "decode": "Decode"}
MIGRATION_BACKENDS = {"dlslime": "DLSlime", "mooncake": "Mooncake"}
MIGRATION_PROTOCOLS = {"rdma": "RDMA", "nvlink": "NVLINK"}
LINK_TYPES = {"roce": "RoCE", "ib": "IB"}
# Enum values as lmdeploy's model_dump(mode="json") writes them.
MIGRATION_PROTOCOL_VALUE = {"TCP": 1, "RDMA": 2, "NVLINK": 3}
LINK_TYPE_VALUE = {"IB": 1, "RoCE": 2}


@dataclass(frozen=True)
class RdmaConfig:
    """lmdeploy's DistServeRDMAConfig for the KV migration between a model's prefill and decode instances."""

    link_type: str = setting("RoCE", "The RDMA link.", choices=LINK_TYPES)
    with_gdr: bool = setting(True, "GPUDirect RDMA: the NIC reads the GPU's memory directly.")

    def wire(self) -> dict[str, Any]:
        """lmdeploy's DistServeRDMAConfig as JSON."""
        return {"with_gdr": self.with_gdr, "link_type": LINK_TYPE_VALUE[self.link_type]}


@dataclass(frozen=True)
class ModelServing:
    """Per served model (by the name clients use): how it is served and which extra routes it offers."""

    name: str = internal()  # the mapping's key
    serving: str = setting("hybrid", "`hybrid`: each instance prefills and decodes; `distserve`: prefill/decode disaggregation (needs prefill and decode instances).", choices=SERVING)
    routes: tuple[str, ...] = setting((), f"lmdeploy's extra routes this model serves: {', '.join(EXTRA_ROUTES)}.")
    migration_protocol: str = setting("RDMA", "distserve: how the KV cache moves from prefill to decode.", choices=MIGRATION_PROTOCOLS)
    rdma: RdmaConfig = setting(doc="distserve with RDMA: the link.", default_factory=RdmaConfig)

    @property
    def distserve(self) -> bool:
        return self.serving == "distserve"


def read_models(s: Section) -> dict[str, ModelServing]:
    out: dict[str, ModelServing] = {}
    for name in list(s.data):
        sub = s.section(str(name))
        v = read_fields(ModelServing, sub)
        serving, routes = v["serving"], v["routes"]
        for i, r in enumerate(routes):
            if r not in EXTRA_ROUTES:
                sub.problems.add(f"{sub.where('routes')}[{i}]", f"{r!r} is not a route a model can enable; choose from: {', '.join(EXTRA_ROUTES)}")
        rs = sub.section("rdma")
        rdma = read_fields(RdmaConfig, rs)
        rs.finish()
        sub.finish()
        if serving != "distserve":
            for key in ("migration_protocol", "rdma"):
                if sub.has(key):
                    sub.error(key, "applies only to a model with serving: distserve")
        out[str(name)] = ModelServing(
            name=str(name),
            serving=serving or "hybrid",
            routes=tuple(r for r in routes if r in EXTRA_ROUTES),
            migration_protocol=v["migration_protocol"] or ModelServing.migration_protocol,
            rdma=RdmaConfig(link_type=rdma["link_type"] or RdmaConfig.link_type, with_gdr=bool(rdma["with_gdr"])),
        )
    return out


def check_serving(models: dict[str, ModelServing], launch: tuple[Any, ...], backends: tuple[Any, ...], problems: Problems) -> None:
    """The rules that span models, launch groups and remote backends."""
    roles: dict[str, dict[str, list[str]]] = {}
    for g in launch:
        m = models.get(g.served_name)
        if g.role != "hybrid":
            if m is None or not m.distserve:
                problems.add(
                    f"{g.label}.role",
                    f"{g.role!r} needs the model to be served disaggregated; set models.{g.served_name}.serving: distserve",
                )
            if g.backend != "pytorch":
                problems.add(f"{g.label}.backend", f"role {g.role!r} needs the PyTorch engine (lmdeploy's PD disaggregation); set backend: pytorch")
        roles.setdefault(g.served_name, {}).setdefault(g.role, []).append(g.label)
    for i, b in enumerate(backends):
        label = f"backends[{i}]"
        if b.role != "hybrid" and not b.models:
            problems.add(f"{label}.models", f"a {b.role} backend must list the models it serves (role and model decide its place in PD dispatch)")
        if b.role != "hybrid":
            for name in b.models or ():
                if name not in models or not models[name].distserve:
                    problems.add(f"{label}.role", f"{b.role!r} needs the model to be served disaggregated; set models.{name}.serving: distserve")
        for name in b.models or ():
            roles.setdefault(name, {}).setdefault(b.role, []).append(label)
    for name, m in models.items():
        if not m.distserve:
            continue
        have = roles.get(name, {})
        for label in have.get("hybrid", []):
            problems.add(
                f"{label}.role",
                f"serves {name!r}, a distserve model, as a hybrid instance; set role: prefill or role: decode (a remote backend must declare it: "
                "lmdeploy's /health and /distserve/engine_info do not say it)",
            )
        for role in ("prefill", "decode"):
            if not have.get(role):
                problems.add(f"models.{name}", f"serving: distserve needs at least one {role} instance (a launch group or backend with role: {role})")


__all__ = ["ModelServing", "RdmaConfig", "read_models", "check_serving", "ROLES", "ROLE_FLAG", "MIGRATION_BACKENDS"]
