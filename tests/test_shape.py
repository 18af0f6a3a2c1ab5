"""The code keeps a shape a reader can hold: no function takes more than 6 parameters or runs
over 60 lines of code (issue 61).

Parameters are counted as a caller writes them (``self`` and ``cls`` not counted; ``*args``
and ``**kwargs`` one each); lines of code are the function's lines less its blank lines,
comment lines and docstring. The public entry points (the functions of ``workflows.__all__``
and the CLI's click commands) may take as many parameters as their users' options; the
benchmarks' ``main`` functions may run as long as their scripts.
"""

import ast
from collections.abc import Iterator
from dataclasses import dataclass

from tests.conftest import REPO

PACKAGES = ("workflows", "workers")
MAX_PARAMETERS = 6
MAX_CODE_LINES = 60
CLI = "workflows/cli.py"
BENCHMARKS = "workflows/benchmarks/"

Function = ast.FunctionDef | ast.AsyncFunctionDef


@dataclass(frozen=True)
class Offender:
    where: str  # file:line
    name: str
    what: str  # "parameters" or "code lines"
    count: int

    def __str__(self) -> str:
        return f"{self.where} {self.name}: {self.count} {self.what}"


def parameter_count(function: Function) -> int:
    arguments = function.args
    named = [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs]
    count = len([a for a in named if a.arg not in ("self", "cls")])
    return count + (arguments.vararg is not None) + (arguments.kwarg is not None)


def code_lines(function: Function, lines: list[str]) -> int:
    body = function.body
    docstring: range = range(0)
    first = body[0] if body else None
    if (
        isinstance(first, ast.Expr)
        and isinstance(first.value, ast.Constant)
        and isinstance(first.value.value, str)
    ):
        docstring = range(first.lineno, (first.end_lineno or first.lineno) + 1)
    assert function.end_lineno is not None
    return sum(
        1
        for number in range(function.lineno, function.end_lineno + 1)
        if number not in docstring
        and (text := lines[number - 1].strip())
        and not text.startswith("#")
    )


def _decorator_name(decorator: ast.expr) -> str:
    target = decorator.func if isinstance(decorator, ast.Call) else decorator
    if isinstance(target, ast.Attribute):
        return target.attr
    return target.id if isinstance(target, ast.Name) else ""


def _functions(tree: ast.Module) -> Iterator[tuple[Function, bool]]:
    """Every function and method, with whether it is defined at the module's top level."""
    top = {id(node) for node in tree.body}
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield node, id(node) in top


def offenders(source: str, path: str, entry_points: frozenset[str] = frozenset()) -> list[Offender]:
    """The functions of ``source`` (the file at ``path``, relative to the repository) that are
    too wide or too long. ``entry_points``: the public functions defined at its top level, whose
    parameters are their users' options."""
    lines = source.splitlines()
    found = []
    for function, top_level in _functions(ast.parse(source, filename=path)):
        where = f"{path}:{function.lineno}"
        command = path == CLI and any(
            _decorator_name(d) in ("command", "group") for d in function.decorator_list
        )
        public = command or (top_level and function.name in entry_points)
        if not public and (count := parameter_count(function)) > MAX_PARAMETERS:
            found.append(Offender(where, function.name, "parameters", count))
        script = path.startswith(BENCHMARKS) and function.name == "main" and top_level
        if not script and (count := code_lines(function, lines)) > MAX_CODE_LINES:
            found.append(Offender(where, function.name, "code lines", count))
    return found


def public_entry_points() -> dict[str, frozenset[str]]:
    """Module path → the names of ``workflows.__all__`` it is the home of (``_HOMES`` in
    workflows/__init__.py, read without importing anything); only those defined there as
    functions count, by :func:`offenders`."""
    tree = ast.parse((REPO / "workflows" / "__init__.py").read_text())
    homes: dict[str, str] = {}
    exported: list[str] = []
    for node in tree.body:
        targets = [node.target] if isinstance(node, ast.AnnAssign) else getattr(node, "targets", [])
        names = [t.id for t in targets if isinstance(t, ast.Name)]
        if "_HOMES" in names:
            homes = ast.literal_eval(node.value)
        if "__all__" in names:
            exported = ast.literal_eval(node.value)
    assert homes and exported, "workflows/__init__.py: _HOMES and __all__ not found"
    by_module: dict[str, set[str]] = {}
    for name in exported:
        module = homes[name].replace(".", "/") + ".py"
        by_module.setdefault(module, set()).add(name)
    return {module: frozenset(names) for module, names in by_module.items()}


