"""The package's layers depend one way, top to bottom: commands (``flyspec.cli``) -> ``bench``
-> ``evaluation`` -> ``integrations``, ``server`` and ``testing`` -> the library: the engine and
a pair's calibration -> the algorithm (``decoding``) -> ``models`` -> ``support`` -> ``config``
-> ``errors``. A package imports only packages of the layers below its own, so no two packages
import each other. Checked on the source, imports inside functions included (only ``if
TYPE_CHECKING:`` blocks are left out: they never run)."""

from __future__ import annotations

import ast
from pathlib import Path

import flyspec

SOURCE = Path(flyspec.__file__).parent
LAYERS = (
    ("flyspec.__main__",),  # python -m flyspec: the command's entry point
    ("flyspec.entry",),  # the command's entry point, which starts the process again first
    ("flyspec.cli",),
    ("flyspec.bench",),  # its prompts are the evaluation's
    ("flyspec.evaluation",),
    ("flyspec.integrations", "flyspec.server", "flyspec.testing"),
    ("flyspec.engine", "flyspec.calibration"),
    ("flyspec.decoding",),
    ("flyspec.models",),
    ("flyspec.support",),
    ("flyspec.config",),
    # The package root holds the version and loads its public names lazily, by name.
    ("flyspec", "flyspec.errors"),
)
"""Every package and top-level module, top layer first."""
APPLICATIONS = tuple(package for layer in LAYERS[3:6] for package in layer)
"""The packages between the commands and the library."""


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


def package_of(name: str) -> str:
    """The package a module belongs to: ``flyspec.X`` for anything under a subpackage ``X``,
    the module itself for a module at the top (each one of the library's parts)."""
    return ".".join(name.split(".")[:2])


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """``graph`` with its modules collapsed into their packages."""
    packages: dict[str, set[str]] = {}
    for name, targets in graph.items():
        package = package_of(name)
        packages.setdefault(package, set()).update(
            package_of(target) for target in targets if package_of(target) != package
        )
    return packages


PACKAGES = package_graph(GRAPH)


def layer_of(package: str) -> int:
    """The index of ``package``'s layer in :data:`LAYERS`."""
    for index, layer in enumerate(LAYERS):
        if package in layer:
            return index
    raise KeyError(f"{package} is in no layer: add it to LAYERS")


def layer_breaches(packages: dict[str, set[str]]) -> list[tuple[str, str]]:
    """``(importer, imported)`` for every import of a package in the importer's own layer
    or one above it."""
    return sorted(
        (package, target)
        for package, targets in packages.items()
        for target in targets
        if layer_of(target) <= layer_of(package)
    )


def test_the_import_graph_is_read():
    assert "flyspec.config" in GRAPH["flyspec.engine"]
    assert "flyspec.cli.options" in GRAPH["flyspec.cli.bench"]
    assert "flyspec.evaluation.loosening" in GRAPH["flyspec.evaluation.report"]


def test_no_import_cycle():
    assert cycles(GRAPH) == []


def test_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_package_graph_is_read():
    assert PACKAGES["flyspec.cli"] >= {"flyspec.bench", "flyspec.evaluation", "flyspec.server"}
    assert "flyspec.evaluation" in PACKAGES["flyspec.bench"]
    assert "flyspec.models" in PACKAGES["flyspec.engine"]
    assert "flyspec.bench.methods" not in PACKAGES


def test_no_import_cycle_between_packages():
    assert cycles(PACKAGES) == []


def test_every_package_imports_only_the_layers_below_it():
    assert layer_breaches(PACKAGES) == []


def test_a_planted_package_cycle_and_upward_import_are_caught():
    """Two modules of two packages importing each other form no module cycle, but a
    package cycle, and the lower one imports a layer above its own."""
    graph = {name: set(targets) for name, targets in GRAPH.items()}
    graph["flyspec.evaluation.runner"].add("flyspec.bench.report")
    assert cycles(graph) == []
    packages = package_graph(graph)
    assert ["flyspec.bench", "flyspec.evaluation"] in cycles(packages)
    assert ("flyspec.evaluation", "flyspec.bench") in layer_breaches(packages)
    assert layer_breaches({"flyspec.server": {"flyspec.integrations"}}) == [
        ("flyspec.server", "flyspec.integrations")
    ]
    assert layer_breaches({"flyspec.models": {"flyspec.decoding"}}) == [
        ("flyspec.models", "flyspec.decoding")
    ]


def test_every_package_has_a_layer():
    assert {package: layer_of(package) for package in PACKAGES}


def test_only_commands_import_the_cli():
    importers = {
        name: sorted(target for target in targets if target.startswith("flyspec.cli"))
        for name, targets in GRAPH.items()
        if not name.startswith(("flyspec.cli", "flyspec.entry", "flyspec.__main__"))
    }
    assert {name: cli for name, cli in importers.items() if cli} == {}


def imported_names(name: str) -> set[str]:
    """The names ``name`` imports from flyspec modules (``from flyspec.x import a`` gives
    ``a``), imports inside functions included."""
    return {
        alias.name
        for node in _runtime_nodes(ast.parse(MODULES[name].read_text(encoding="utf-8")))
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("flyspec")
        for alias in node.names
    }


PAIR_BUILDING = {"load_causal_lm", "check_same_tokenizer", "gguf_tokenizer", "apply_cpu_kernels"}
"""What building a model pair is made of: loading a torch model, checking the tokenizers,
reading a GGUF file's tokenizer, switching to the CPU kernels."""


def test_a_pair_is_built_in_models_only():
    """Loading a pair, for every backend, is ``flyspec.models.pair.load_pair``: the engine
    and the commands call it and build no model themselves."""
    builders = {
        name: sorted(imported_names(name) & PAIR_BUILDING)
        for name in MODULES
        if not name.startswith("flyspec.models")
    }
    assert {name: found for name, found in builders.items() if found} == {}
    assert "flyspec.models.pair" in GRAPH["flyspec.engine"]
    assert "flyspec.models.pair" in GRAPH["flyspec.cli.options"]
    assert not any(target.startswith("flyspec.engine") for target in GRAPH["flyspec.models.pair"])


def test_only_the_test_oracles_import_the_test_oracles():
    importers = {
        name: sorted(target for target in targets if target.startswith("flyspec.testing"))
        for name, targets in GRAPH.items()
        if not name.startswith("flyspec.testing")
    }
    assert "flyspec.testing" in PACKAGES
    assert {name: oracles for name, oracles in importers.items() if oracles} == {}


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


def top_level_imports(name: str) -> set[str]:
    """The top-level packages ``name`` imports (``torch``, ``json``, ``flyspec``...)."""
    found = set()
    for node in ast.walk(ast.parse(MODULES[name].read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module.split(".")[0])
    return found


def test_the_auto_k_policy_runs_no_model_and_touches_no_file():
    """``-k auto``'s policy is arithmetic on the costs and acceptance it is given: neither it
    nor what it imports brings in model code (torch included), the measurer, the store, or
    anything that reads or writes files."""
    policy = "flyspec.decoding.auto_k.policy"
    assert imports_of(policy) == {"flyspec.config", "flyspec.decoding.stats"}
    for name in (policy, "flyspec.decoding.stats"):
        outside = top_level_imports(name) - {"flyspec", "__future__"}
        assert not outside & {"torch", "numpy", "json", "os", "pathlib", "shutil", "io"}, name
