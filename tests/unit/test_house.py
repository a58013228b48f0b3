"""The house's rules, read from the source (no module is imported): no import cycles inside
``stratagem`` (module-level, inside functions or under ``TYPE_CHECKING``), the directions
docs/architecture.md states between the rooms, rooms and functions of a readable size, and
references to docs that a clone of the repository holds."""

from __future__ import annotations

import ast
import io
import re
import tokenize
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


EXTERNAL_DOCUMENTS = {"PERFORMANCE.md", "doc/PERFORMANCE.md",
                      "PyTorch/Classification/ConvNets/resnet50v1.5/README.md", "docs/performance.md",
                      "benchmarks/llama3_h100_202412_torchtitan.md"}
"""Documents of other projects the prose cites by path: nccl-tests' bus-bandwidth definitions,
NVIDIA DeepLearningExamples' ResNet-50 figures, torchtitan's published runs."""

_DOCUMENT = re.compile(r"(?<![\w/.-])((?:\.\./)*[\w./-]*\w\.md)\b")  # a cited markdown file
_OUTSIDE = re.compile(r"(?<![\w.])((?:\.\./)+[\w-]+(?:\.[\w-]+)*)")  # a path that climbs out of the citing folder
_SECTION = re.compile(r"\b([A-Z][A-Z_]+) §")  # a section of a document named in capitals


def _prose(path: Path) -> str:
    """What a file says to its reader: a markdown file whole; a Python file's comments and
    triple-quoted strings (its docstrings), not the literals its code works on."""
    text = path.read_text()
    if path.suffix != ".py":
        return text
    tokens = tokenize.generate_tokens(io.StringIO(text).readline)
    return "\n".join(t.string for t in tokens if t.type == tokenize.COMMENT
                     or (t.type == tokenize.STRING and t.string.lstrip("rbfuRBFU")[:3] in ('"""', "'''")))


def _inside_repository(path: Path, ref: str) -> bool:
    """Whether ``ref`` names a file or folder of the repository: beside ``path``, at the root or in docs/."""
    for base in (path.parent, ROOT, ROOT / "docs"):
        target = (base / ref).resolve()
        if target.exists() and target.is_relative_to(ROOT):
            return True
    return False


def unresolved_references(path: Path, text: str) -> list[str]:
    """The documents ``text`` (from ``path``) cites that a clone of the repository lacks: markdown
    files, paths out of the citing folder, and sections of a document named in capitals."""
    cited = [ref for ref in _DOCUMENT.findall(text) if ref not in EXTERNAL_DOCUMENTS]
    cited += _OUTSIDE.findall(text)
    cited += [f"{name}.md" for name in _SECTION.findall(text)]
    return sorted({ref for ref in cited if not _inside_repository(path, ref)})


def test_references_resolve_inside_the_repository():
    missing = {str(path.relative_to(ROOT)): refs for path in _project_files()
               if (refs := unresolved_references(path, _prose(path)))}
    assert missing == {}


def test_the_reference_check_finds_notes_a_clone_lacks():
    here = ROOT / "tests" / "unit" / "test_house.py"
    assert unresolved_references(here, "see NOTES.md, ../outside/notes and GUIDE §2") == [
        "../outside", "GUIDE.md", "NOTES.md"]
    assert unresolved_references(here, "see docs/cost-model.md, cost-model.md, ../../README.md, ZeRO §3") == []
