"""The code's modules import one another in one direction: no circles, and the client
(``workflows/``) above the workers' code (``workers/``) above the spec (``workers/spec/``).

Every import counts: at the top, inside functions, under ``if TYPE_CHECKING:`` (an annotation
that needs a module ties the two as much as a call does), and through ``importlib`` where the
name is written in the code (a registry that imports its members by name).
"""

import ast
import re

from tests.conftest import REPO

PACKAGES = ("workers", "workflows")
SPEC = "workers.spec"

# importlib calls whose module is not ours or not written in the code, with why.
IMPORTS_OF_OTHERS = {
    "workers.model_sources.base": "model.name's import path: a user's module",
    "workers.compat.torch_private": "torch's own private modules, checked in one place",
    "workflows.jobs.script_launch": "dask-train launch package.module:function: a user's module",
    # Its own (workers.process_group, workers.rank_context) are imported by the rank anyway.
    "workers.preparation": "RANK_MODULES: mostly torch's, what a fresh worker imports early",
}


def _modules() -> dict[str, ast.Module]:
    found = {}
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            parts = path.relative_to(REPO).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = ast.parse(path.read_text(), filename=str(path))
    return found


def _is_package(name: str, known: set[str]) -> bool:
    return any(other.startswith(name + ".") for other in known)


def _runtime_modules(modules: dict[str, ast.Module]) -> set[str]:
    """The modules strategies' plans name as their runtime (``runtime = "..."``)."""
    return {
        node.value.value
        for tree in modules.values()
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign)
        and any(getattr(target, "id", None) == "runtime" for target in node.targets)
        and isinstance(node.value, ast.Constant)
    }


def _string_tables(tree: ast.Module) -> dict[str, set[str]]:
    """Module-level dicts whose values are strings, by name (``_HOMES = {"x": "mod"}``)."""
    tables = {}
    for node in tree.body:
        target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
        value = getattr(node, "value", None)
        strings = isinstance(value, ast.Dict) and value.values
        strings = strings and all(isinstance(v, ast.Constant) for v in value.values)
        if isinstance(target, ast.Name) and strings:
            tables[target.id] = {v.value for v in value.values}
    return tables


def _dynamic_targets(
    name: str, tree: ast.Module, call: ast.Call, known: set[str], runtimes: set[str]
) -> set[str] | None:
    """The modules of ours an ``importlib.import_module`` call can import; None where the code
    does not say."""
    if not call.args:
        return None
    argument = call.args[0]
    package = name if _is_package(name, known) else name.rpartition(".")[0]
    if isinstance(argument, ast.Constant) and isinstance(argument.value, str):
        return {argument.value}
    if isinstance(argument, ast.JoinedStr) and argument.values:
        head = argument.values[0]
        if isinstance(head, ast.FormattedValue) and getattr(head.value, "id", None) in (
            "__name__",
            "__package__",
        ):
            prefix = (name if head.value.id == "__name__" else package) + "."
            return {module for module in known if module.startswith(prefix)}
        return None
    if isinstance(argument, ast.Subscript) and isinstance(argument.value, ast.Name):
        return _string_tables(tree).get(argument.value.id)
    if isinstance(argument, ast.Attribute) and argument.attr == "runtime":
        return runtimes
    return None


def _is_import_module(call: ast.Call) -> bool:
    function = call.func
    return (isinstance(function, ast.Attribute) and function.attr == "import_module") or (
        isinstance(function, ast.Name) and function.id in ("import_module", "__import__")
    )


