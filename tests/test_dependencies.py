"""What installing dask-train takes, and what a test needs beyond ``[test]``.

Each floor in pyproject.toml is what CI installs: constraints-floors.txt pins every dependency,
the extras' too, at the bottom of its range, and ``make test-python PY=3.12.1 FLOORS=1`` (in
.ci/run) installs the project under it. A floor changed in one of the two files and not in the
other fails here. A test that needs an extra skips where the extra is missing, naming it
(tests/extras.py); one that imports an extra's module without that fails here.
"""

import ast
import itertools
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.commands import run_python
from tests.conftest import REPO
from tests.extras import EXTRA_OF

FLOORS = REPO / "constraints-floors.txt"


def pyproject_floors() -> dict[str, str]:
    """Each dependency's lower bound (``>=``), the extras' too: one per name."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = itertools.chain.from_iterable(project["optional-dependencies"].values())
    floors: dict[str, str] = {}
    for text in [*project["dependencies"], *extras]:
        requirement = Requirement(text)
        lower = [s.version for s in requirement.specifier if s.operator == ">="]
        assert len(lower) == 1, f"pyproject.toml: {text!r} needs one floor (>=)"
        name = canonicalize_name(requirement.name)
        assert floors.setdefault(name, lower[0]) == lower[0], (
            f"pyproject.toml: {name} has two floors, {floors[name]} and {lower[0]}"
        )
    return floors


def pinned(path: Path) -> tuple[dict[str, str], set[str]]:
    """``name==version`` lines of a constraints file; and the names whose line says ``# not
    ours``: a package none of our requirements names, pinned only to spare pip's resolver."""
    pins, not_ours = {}, set()
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        text, _, comment = line.partition("#")
        if not text.strip():
            continue
        requirement = Requirement(text)
        specifiers = list(requirement.specifier)
        assert [s.operator for s in specifiers] == ["=="], f"{path.name}:{number}: not name==x"
        name = canonicalize_name(requirement.name)
        pins[name] = specifiers[0].version
        if comment.strip().startswith("not ours"):
            not_ours.add(name)
    return pins, not_ours


def test_the_floors_file_pins_each_floor_of_pyproject_and_nothing_else():
    pins, not_ours = pinned(FLOORS)
    floors = pyproject_floors()
    assert {name: pins[name] for name in pins.keys() - not_ours} == floors
    assert not_ours.isdisjoint(floors)


def _imports_of_extras(tree: ast.Module) -> list[tuple[ast.stmt, str]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""]
        else:
            continue
        found += [(node, name.split(".")[0]) for name in names if name.split(".")[0] in EXTRA_OF]
    return found


def _string_arguments(call: ast.expr, function: str) -> set[str]:
    """The string arguments of ``function(...)`` (or ``x.function(...)``) when ``call`` is one."""
    if not isinstance(call, ast.Call):
        return set()
    if function not in (getattr(call.func, "id", None), getattr(call.func, "attr", None)):
        return set()
    return {arg.value.split(".")[0] for arg in call.args if isinstance(arg, ast.Constant)}


def unguarded_imports(tree: ast.Module) -> list[str]:
    """Imports of an extra's module that run where it may be missing: not under a module-level
    ``pytest.importorskip``, not in a test marked ``needs_extra`` with it, not for type checkers
    only."""
    skipped_module = set().union(
        *(
            _string_arguments(node.value, "importorskip")
            for node in tree.body
            if isinstance(node, ast.Assign | ast.Expr)
        )
    )
    guarded: dict[ast.AST, set[str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef):
            marks = node.decorator_list
            needed = set().union(*(_string_arguments(mark, "needs_extra") for mark in marks))
            for inner in ast.walk(node):
                guarded[inner] = needed
        elif isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            for inner in ast.walk(node):
                guarded[inner] = set(EXTRA_OF)
    return [
        f"line {node.lineno}: {ast.unparse(node)}"
        for node, extra_module in _imports_of_extras(tree)
        if extra_module not in skipped_module | guarded.get(node, set())
    ]


def test_every_test_module_imports_an_extra_only_where_it_skips_without_it():
    found = {
        path.name: unguarded_imports(ast.parse(path.read_text()))
        for path in sorted((REPO / "tests").glob("*.py"))
    }
    assert {name: lines for name, lines in found.items() if lines} == {}


def test_the_import_check_finds_an_unguarded_import_and_passes_a_guarded_one():
    skipped_module = "optuna = pytest.importorskip('optuna')\nimport optuna.trial"
    assert unguarded_imports(ast.parse("from mlflow.tracking import MlflowClient")) != []
    assert unguarded_imports(ast.parse("def test_a():\n    import optuna")) != []
    assert unguarded_imports(ast.parse("@needs_extra('mlflow')\ndef f():\n    import optuna")) != []
    assert unguarded_imports(ast.parse("@needs_extra('optuna')\ndef f():\n    import optuna")) == []
    assert unguarded_imports(ast.parse(skipped_module)) == []
    assert unguarded_imports(ast.parse("if TYPE_CHECKING:\n    from mlflow import A")) == []


def test_without_optuna_sweep_says_which_extra_to_install():
    code = (
        "import sys; sys.modules['optuna'] = None\n"
        "from workflows import sweep\n"
        "sweep(print, {'x': (0.0, 1.0)}, n_trials=1, metric='loss')\n"
    )
    done = run_python(code)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == (
        "ImportError: sweep() needs Optuna, an optional extra: pip install 'dask-train[sweep]'"
    )