def _all_offenders() -> list[Offender]:
    entry_points = public_entry_points()
    found = []
    for package in PACKAGES:
        for file in sorted((REPO / package).rglob("*.py")):
            path = file.relative_to(REPO).as_posix()
            found += offenders(file.read_text(), path, entry_points.get(path, frozenset()))
    return found


def test_no_function_is_too_wide_or_too_long():
    found = _all_offenders()
    wide = [str(o) for o in found if o.what == "parameters"]
    long = [str(o) for o in found if o.what == "code lines"]
    message = []
    if wide:
        message.append(
            f"{len(wide)} functions take more than {MAX_PARAMETERS} parameters (self/cls not "
            "counted); group the parameters that travel together into a small frozen "
            "dataclass naming the concept, or pass the object the caller holds:\n  "
            + "\n  ".join(wide)
        )
    if long:
        message.append(
            f"{len(long)} functions run over {MAX_CODE_LINES} lines of code (blank lines, "
            "comments and the docstring not counted); split them into named steps:\n  "
            + "\n  ".join(long)
        )
    assert not found, "\n".join(message)


def _steps(n: int, indent: str) -> str:
    return "\n".join(f"{indent}step_{i} = {i}" for i in range(n))


# A method of 7 parameters and 61 lines of code, padded with what is not counted: a docstring,
# comments and blank lines; and a function of 6 parameters and 60 lines beside it.
PLANTED = f'''
class Planner:
    def wide_and_long(self, a, b, c, d, e, *rest, **options):
        """A docstring

        over several lines, none of them code.
        """
        # a comment

{_steps(59, " " * 8)}
        return step_0
'''
ALLOWED = f"""
def just_fits(a, b, c, d, e, f):
    # a comment

{_steps(58, " " * 4)}
    return step_0
"""


def test_the_counting_finds_a_planted_offender_and_passes_its_neighbour_at_the_limit():
    found = offenders(PLANTED + ALLOWED, "workers/planted.py")
    assert [str(o) for o in found] == [
        "workers/planted.py:3 wide_and_long: 7 parameters",
        "workers/planted.py:3 wide_and_long: 61 code lines",
    ]
    # A public entry point may be wide, not long; a benchmark's main may be long, not wide.
    exempt = offenders(PLANTED.replace("wide_and_long", "main"), "workflows/benchmarks/x.py")
    assert [o.what for o in exempt] == ["parameters", "code lines"]  # a method, not the script
    script = ALLOWED.replace("just_fits(a, b, c, d, e, f)", "main(a, b, c, d, e, f, g)")
    script += "    step_58 = 58\n"  # 61 lines
    assert [str(o) for o in offenders(script, "workflows/benchmarks/x.py")] == [
        "workflows/benchmarks/x.py:2 main: 7 parameters"
    ]
    public = script.replace("main", "train")
    assert [
        str(o) for o in offenders(public, "workflows/runs/driver.py", frozenset({"train"}))
    ] == ["workflows/runs/driver.py:2 train: 61 code lines"]


def test_the_public_entry_points_are_the_exported_functions_and_the_cli_commands():
    entry_points = public_entry_points()
    assert {"launch"} <= entry_points["workflows/jobs/launch.py"]
    assert {"predict", "PredictResult"} <= entry_points["workflows/prediction/batch_predict.py"]
    command = """
import click

@click.group()
def main(): ...

@main.command("run")
@click.option("--a")
def run(a, b, c, d, e, f, g): ...

def helper(a, b, c, d, e, f, g): ...
"""
    assert [str(o) for o in offenders(command, CLI)] == [f"{CLI}:11 helper: 7 parameters"]
