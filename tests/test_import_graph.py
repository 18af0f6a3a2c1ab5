"""The code's modules import one another in one direction: no circles, lazy imports included."""

import ast

from tests.conftest import REPO

PACKAGES = ("workers", "workflows")


def _modules() -> dict[str, ast.Module]:
    found = {}
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            parts = path.relative_to(REPO).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = ast.parse(path.read_text(), filename=str(path))
    return found


def _type_checking_blocks(tree: ast.Module) -> set[int]:
    """ids of the statements under ``if TYPE_CHECKING:`` (imports for annotations only)."""
    inside = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            inside.update(id(child) for stmt in node.body for child in ast.walk(stmt))
    return inside


def _imports(name: str, tree: ast.Module, known: set[str]) -> set[str]:
    """The modules of ours that ``name`` imports anywhere in its code (functions too)."""
    skipped = _type_checking_blocks(tree)
    targets = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                targets.add(submodule if submodule in known else node.module)
        elif isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
    return {t for t in targets if t in known and t != name}


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
    modules = _modules()
    graph = {name: _imports(name, tree, set(modules)) for name, tree in modules.items()}
    assert _circles(graph) == []


def test_the_check_finds_a_circle_through_a_lazy_import():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _circles(graph) == [["a", "b", "c"]]
    lazy = ast.parse("def f():\n    from workflows.cli import main\n")
    assert _imports("workflows.x", lazy, {"workflows.cli", "workflows.x"}) == {"workflows.cli"}
    typed = ast.parse("if TYPE_CHECKING:\n    from workflows.cli import main\n")
    assert _imports("workflows.x", typed, {"workflows.cli", "workflows.x"}) == set()
