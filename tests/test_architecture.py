"""The package's shape: no import circle, imports that run down the layers, no module over 500 lines.

The import graph is read from the source with `ast`, both module-level imports and those inside
functions: an import in a function only delays a circle to the first call, so it counts as well.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.conftest import ROOT

MAX_LINES = 500

# The layers, lowest first. A module may import from its own layer and from any layer below it;
# an import from a layer above ("upward") couples the lower layer to what is built on it, and at
# most one is tolerated. An entry names a module or a package (every module under it).
#   foundation  errors, argument checks, units, files, interrupts, progress, the run id's keys: no method, no config;
#               the package root too: its API names load their modules on first use (importlib),
#               so importing `backdoorbench` imports nothing else
#   data        the datasets as in-memory uint8 tensors
#   models      architectures, and the feature taps that methods of several families read
#   train       the one trainer, its augmentation, checkpoints and the official recipes
#   attacks     one file per attack (they train their victims through `train`)
#   metrics     CA/ASR/RA, stealth, robustness, reactivation, GradCAM (they read attacks' triggers)
#   defenses    one file per defense, and the runner that scores what a defense returns
#   run         one run: its config and id, the record it writes, validation, create-by-name (and the
#               near-miss hints of a wrong name), the victim and its cache, PGD and its memo,
#               provenance, the record's facts, and `pipeline.run`, which tells the story
#   entry       the command line: preflight, the help page, launchers, `python -m backdoorbench`
#   report      what reads the records: the report wing, the leaderboard, figures, the fidelity ledger,
#               the defense suite's closing table
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("foundation", ("backdoorbench", "errors", "checks", "units", "precision", "interrupts", "progress",
                    "distributed", "fileio", "run_keys")),
    ("data", ("datasets",)),
    ("models", ("models",)),
    ("train", ("train",)),
    ("attacks", ("attacks",)),
    ("metrics", ("metrics",)),
    ("defenses", ("defenses",)),
    ("run", ("config", "conf", "records", "stages", "provenance", "pgd_memo", "validation", "victim", "cache",
             "artifacts", "loggers", "registry", "suggest", "factory", "plugins", "run_facts", "protocols", "pipeline")),
    ("entry", ("cli", "help_page", "launchers", "__main__")),
    ("report", ("report", "leaderboard", "protocol_tables", "figures", "ledger", "defense_suite")),
)


def module_files(root: Path, package: str) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of `package` under `root`."""
    modules = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def import_graph(root: Path, package: str) -> dict[str, dict[str, str]]:
    """module -> {imported module of `package`: where (file:line, and whether inside a function)}.

    `from a.b import c` imports the module a.b.c when there is one, else (a name of a.b) a.b.
    The packages above an imported module are not counted: Python runs their __init__ first,
    but a package's own modules importing their siblings through it is no circle."""
    modules = module_files(root, package)

    def known(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, dict[str, str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        here = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges: dict[str, str] = {}
        scopes = [(node, False) for node in tree.body]
        while scopes:
            node, nested = scopes.pop()
            inner = nested or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            scopes += [(child, inner) for child in ast.iter_child_nodes(node)]
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [known(alias.name) for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = here.split(".")[: len(here.split(".")) - node.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else known(base)
                           for alias in node.names]
            for target in targets:
                if target and target != name and target.split(".")[0] == package:
                    where = f"{path.relative_to(root)}:{node.lineno}{' (in a function)' if inner else ''}"
                    edges.setdefault(target, where)
        graph[name] = edges
    return graph


def circles(graph: dict[str, dict[str, str]]) -> list[list[str]]:
    """One circle (a -> b -> ... -> a) through each strongly connected group of modules (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in graph.get(node, {}):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            group = set()
            while True:
                member = stack.pop()
                group.add(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(group)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    found = []
    for group in groups:  # a shortest way round from the group's first module, breadth first
        start = min(group)
        paths, frontier = {start: [start]}, [start]
        while not (closing := [node for node in frontier if start in graph[node]]):
            reached = []
            for node in frontier:
                for other in sorted(graph[node]):
                    if other in group and other not in paths:
                        paths[other] = paths[node] + [other]
                        reached.append(other)
            frontier = reached
        found.append(paths[closing[0]] + [start])
    return found


def describe(circle: list[str], graph: dict[str, dict[str, str]]) -> str:
    return " -> ".join(f"{a} [{graph[a][b]}]" for a, b in zip(circle, circle[1:])) + f" -> {circle[-1]}"


def layer_of(module: str) -> int | None:
    """The index in LAYERS of the longest entry that names `module` or a package above it."""
    relative = module.partition(".")[2] or module  # the package root itself is "backdoorbench"
    named = [(len(entry), position) for position, (_, entries) in enumerate(LAYERS) for entry in entries
             if relative == entry or relative.startswith(entry + ".")]
    return max(named)[1] if named else None


@pytest.fixture(scope="module")
def graph() -> dict[str, dict[str, str]]:
    return import_graph(ROOT, "backdoorbench")


def test_the_package_has_no_import_circle(graph) -> None:
    found = [describe(circle, graph) for circle in circles(graph)]
    assert not found, "import circles:\n" + "\n".join(found)


def test_the_benchmarks_have_no_import_circle() -> None:
    benchmarks = import_graph(ROOT, "benchmarks")
    found = [describe(circle, benchmarks) for circle in circles(benchmarks)]
    assert not found, "import circles:\n" + "\n".join(found)


def test_every_module_has_a_layer(graph) -> None:
    unplaced = sorted(module for module in graph if layer_of(module) is None)
    assert not unplaced, f"modules in no layer: {', '.join(unplaced)}; add each to LAYERS in {Path(__file__).name}"


def test_imports_run_down_the_layers_but_for_one_at_most(graph) -> None:
    upward = [f"{module} ({LAYERS[layer_of(module)][0]}) imports {target} ({LAYERS[layer_of(target)][0]}) at {where}"
              for module, edges in sorted(graph.items()) for target, where in sorted(edges.items())
              if layer_of(module) is not None and layer_of(target) is not None and layer_of(target) > layer_of(module)]
    assert len(upward) <= 1, "imports up a layer:\n" + "\n".join(upward)


def test_no_module_of_the_package_is_over_500_lines() -> None:
    long = {str(path.relative_to(ROOT)): count for path in sorted((ROOT / "backdoorbench").rglob("*.py"))
            if (count := len(path.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines (split them by job): {long}"


def test_the_graph_sees_a_circle_closed_inside_a_function(tmp_path) -> None:
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("from . import b\n")
    (package / "a.py").write_text("from pkg.sub import b\n")
    (package / "sub" / "b.py").write_text("def late():\n    from ..c import value\n    return value\n")
    (package / "c.py").write_text("import pkg.a\nvalue = 1\n")
    (package / "d.py").write_text("from pkg import a\n")  # into the circle, not part of it
    found = import_graph(tmp_path, "pkg")
    assert found["pkg.sub.b"] == {"pkg.c": "pkg/sub/b.py:2 (in a function)"}
    assert found["pkg.sub"] == {"pkg.sub.b": "pkg/sub/__init__.py:1"}  # a package importing its own module
    assert circles(found) == [["pkg.a", "pkg.sub.b", "pkg.c", "pkg.a"]]
    assert "pkg.sub.b [pkg/sub/b.py:2 (in a function)] -> pkg.c" in describe(circles(found)[0], found)
