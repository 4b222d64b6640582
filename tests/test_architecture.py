"""The house's layout holds: every module imports, no import cycle, no import from a lower layer up.

Layers, bottom to top (a module may import its own layer and the ones below):

    0 base      errors, routes, responses, metrics, leanmetrics, logs, _compat, deadline, media/
    1 config    config/, tracing
    2 state     state/
    3 filters   filters/
    4 routing   routing/, upstream, h1, local_routes   (the terminal filters and what they call)
    5 listener  listener, server/, admin/
    6 top       app, cli, workers, __main__

``sim`` stands apart (it imports nothing of the gateway's) and ``launcher`` stands beside the
request path: it may use base, config and the pool it feeds, and only the top layer and admin
import it. The graph is read from the source (lazy and TYPE_CHECKING imports count too), so a
cycle hidden behind a function-level import is still caught; and it is checked twice, module by
module and part by part (a package or a top-level module: ``config`` and ``media``, say), so two
packages that lean on each other through different modules are caught too.
"""

from __future__ import annotations

import ast
import importlib
import pkgutil
from pathlib import Path

import pytest

import gateway

pytestmark = pytest.mark.unit

PACKAGE = Path(gateway.__file__).resolve().parent

LAYERS: list[tuple[str, int]] = [
    # (module name prefix, layer); the longest matching prefix wins
    ("gateway", 0),
    ("gateway.errors", 0),
    ("gateway.routes", 0),
    ("gateway.responses", 0),
    ("gateway.metrics", 0),
    ("gateway.leanmetrics", 0),
    ("gateway.logs", 0),
    ("gateway._compat", 0),
    ("gateway.deadline", 0),
    ("gateway.media", 0),  # the media rules config stores parsed; imports nothing of the gateway
    ("gateway.config", 1),
    ("gateway.tracing", 1),
    ("gateway.state", 2),
    ("gateway.filters", 3),
    ("gateway.routing", 4),
    ("gateway.upstream", 4),
    ("gateway.h1", 4),
    ("gateway.local_routes", 4),
    ("gateway.listener", 5),
    ("gateway.server", 5),
    ("gateway.admin", 5),
    ("gateway.app", 6),
    ("gateway.cli", 6),
    ("gateway.workers", 6),
    ("gateway.__main__", 6),
]
LAYER_NAMES = {0: "base", 1: "config", 2: "state", 3: "filters", 4: "routing", 5: "listener", 6: "top"}
APART = "gateway.sim"
BESIDE = "gateway.launcher"
LAUNCHER_MAY_IMPORT = (0, 1, 4)  # base, config, and the pool it registers instances in
MAY_IMPORT_LAUNCHER = ("gateway.app", "gateway.cli", "gateway.__main__", "gateway.admin")
INTO_SIM = {("gateway.cli", "gateway.sim.__main__")}  # `gateway sim` hands its arguments over


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def layer_of(module: str) -> int:
    best = max((p for p, _ in LAYERS if _under(module, p)), key=len)
    return dict(LAYERS)[best]


def all_modules() -> list[str]:
    names = ["gateway"]
    for info in pkgutil.walk_packages([str(PACKAGE)], prefix="gateway."):
        names.append(info.name)
    return sorted(names)


def source_of(module: str) -> Path:
    parts = module.split(".")[1:]
    path = PACKAGE.joinpath(*parts)
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def imports_of(module: str, known: set[str]) -> set[str]:
    """The gateway modules that ``module`` imports anywhere in its source."""
    path = source_of(module)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if _under(a.name, "gateway"))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not _under(target, "gateway"):
                continue
            # `from pkg import sub` names the submodule, not the package's __init__
            subs = {f"{target}.{a.name}" for a in node.names} & known
            found.update(subs or {target})
            if subs and len(subs) < len(node.names):
                found.add(target)
    return {m for m in found if m in known and m != module}


MODULES = all_modules()
GRAPH = {m: imports_of(m, set(MODULES)) for m in MODULES}


@pytest.mark.parametrize("module", MODULES)
def test_every_module_imports(module: str) -> None:
    if module.endswith(".__main__"):  # importing it would run it: compile it instead
        compile(source_of(module).read_text(encoding="utf-8"), str(source_of(module)), "exec")
        importlib.import_module(module.rpartition(".")[0])
    else:
        importlib.import_module(module)


