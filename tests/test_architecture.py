"""The house's layout holds: every module imports, no import cycle, no import from a lower layer up.

Layers, bottom to top (a module may import its own layer and the ones below):

    0 base      errors, routes, responses, metrics, leanmetrics, config/, media/, logs, tracing, _compat
    1 filters   filters/
    2 routing   routing/, upstream, h1, local_routes   (the terminal filters and what they call)
    3 listener  listener, admin/
    4 top       app, cli, __main__

``sim`` stands apart (it imports nothing of the gateway's) and ``launcher`` stands beside the
request path: it may use base and the pool it feeds, and only the top layer and admin import it.
The graph is read from the source (lazy and TYPE_CHECKING imports count too), so a cycle hidden
behind a function-level import is still caught.
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
    ("gateway.config", 0),
    ("gateway.logs", 0),
    ("gateway.tracing", 0),
    ("gateway._compat", 0),
    ("gateway.filters", 1),
    ("gateway.media", 0),  # the media rules config stores parsed; imports nothing of the gateway
    ("gateway.state", 1),
    ("gateway.routing", 2),
    ("gateway.upstream", 2),
    ("gateway.h1", 2),
    ("gateway.local_routes", 2),
    ("gateway.listener", 3),
    ("gateway.server", 3),
    ("gateway.admin", 3),
    ("gateway.app", 4),
    ("gateway.cli", 4),
    ("gateway.__main__", 4),
]
LAYER_NAMES = {0: "base", 1: "filters", 2: "routing", 3: "listener", 4: "top"}
APART = "gateway.sim"
BESIDE = "gateway.launcher"
LAUNCHER_MAY_IMPORT = (0, 2)  # base, and the pool it registers instances in
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


def test_no_import_cycle() -> None:
    # Tarjan would be shorter to run, but a DFS that reports the cycle's path is clearer to read.
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for n in sorted(GRAPH[m]):
            if state.get(n) == 1:
                cycles.append(stack[stack.index(n):] + [n])
            elif n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in MODULES:
        if m not in state:
            visit(m)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def forbidden_imports() -> list[str]:
    bad: list[str] = []
    for m, targets in GRAPH.items():
        for t in sorted(targets):
            if _under(m, APART) or _under(t, APART):
                if not (_under(m, APART) and _under(t, APART)) and (m, t) not in INTO_SIM:
                    bad.append(f"{m} -> {t}: the simulator stands apart")
            elif _under(m, BESIDE):
                if not _under(t, BESIDE) and layer_of(t) not in LAUNCHER_MAY_IMPORT:
                    bad.append(f"{m} -> {t}: the launcher may use only base and the pool")
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


def test_the_graph_is_read_from_relative_and_lazy_imports() -> None:
    assert "gateway.listener" in GRAPH["gateway.app"]
    assert "gateway.launcher" in GRAPH["gateway.app"]  # imported inside startup()
    assert "gateway.launcher.process" in GRAPH["gateway.launcher.supervisor"]  # `from . import process`
