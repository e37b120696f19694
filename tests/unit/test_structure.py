"""The package's structure, counted with every import (module level, inside functions and
under ``TYPE_CHECKING``): no import circle, the per-run code never reaches the
``Instance``, the saver side never reaches the wrapper it sits under, and no module takes
another module's private names. A new circle or back-import fails here, naming it.

The import graph is grimp's (import-linter's engine), which reads every import statement
of the package's source, wherever it stands.
"""

from __future__ import annotations

import ast
from pathlib import Path

import grimp
import pytest

import langgraph_fence

PACKAGE = "langgraph_fence"
ROOT = Path(langgraph_fence.__file__).parent


@pytest.fixture(scope="module")
def graph() -> grimp.ImportGraph:
    return grimp.build_graph(PACKAGE, include_external_packages=False)


def _circles(graph: grimp.ImportGraph) -> list[list[str]]:
    """The import circles: strongly connected sets of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for imported in sorted(graph.find_modules_directly_imported_by(module)):
            if imported not in index:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in on_stack:
                low[module] = min(low[module], index[imported])
        if low[module] == index[module]:
            circle = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                circle.append(member)
                if member == module:
                    break
            if len(circle) > 1:
                found.append(sorted(circle))

    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    return found


def _edges(graph: grimp.ImportGraph, circle: list[str]) -> list[str]:
    members = set(circle)
    return [
        f"{importer} -> {imported} (line {', '.join(str(d['line_number']) for d in details)})"
        for importer in circle
        for imported in sorted(graph.find_modules_directly_imported_by(importer) & members)
        for details in [graph.get_import_details(importer=importer, imported=imported)]
    ]


def test_no_module_imports_itself_back_through_others(graph: grimp.ImportGraph) -> None:
    circles = _circles(graph)
    said = "\n".join("\n  ".join(["circle:", *_edges(graph, c)]) for c in circles)
    assert circles == [], f"import circles (cut the import that points up):\n{said}"


#: The package's layers, highest first: a module may import from its own layer's package
#: and from the layers below it, never from one above. The packages are the concepts of
#: docs/architecture.md; the bottom layer is the vocabulary every package shares.
LAYERS: tuple[grimp.Layer | str, ...] = (
    # The edges a user or operator touches: the command line, the OpenTelemetry listener,
    # the pytest plugin. None of them imports another.
    grimp.Layer("cli", "otel", "server", "testing", independent=True),
    # The operator's console and /metrics: reads what every instance writes (the cli serves
    # it, and a worker's --metrics-port).
    "console",
    # The process-level runtime that composes everything below.
    "instance",
    # Steps: the node and tool wrappers, fence_graph, the running step's frame.
    "steps",
    # A run's life, its keeper, its children and the takeover loop.
    "execution",
    # The run queue: submitted runs any worker can take.
    "queue",
    # The fence-aware SQL saver and store (checkpointers), and the wrappers over any saver
    # and store with the admin operations on a thread (saver): both sit on the fence's
    # write admission, and neither imports the other.
    grimp.Layer("checkpointers", "saver", independent=True),
    # The exactly-once sink.
    "sinks",
    # The fence a step runs under, its run's handle, and the admission every write passes.
    "fence",
    # The lease: its contract, its transitions, its stores, its tables and records.
    "lease",
    # Engines, driver statements, migrations, and what a connection error is.
    "database",
    # The vocabulary: errors, events, effects, validation, redaction, serde, config keys.
    grimp.Layer(
        "_compat",
        "contracts",
        "effects",
        "errors",
        "events",
        "from_thread",
        "keys",
        "redact",
        "serde",
        "validate",
        independent=False,
    ),
)


def test_every_import_points_down_the_layers(graph: grimp.ImportGraph) -> None:
    illegal = graph.find_illegal_dependencies_for_layers(layers=LAYERS, containers={PACKAGE})
    said = [
        f"{d.importer} -> {d.imported}: "
        + "; ".join(" -> ".join((*r.heads, *r.middle, *r.tails)) for r in d.routes)
        for d in sorted(illegal, key=lambda d: (d.importer, d.imported))
    ]
    assert said == [], "imports pointing up the layers:\n" + "\n".join(said)


def test_every_module_has_its_layer() -> None:
    """A new module or package is placed in a layer on purpose (add it to LAYERS)."""
    named = {
        part
        for layer in LAYERS
        for part in (layer.module_tails if isinstance(layer, grimp.Layer) else {layer})
    }
    tops = {
        path.stem if path.suffix == ".py" else path.name
        for path in ROOT.iterdir()
        if (path.suffix == ".py" or (path / "__init__.py").exists())
    }
    assert tops - named - {"__init__", "__main__"} == set()


#: Code below the Instance: a run, its steps, its writes and its instance's services reach
#: the instance through ``execution.host.InstanceHost`` or the protocols beside the handle,
#: never the ``Instance`` itself.
BELOW_THE_INSTANCE = ["checkpointers", "execution", "fence", "lease", "queue", "saver", "steps"]


@pytest.mark.parametrize("package", BELOW_THE_INSTANCE)
def test_the_per_run_code_never_reaches_the_instance(
    graph: grimp.ImportGraph, package: str
) -> None:
    chain = graph.find_shortest_chain(
        importer=f"{PACKAGE}.{package}", imported=f"{PACKAGE}.instance", as_packages=True
    )
    assert chain is None, " -> ".join(chain or ())


def test_the_sql_savers_never_reach_the_wrappers(graph: grimp.ImportGraph) -> None:
    """``checkpointers`` (the fence-aware SQL saver and store) and ``saver`` (the wrappers
    over any saver and store) both sit on write admission; the savers import no wrapper."""
    chain = graph.find_shortest_chain(
        importer=f"{PACKAGE}.checkpointers", imported=f"{PACKAGE}.saver", as_packages=True
    )
    assert chain is None, " -> ".join(chain or ())


def _imports(path: Path) -> list[tuple[int, str | None, int, list[str]]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found: list[tuple[int, str | None, int, list[str]]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            found.append((node.lineno, node.module, node.level, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            found.extend((node.lineno, a.name, 0, []) for a in node.names)
    return found


SOURCES = sorted(ROOT.rglob("*.py"))


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_module_takes_another_modules_private_names(path: Path) -> None:
    """A name with a leading underscore is its module's own: another module that needs it
    gets a public name (private modules, ``_compat`` and the saver's ``_rows``, are the
    package's own and imported by name)."""
    taken = [
        f"line {line}: {name} from {module or '.'}"
        for line, module, level, names in _imports(path)
        if level > 0 or (module or "").split(".")[0] == PACKAGE
        for name in names
        if name.startswith("_") and not name.startswith("__")
    ]
    assert taken == []


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_nothing_imports_a_name_a_users_module_can_shadow(path: Path) -> None:
    """``checkpointers`` is also the earlier top-level name of the saver package: a user's
    own ``checkpointers.py`` would shadow it, so the package never imports it."""
    shadowable = [
        f"line {line}: {module}"
        for line, module, level, _ in _imports(path)
        if level == 0 and (module or "").split(".")[0] == "checkpointers"
    ]
    assert shadowable == []


#: Underscore names that are public by convention: named tuples' and SQLAlchemy rows'
#: API, the standard library's documented ``sys._getframe``, and the methods LangChain
#: documents for a tool class to implement (``BaseTool._run`` / ``_arun``).
_PUBLIC_UNDERSCORE = {"_replace", "_asdict", "_fields", "_mapping", "_getframe", "_run", "_arun"}


def _defined_names(tree: ast.AST) -> set[str]:
    """Every name a module defines or assigns (functions, classes, attributes it sets,
    ``__slots__`` entries, imports): what its own code may reach by an underscore name."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.alias):
            names.add(node.asname or node.name.split(".")[-1])
        elif isinstance(node, ast.Assign) and any(
            isinstance(target, ast.Name) and target.id == "__slots__" for target in node.targets
        ):
            names.update(
                c.value
                for c in ast.walk(node.value)
                if isinstance(c, ast.Constant) and isinstance(c.value, str)
            )
    return names


def _in_methods(tree: ast.AST) -> set[int]:
    """The nodes inside a class's own methods, where ``self`` and ``cls`` are that class."""
    return {
        id(node)
        for cls in ast.walk(tree)
        if isinstance(cls, ast.ClassDef)
        for method in cls.body
        if isinstance(method, ast.FunctionDef | ast.AsyncFunctionDef)
        for node in ast.walk(method)
    }


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_module_reaches_into_another_modules_private_state(path: Path) -> None:
    """``obj._name`` is allowed in a class's own methods on ``self``/``cls``, and where the
    module itself defines ``_name`` (its own class's state, another instance of it);
    anything else (a free function taking ``self``, a Protocol re-declaring another class's
    private members) is a reach-in to give a public name. The private names of LangGraph,
    SQLAlchemy and aiosqlite are read in ``_compat`` only."""
    if path.name == "_compat.py":
        return
    tree = ast.parse(path.read_text(), filename=str(path))
    defined, methods = _defined_names(tree), _in_methods(tree)
    reached = []
    for node in ast.walk(tree):
        if not (
            isinstance(node, ast.Attribute)
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
            and node.attr not in _PUBLIC_UNDERSCORE
        ):
            continue
        on_self = isinstance(node.value, ast.Name) and node.value.id in {"self", "cls"}
        if (on_self and id(node) in methods) or (not on_self and node.attr in defined):
            continue
        reached.append(f"line {node.lineno}: {ast.unparse(node)}")
    assert reached == []


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_logger_has_a_name_that_outlives_the_module_path(path: Path) -> None:
    """Logger names are what users configure logging by; module paths are internal and
    move. Each module names its logger (``langgraph_fence.<name>``), never ``__name__``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    unnamed = [
        f"line {node.lineno}: {ast.unparse(node)}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and ast.unparse(node.func).endswith("getLogger")
        and not (
            node.args
            and isinstance(node.args[0], ast.Constant)
            and str(node.args[0].value).startswith(PACKAGE)
        )
    ]
    assert unnamed == []