def part_of(module: str) -> str:
    """The part a module belongs to: its package right under gateway, or the top-level module."""
    return ".".join(module.split(".")[:2])


def parts_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Who imports whom, part by part (an import inside one part is no edge)."""
    parts: dict[str, set[str]] = {part_of(m): set() for m in graph}
    for m, targets in graph.items():
        parts[part_of(m)].update(part_of(t) for t in targets if part_of(t) != part_of(m))
    return parts


def cycles_in(graph: dict[str, set[str]]) -> list[list[str]]:
    # Tarjan would be shorter to run, but a DFS that reports the cycle's path is clearer to read.
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                cycles.append(stack[stack.index(n):] + [n])
            elif n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    return cycles


def test_no_import_cycle() -> None:
    cycles = cycles_in(GRAPH)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_no_import_cycle_between_parts() -> None:
    cycles = cycles_in(parts_graph(GRAPH))
    assert not cycles, "parts that import each other:\n" + "\n".join(" -> ".join(c) for c in cycles)


def forbidden_imports() -> list[str]:
    return forbidden_imports_of(GRAPH)


def forbidden_imports_of(graph: dict[str, set[str]]) -> list[str]:
    bad: list[str] = []
    for m, targets in graph.items():
        for t in sorted(targets):
            if _under(m, APART) or _under(t, APART):
                if not (_under(m, APART) and _under(t, APART)) and (m, t) not in INTO_SIM:
                    bad.append(f"{m} -> {t}: the simulator stands apart")
            elif _under(m, BESIDE):
                if not _under(t, BESIDE) and layer_of(t) not in LAUNCHER_MAY_IMPORT:
                    bad.append(f"{m} -> {t}: the launcher may use only base, config and the pool")
            elif _under(t, BESIDE):
                if not any(_under(m, p) for p in MAY_IMPORT_LAUNCHER):
                    bad.append(f"{m} -> {t}: only the top layer and admin start the launcher")
            elif layer_of(t) > layer_of(m):
                bad.append(f"{m} ({LAYER_NAMES[layer_of(m)]}) -> {t} ({LAYER_NAMES[layer_of(t)]}): imports a higher layer")
    return bad


def test_no_import_runs_up_a_layer() -> None:
    assert not forbidden_imports(), "forbidden imports:\n" + "\n".join(forbidden_imports())


def test_the_checker_sees_a_planted_violation(monkeypatch: pytest.MonkeyPatch) -> None:
    # The rules above must be able to fail: plant an upward import and a cycle and see both caught.
    monkeypatch.setitem(GRAPH, "gateway.errors", GRAPH["gateway.errors"] | {"gateway.listener"})
    assert any(b.startswith("gateway.errors (base) -> gateway.listener") for b in forbidden_imports())
    monkeypatch.setitem(GRAPH, "gateway.routes", GRAPH["gateway.routes"] | {"gateway.sim.app"})
    assert any("simulator stands apart" in b for b in forbidden_imports())


def test_the_checker_sees_a_cycle_of_parts() -> None:
    # The two cycles of parts the house once had, planted back: neither is a cycle of modules.
    # media.walk -> config.media while config.media -> media.url
    planted = dict(GRAPH, **{"gateway.media.walk": GRAPH["gateway.media.walk"] | {"gateway.config.media"}})
    assert not cycles_in(planted)
    assert ["gateway.config", "gateway.media", "gateway.config"] in cycles_in(parts_graph(planted))
    assert any(b.startswith("gateway.media.walk (base) -> gateway.config.media (config)") for b in forbidden_imports_of(planted))
    # state.admin -> filters.auth while filters.auth -> state.keys: the same, one layer up
    planted = dict(GRAPH, **{"gateway.state.admin": GRAPH["gateway.state.admin"] | {"gateway.filters.auth"}})
    assert ["gateway.filters", "gateway.state", "gateway.filters"] in cycles_in(parts_graph(planted))
    assert any(b.startswith("gateway.state.admin (state) -> gateway.filters.auth (filters)") for b in forbidden_imports_of(planted))


def test_the_graph_is_read_from_relative_and_lazy_imports() -> None:
    assert "gateway.listener" in GRAPH["gateway.app"]
    assert "gateway.launcher" in GRAPH["gateway.app"]  # imported inside startup()
    assert "gateway.launcher.process" in GRAPH["gateway.launcher.supervisor"]  # `from . import process`
