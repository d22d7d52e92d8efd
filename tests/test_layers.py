"""The package's layers depend one way: commands (``flyspec.cli``) -> applications (``bench``,
``evaluation``, ``server``, ``integrations``) -> the library. Checked on the source, imports
inside functions included (only ``if TYPE_CHECKING:`` blocks are left out: they never run)."""

from __future__ import annotations

import ast
from pathlib import Path

import flyspec

SOURCE = Path(flyspec.__file__).parent
APPLICATIONS = ("flyspec.bench", "flyspec.evaluation", "flyspec.server", "flyspec.integrations")


def module_name(path: Path) -> str:
    parts = path.relative_to(SOURCE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in SOURCE.rglob("*.py")}


def _runtime_nodes(tree: ast.AST):
    """Every node but those under ``if TYPE_CHECKING:``."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            stack.extend(node.orelse)
            continue
        yield node
        stack.extend(ast.iter_child_nodes(node))


def imports_of(name: str) -> set[str]:
    """The flyspec modules ``name`` imports; ``from package import module`` counts as an
    import of the module, not of the package."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in _runtime_nodes(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                found.add(submodule if submodule in MODULES else base)
    return {module for module in found if module in MODULES and module != name}


GRAPH = {name: imports_of(name) for name in MODULES}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_import_graph_is_read():
    assert "flyspec.config" in GRAPH["flyspec.engine"]
    assert "flyspec.cli.options" in GRAPH["flyspec.cli.bench"]
    assert "flyspec.evaluation.loosening" in GRAPH["flyspec.evaluation.report"]


def test_no_import_cycle():
    assert cycles(GRAPH) == []


def test_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_only_commands_import_the_cli():
    importers = {
        name: sorted(target for target in targets if target.startswith("flyspec.cli"))
        for name, targets in GRAPH.items()
        if not name.startswith("flyspec.cli")
    }
    assert {name: cli for name, cli in importers.items() if cli} == {}


def test_the_library_imports_no_application():
    library = [name for name in GRAPH if not name.startswith(("flyspec.cli", *APPLICATIONS))]
    assert (
        library
        and {
            name: sorted(t for t in GRAPH[name] if t.startswith(APPLICATIONS))
            for name in library
            if any(t.startswith(APPLICATIONS) for t in GRAPH[name])
        }
        == {}
    )


def test_applications_use_no_argparse():
    users = [
        name
        for name, path in MODULES.items()
        if name.startswith(APPLICATIONS) and "argparse" in path.read_text(encoding="utf-8")
    ]
    assert users == []