def _imports(
    name: str, tree: ast.Module, known: set[str], runtimes: set[str] = frozenset()
) -> set[str]:
    """The modules of ours that ``name`` imports anywhere in its code: functions, annotations'
    ``TYPE_CHECKING`` blocks and ``importlib`` calls too."""
    targets = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                targets.add(submodule if submodule in known else node.module)
        elif isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.Call) and _is_import_module(node):
            dynamic = _dynamic_targets(name, tree, node, known, runtimes)
            if dynamic is None:
                assert name in IMPORTS_OF_OTHERS, (
                    f"{name} imports a module through importlib whose name the code does not "
                    "write: write it (a constant, an f-string under __name__, a table), or add "
                    "the module to IMPORTS_OF_OTHERS saying why"
                )
                continue
            targets |= dynamic
    return {t for t in targets if t in known and t != name}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    known, runtimes = set(modules), _runtime_modules(modules)
    return {name: _imports(name, tree, known, runtimes) for name, tree in modules.items()}


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in graph[module]:
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == module:
                    break
            if len(group) > 1:
                circles.append(sorted(group))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return circles


def test_no_module_imports_itself_through_others():
    assert _circles(_graph()) == []


def test_the_workers_code_never_imports_the_client():
    wrong = {
        (name, target)
        for name, targets in _graph().items()
        if name.startswith("workers")
        for target in targets
        if target.startswith("workflows")
    }
    assert wrong == set()


def test_the_spec_is_a_leaf():
    """The spec imports nothing of the project outside itself: config sections, names, layout
    and plans are read by both sides and depend on neither."""
    wrong = {
        (name, target)
        for name, targets in _graph().items()
        if name.startswith(SPEC)
        for target in targets
        if not target.startswith(SPEC)
    }
    assert wrong == set()


# The layers of docs/design.md's picture, top to bottom: each imports only its own or lower ones.
# The client's folders follow a run's flow: a sweep or a prediction drives runs, a run its data
# and jobs, a job reports through observe and runs on the cluster.
LAYERS = (
    "workflows",
    "workflows.sweeps",
    "workflows.prediction",
    "workflows.runs",
    "workflows.data",
    "workflows.jobs",
    "workflows.observe",
    "workflows.cluster",
    "workflows.compat",
    "workers",
    SPEC,
)


def _layer(module: str) -> int:
    return max(
        i for i, layer in enumerate(LAYERS) if module == layer or module.startswith(layer + ".")
    )


def test_the_packages_import_as_the_design_picture_draws():
    picture = (REPO / "docs" / "design.md").read_text().split("```text\n", 1)[1].split("```")[0]
    boxes = re.findall(r"^[ │▼]*((?:workflows|workers)/(?:\w+/)*)", picture, re.M)
    assert boxes == [f"{layer.replace('.', '/')}/" for layer in LAYERS]
    upward = {
        (name, target)
        for name, targets in _graph().items()
        for target in targets
        if _layer(target) < _layer(name)
    }
    assert upward == set()


def test_the_strategies_runtimes_are_edges_of_the_graph():
    graph = _graph()
    assert "workers.strategies.fsdp.sharding" in graph["workers.strategies"]
    assert "workers.spec.plans.pipeline" in graph["workers.spec.plans"]
    assert "workers.sources.cifar10" in graph["workers.sources"]


def test_the_check_finds_a_circle_through_a_lazy_a_typed_or_an_importlib_import():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _circles(graph) == [["a", "b", "c"]]
    known = {"workflows.cli", "workflows.x", "workflows.plug", "workflows.plug.one"}
    lazy = ast.parse("def f():\n    from workflows.cli import main\n")
    assert _imports("workflows.x", lazy, known) == {"workflows.cli"}
    typed = ast.parse("if TYPE_CHECKING:\n    from workflows.cli import main\n")
    assert _imports("workflows.x", typed, known) == {"workflows.cli"}
    registry = ast.parse("def f(n):\n    importlib.import_module(f'{__name__}.{n}')\n")
    assert _imports("workflows.plug", registry, known) == {"workflows.plug.one"}
    table = ast.parse("H = {'a': 'workflows.cli'}\ndef f(n):\n    import_module(H[n])\n")
    assert _imports("workflows.x", table, known) == {"workflows.cli"}
