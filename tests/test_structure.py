"""The house's structure, read from the imports of every module (lazy ones inside functions and those under
TYPE_CHECKING included): no import circle, between modules or between the rooms at the top of xla_magic/; the
machinery (runs, pools, hosts, ranks, cell, the session) imports none of the notebook's room; the rank side
imports only what both sides speak (xla_magic.wire), what both sides speak imports nothing else of ours, and the
kernel side never imports the rank side."""

from __future__ import annotations

import ast
import pathlib
import re

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "xla_magic"


def _in(name: str, *packages: str) -> bool:
    return any(name == package or name.startswith(package + ".") for package in packages)


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, pathlib.Path]:
    return {_module_name(path): path for path in PACKAGE.rglob("*.py")}


def _imports(name: str, path: pathlib.Path, known: set[str]) -> set[str]:
    """The modules of ours that ``name`` imports (``from a import b`` names a.b where that is a module)."""
    found: set[str] = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:  # `import xla_magic.wire.protocol` names that module
                target = target.rpartition(".")[0]
            if target and target != name and target.startswith("xla_magic"):
                found.add(target)
    # A package's face hands its modules on; importing a module through its package is not a tie to the face.
    return {target for target in found if not (name.startswith(target + ".") and known.get(target) is not None)}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    known = dict(modules)
    return {name: _imports(name, path, known) for name, path in modules.items()}  # type: ignore[arg-type]


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        circles.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = counter
                counter += 1
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph.get(child, ())))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return circles


def test_the_reading_finds_a_circle_and_a_crossing_where_there_is_one():
    # The checks below mean something only if the reading sees such ties: here, made up, it must.
    graph = {"xla_magic.a": {"xla_magic.b"}, "xla_magic.b": {"xla_magic.c"}, "xla_magic.c": {"xla_magic.a"},
             "xla_magic.d": {"xla_magic.a"}}
    assert _circles(graph) == [["xla_magic.a", "xla_magic.b", "xla_magic.c"]]
    real = _graph()
    assert "xla_magic.wire.protocol" in real["xla_magic.launcher.serve"]  # a plain `from xla_magic.wire import ...`
    assert "xla_magic.wire.trace" in real["xla_magic.launcher.profiling"]  # a lazy import inside a function


def test_no_module_imports_itself_in_a_circle():
    assert _circles(_graph()) == []


def _room(name: str) -> str:
    """The room at the top of xla_magic/ that a module is in: its folder, or itself (``xla_magic.session``)."""
    return ".".join(name.split(".")[:2])


# The rooms, top floor first: each may import the ones below it, never one above.
FLOORS = ("xla_magic", "xla_magic.notebook", "xla_magic.session", "xla_magic.hosts", "xla_magic.pools",
          "xla_magic.runs", "xla_magic.ranks", "xla_magic.cell", "xla_magic.wire")
MACHINERY = ("xla_magic.session", "xla_magic.hosts", "xla_magic.pools", "xla_magic.runs", "xla_magic.ranks",
             "xla_magic.cell")


def test_the_top_of_the_package_is_a_handful_of_rooms():
    entries = sorted(path.name for path in PACKAGE.iterdir() if path.name != "__pycache__"
                     and not path.name.endswith(".md"))
    assert len(entries) <= 10, entries
    assert {_room(name) for name in _modules()} <= set(FLOORS) | {"xla_magic.launcher"}


def test_the_rooms_import_each_other_downwards_only():
    climbs = sorted((name, target) for name, targets in _graph().items() for target in targets
                    if _room(name) in FLOORS and _room(target) in FLOORS
                    and FLOORS.index(_room(target)) < FLOORS.index(_room(name)))
    assert climbs == []


def test_the_machinery_imports_none_of_the_notebook_s_views():
    # A request writes to the sink it is given (runs/sink.py); the notebook's views are one kind of sink.
    into_views = {name: sorted(target for target in targets if _in(target, "xla_magic.notebook"))
                  for name, targets in _graph().items() if _in(name, *MACHINERY)}
    assert {name: targets for name, targets in into_views.items() if targets} == {}


def test_the_rank_side_imports_only_what_both_sides_speak():
    crossing = {name: sorted(target for target in targets
                             if not _in(target, "xla_magic.launcher", "xla_magic.wire"))
                for name, targets in _graph().items() if _in(name, "xla_magic.launcher")}
    assert {name: targets for name, targets in crossing.items() if targets} == {}


def test_what_both_sides_speak_imports_nothing_else_of_ours():
    crossing = {name: sorted(target for target in targets if not _in(target, "xla_magic.wire"))
                for name, targets in _graph().items() if _in(name, "xla_magic.wire")}
    assert {name: targets for name, targets in crossing.items() if targets} == {}


def test_the_kernel_side_never_imports_the_rank_side():
    crossing = {name: sorted(target for target in targets if _in(target, "xla_magic.launcher"))
                for name, targets in _graph().items() if not _in(name, "xla_magic.launcher")}
    assert {name: targets for name, targets in crossing.items() if targets} == {}


def test_each_module_says_first_which_process_runs_it():
    # The first line of each module's docstring ends by naming its side, so a reader knows where it runs.
    unsaid = []
    for name, path in sorted(_modules().items()):
        docstring = ast.get_docstring(ast.parse(path.read_text())) or ""
        first = docstring.split("\n\n")[0]
        if not re.search(r"\bRuns (in|on) \w", first):
            unsaid.append(name)
    assert unsaid == []
