"""The house's rules, read from the source (no module is imported): no import cycles inside
``stratagem`` (module-level, inside functions or under ``TYPE_CHECKING``), the directions
docs/architecture.md states between the rooms, rooms and functions of a readable size, and
references to docs that a clone of the repository holds."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "stratagem"


def _modules() -> dict[str, Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = path
    return modules


MODULES = _modules()


def _imported(name: str, node: ast.Import | ast.ImportFrom) -> set[str]:
    """The stratagem modules an import statement in module ``name`` runs: ``from pkg import x``
    names the submodule ``pkg.x`` when there is one, else ``pkg`` itself."""
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names if alias.name in MODULES}
    base = node.module or ""
    if node.level:
        package = name.split(".")
        if MODULES[name].name != "__init__.py":
            package = package[:-1]
        package = package[:len(package) - node.level + 1]
        base = ".".join([*package, base] if base else package)
    found = {f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names}
    return {module for module in found if module in MODULES}


def import_graph() -> dict[str, set[str]]:
    """Every stratagem module's imports of other stratagem modules, wherever they stand."""
    graph = {}
    for name, path in MODULES.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        graph[name] = set().union(*(_imported(name, node) for node in ast.walk(tree)
                                    if isinstance(node, (ast.Import, ast.ImportFrom)))) - {name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in sorted(graph[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def test_a_cycle_is_found():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]


# (room, rooms it must not import): docs/architecture.md, "Who imports whom"
FORBIDDEN = [
    ("stratagem.plan", ("stratagem.advisor", "stratagem.plugins", "stratagem.integrations", "stratagem.verify",
                        "stratagem.models", "stratagem.cli")),
    ("stratagem.advisor", ("stratagem.plugins", "stratagem.integrations", "stratagem.verify", "stratagem.cli")),
    ("stratagem.plugins", ("stratagem.advisor", "stratagem.integrations", "stratagem.verify", "stratagem.cli")),
    ("stratagem.advisor.cost", ("stratagem.advisor.search", "stratagem.advisor.report",
                                "stratagem.advisor.calibrate", "stratagem.advisor.profile.profiler")),
    ("stratagem.advisor.profile", ("stratagem.advisor.cost", "stratagem.advisor.search",
                                   "stratagem.advisor.report", "stratagem.advisor.hardware")),
    ("stratagem.integrations", ("stratagem.cli",)),
    ("stratagem.verify", ("stratagem.cli",)),
]


def _inside(module: str, room: str) -> bool:
    return module == room or module.startswith(room + ".")


@pytest.mark.parametrize(("room", "forbidden"), FORBIDDEN, ids=[room for room, _ in FORBIDDEN])
def test_rooms_import_only_downward(room, forbidden):
    graph = import_graph()
    wrong = sorted((module, other) for module, imports in graph.items() if _inside(module, room)
                   for other in imports if any(_inside(other, f) for f in forbidden))
    assert wrong == []


MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 60


def test_modules_and_functions_stay_readable():
    too_long = []
    for name, path in MODULES.items():
        source = path.read_text()
        if len(source.splitlines()) > MAX_MODULE_LINES:
            too_long.append(f"{name}: {len(source.splitlines())} lines")
        too_long += [f"{name}.{node.name}: {node.end_lineno - node.lineno + 1} lines"
                     for node in ast.walk(ast.parse(source))
                     if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                     and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]
    assert too_long == []


def _project_files() -> list[Path]:
    return [*PACKAGE.rglob("*.py"), *(ROOT / "tests").rglob("*.py"), *(ROOT / "bench").rglob("*.py"),
            *(ROOT / "examples").rglob("*.py"), ROOT / "README.md", *(ROOT / "docs").rglob("*.md")]


def test_references_resolve_inside_the_repository():
    missing = sorted({f"{path.relative_to(ROOT)}: {ref}" for path in _project_files()
                      for ref in re.findall(r"\bdocs/[\w./-]+\.md", path.read_text())
                      if not (ROOT / ref).is_file()})
    private = sorted({f"{path.relative_to(ROOT)}: {ref}" for path in _project_files() if path != Path(__file__)
                      for ref in re.findall(r"PLATFORM_NOTES|HARDWARE_FACTS|STYLE\.md|STYLE §|DESIGN\.md|\.\./shared",
                                            path.read_text())})
    assert missing == [] and private == []
