"""The test harness itself: every module chooses `unit` or `e2e`, and the shared helpers do what they promise."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

TESTS = Path(__file__).resolve().parent
KINDS = {"unit", "e2e"}


def module_marks(path: Path) -> set[str]:
    """The names of ``pytest.mark.X`` in the module-level ``pytestmark`` (a mark, a call of one, or a list of them)."""
    names: set[str] = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in targets) and node.value is not None:
                for sub in ast.walk(node.value):
                    if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Attribute) and sub.value.attr == "mark":
                        names.add(sub.attr)
    return names


def test_every_test_module_is_marked_unit_or_e2e_exactly_once():
    modules = sorted(TESTS.glob("test_*.py"))
    assert len(modules) > 10
    unmarked = [p.name for p in modules if len(module_marks(p) & KINDS) != 1]
    assert unmarked == [], f"add `pytestmark = pytest.mark.unit` (in-process) or `pytest.mark.e2e` (processes, servers) to: {unmarked}"


def test_the_marker_check_sees_a_missing_or_doubled_marker(tmp_path):
    cases = {
        "pytestmark = pytest.mark.unit\n": {"unit"},
        "pytestmark = [pytest.mark.e2e, pytest.mark.asyncio(loop_scope='session')]\n": {"e2e", "asyncio"},
        "import pytest\n": set(),
        "pytestmark = pytest.mark.skipif(True, reason='x')\n": {"skipif"},
    }
    for source, expected in cases.items():
        path = tmp_path / "test_x.py"
        path.write_text(source)
        assert module_marks(path) == expected, source
