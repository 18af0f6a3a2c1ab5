"""The documentation agrees with the code: README.md and every page of docs/.

How each kind of block is checked is written up in docs/development.md ("How the examples are
checked"). Whole programs run as pasted (the ``train()`` quick start here; the own-loop, sharing
and sweep examples in their own modules); every other block is checked against the code
without starting anything, so that a renamed option, a removed keyword argument or a renamed
config key fails here.
"""

import ast
import builtins
import importlib
import importlib.util
import inspect
import itertools
import json
import re
import shlex
import symtable
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
LANGUAGES = {"python", "toml", "bash", "text", "cron"}
WHOLE_PROGRAM = 'if __name__ == "__main__":'
QUICK_START = "make demo's config"
CHECKED = re.compile(r"^# checked by (tests/\w+\.py)::(\w+)")
# Each whole program, found by a line of its own, and the test that runs it as pasted.
PROGRAMS = {
    "def train_loop(ctx, steps, lr)": "tests/test_launch.py::"
    "test_the_readmes_own_loop_example_runs_twice_and_writes_nothing_beside_it",
    "one waits in the queue for the other": "tests/test_shared_cluster.py::"
    "test_the_readmes_sharing_example_runs_as_pasted",
    "def fit(ctx, params)": "tests/test_sweep.py::test_the_readmes_sweep_example_runs_as_pasted",
    QUICK_START: "tests/test_docs.py::test_the_train_quick_start_prints_the_demos_figures",
    "GLOBAL_BATCH = 64  # rows a step": "tests/test_elastic.py::"
    "test_the_elastic_guides_program_trains_on_any_world_of_its_range",
}


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # of the opening fence, from 1
    language: str
    text: str

    def __str__(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"


def fenced_blocks() -> list[Block]:
    """Every fenced block of every page, its indentation (a block in a list item) removed."""
    found = []
    for page in PAGES:
        lines = page.read_text().splitlines()
        i = 0
        while i < len(lines):
            opening = re.match(r"^(\s*)```(\S*)\s*$", lines[i])
            if not opening:
                i += 1
                continue
            indent, language = opening.groups()
            body = []
            j = i + 1
            while not re.match(rf"^{indent}```\s*$", lines[j]):
                body.append(lines[j].removeprefix(indent))
                j += 1
            found.append(Block(page, i + 1, language, "\n".join(body) + "\n"))
            i = j + 1
    return found


BLOCKS = fenced_blocks()


def _blocks(language: str) -> list[Block]:
    return [block for block in BLOCKS if block.language == language]


def _ids(blocks: list[Block]) -> list[str]:
    return [str(block) for block in blocks]


def _test_exists(test_id: str) -> bool:
    path, _, name = test_id.partition("::")
    return f"def {name}(" in (REPO / path).read_text()


# -- every block -------------------------------------------------------------------------------


def test_every_block_names_its_language():
    unnamed = [str(b) for b in BLOCKS if b.language not in LANGUAGES]
    assert not unnamed, f"fenced blocks need one of {sorted(LANGUAGES)}: {unnamed}"


@pytest.mark.parametrize("block", _blocks("text"), ids=_ids(_blocks("text")))
def test_every_shown_output_is_marked_illustrative_or_checked(block):
    first = block.text.splitlines()[0]
    checked = CHECKED.match(first)
    if checked:
        test_id = f"{checked.group(1)}::{checked.group(2)}"
        assert _test_exists(test_id), f"{block}: no test {test_id}"
    else:
        assert first.startswith("# illustrative: "), (
            f"{block}: start shown output with '# illustrative: <what varies>' or "
            "'# checked by tests/<file>.py::<test>'"
        )


# -- Python ------------------------------------------------------------------------------------


def test_every_whole_program_is_run_by_a_test():
    programs = [b for b in _blocks("python") if WHOLE_PROGRAM in b.text]
    assert programs
    for block in programs:
        if block.page.parent == GUIDES and block.page.name not in RUN_GUIDES:
            continue  # a guide's program that trains: checked whole, not run (below)
        runs = [test for marker, test in PROGRAMS.items() if marker in block.text]
        assert len(runs) == 1, f"{block}: a whole program no test runs; add it to PROGRAMS"
        assert _test_exists(runs[0]), f"{block}: no test {runs[0]}"


# A guide's Python block is a whole program, that runs as pasted, or starts with this line and
# adds to the nearest whole program above it on its page (pasted under that one's main guard).
FRAGMENT = "# a fragment of the program above"
GUIDES = REPO / "docs" / "guides"
# Guides whose whole programs a test runs (PROGRAMS); the others' programs start a cluster and
# train for tens of seconds each, more than the suite's budget allows: each is checked whole
# (every name bound, the project's names and keywords as the code has them). The elastic
# guide's program runs on the suite's cluster (test_elastic.py), not a cluster of its own.
RUN_GUIDES = {"own-loop.md", "sharing.md", "sweeps.md", "elastic.md"}
GUIDE_BLOCKS = [b for b in _blocks("python") if b.page.parent == GUIDES]


def unbound_names(source: str, bound: set[str] = frozenset()) -> set[str]:
    """The names ``source`` reads at module level, or as globals of its functions and classes,
    that neither it, ``bound`` nor Python's builtins define: what a paste of it alone raises
    NameError for."""
    top = symtable.symtable(source, "<block>", "exec")
    read: set[str] = set()
    tables = [top]
    while tables:
        table = tables.pop()
        read |= {
            symbol.get_name()
            for symbol in table.get_symbols()
            if symbol.is_referenced() and (table is top or symbol.is_global())
        }
        tables += table.get_children()
    return read - bound_names(source) - set(bound) - set(dir(builtins))


def _program_above(block: Block) -> Block | None:
    above = [
        b
        for b in GUIDE_BLOCKS
        if b.page == block.page and b.line < block.line and not b.text.startswith(FRAGMENT)
    ]
    return above[-1] if above else None


@pytest.mark.parametrize("block", GUIDE_BLOCKS, ids=_ids(GUIDE_BLOCKS))
def test_a_guides_block_runs_as_pasted_or_is_a_fragment_of_the_program_above(block):
    # As pasted, five guides' blocks raised NameError (cluster, config, build_model, ...).
    compile(block.text, str(block), "exec")
    if not block.text.startswith(FRAGMENT):
        missing = unbound_names(block.text)
        assert not missing, (
            f"{block}: {sorted(missing)} undefined as pasted; make it a whole program, or start "
            f"it with {FRAGMENT!r} under the program that defines them"
        )
        return
    program = _program_above(block)
    assert program is not None, f"{block}: a fragment with no program above it on its page"
    missing = unbound_names(block.text, bound_names(program.text))
    assert not missing, f"{block}: {sorted(missing)} defined neither here nor in {program}"


def bound_names(source: str) -> set[str]:
    """The names a whole program binds at module level (its main guard's included)."""
    top = symtable.symtable(source, "<program>", "exec")
    return {s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported()}


@pytest.mark.parametrize("block", _blocks("python"), ids=_ids(_blocks("python")))
def test_python_blocks_agree_with_the_code(block):
    assert check_python(block.text) == [], str(block)


def check_python(source: str) -> list[str]:
    """What in a Python fragment disagrees with the code: names it imports from the project
    that do not exist, keyword arguments the functions it calls do not take, and config
    values (literal ``load_config``, ``settings=``, ``config=`` arguments) that do not load."""
    tree = ast.parse(source)
    problems: list[str] = []
    imported: dict[str, Any] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in PROJECT:
            module = importlib.import_module(node.module)
            for alias in node.names:
                if not hasattr(module, alias.name):
                    problems.append(f"{node.module} has no {alias.name}")
                else:
                    imported[alias.asname or alias.name] = getattr(module, alias.name)
    functions = {n.name: n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    for node in ast.walk(tree):
        on_ctx = isinstance(node, ast.Attribute) and _is_ctx(node.value)
        if on_ctx and node.attr not in _context_names():
            problems.append(f"ctx.{node.attr}: RankContext has no such attribute")
        if not isinstance(node, ast.Call):
            continue
        if isinstance(node.func, ast.Name) and node.func.id in imported:
            problems += _check_call(imported[node.func.id], node, functions)
        elif isinstance(node.func, ast.Attribute) and _is_ctx(node.func.value):
            method = getattr(_rank_context(), node.func.attr, None)
            if callable(method):
                problems += _check_call(method, node, functions)
    return problems


PROJECT = ("workflows", "workers")


def _is_ctx(node: ast.AST) -> bool:
    return isinstance(node, ast.Name) and node.id == "ctx"


def _rank_context() -> type:
    from workers.rank_context import RankContext

    return RankContext


def _context_names() -> set[str]:
    """RankContext's public attributes: its class's, and those ``__init__`` sets."""
    cls = _rank_context()
    init = ast.parse(inspect.getsource(cls.__init__).strip().replace("\n    ", "\n"))
    assigned = {
        target.attr
        for node in ast.walk(init)
        if isinstance(node, ast.Assign | ast.AnnAssign)
        for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
        if isinstance(target, ast.Attribute)
    }
    return {name for name in {*dir(cls), *assigned} if not name.startswith("_")}


def _parameters(fn: Any, *, skip: int = 0) -> set[str]:
    """The keyword-passable parameters of ``fn`` (a function defined in the block, as its
    ``ast.FunctionDef``, or a live callable), after its first ``skip``."""
    if isinstance(fn, ast.FunctionDef):
        args = fn.args
        return {a.arg for a in [*args.posonlyargs, *args.args][skip:] + args.kwonlyargs}
    kinds = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    parameters = list(inspect.signature(fn).parameters.values())[skip:]
    return {p.name for p in parameters if p.kind not in kinds}


def _check_call(fn: Any, call: ast.Call, functions: dict[str, ast.FunctionDef]) -> list[str]:
    import workflows
    from workflows.cluster.training_cluster import ClusterConfig
    from workflows.jobs.launcher import LaunchConfig
    from workflows.prediction.batch_predict import PredictConfig
    from workflows.runs.config import ConfigError, load_config

    name = getattr(fn, "__qualname__", repr(fn))
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return []
    allowed = _parameters(fn)
    open_ended = any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values())
    # Where the keywords a function does not name go: launch and sweep pass them on to the
    # user's function (and sweep to launch), start_cluster to ClusterConfig.
    user_fn = call.args[0] if call.args and isinstance(call.args[0], ast.Name) else None
    user_fn = functions.get(user_fn.id) if user_fn is not None else None
    if fn is workflows.launch or fn is workflows.sweep:
        if fn is workflows.sweep:
            allowed |= _parameters(workflows.launch)
        if user_fn is None:
            open_ended = True  # the function is not in the block: its parameters are unknown
        else:
            allowed |= _parameters(user_fn, skip=2 if fn is workflows.sweep else 1)
            open_ended = False
    elif fn is workflows.start_cluster:
        allowed |= set(ClusterConfig.model_fields)
        open_ended = False
    problems = [
        f"{name}() takes no keyword argument {kw.arg!r}"
        for kw in call.keywords
        if kw.arg is not None and kw.arg not in allowed and not open_ended
    ]
    # Literal config values load, starting nothing.
    literal = _literals(call)
    try:
        if fn is workflows.load_config and literal is not None:
            args, _ = literal
            source = args[0]
            if isinstance(source, str) and not Path(source).is_absolute():
                source = REPO / source
            load_config(source, *args[1:])
        keywords = literal[1] if literal is not None else _literal_keywords(call)
        if fn is workflows.predict and isinstance(keywords.get("settings"), dict):
            PredictConfig.from_dict(keywords["settings"])
        if fn in (workflows.launch, workflows.sweep) and isinstance(keywords.get("config"), dict):
            LaunchConfig.model_validate(keywords["config"])
        if fn is workflows.start_cluster:
            ClusterConfig.model_validate(keywords)
    except (ConfigError, ValueError) as error:
        problems.append(f"{name}(): {_without_missing_files(str(error))}")
    return [p for p in problems if not p.endswith("(): ")]


def _literals(call: ast.Call) -> tuple[list[Any], dict[str, Any]] | None:
    """The call's arguments, when every one is a literal."""
    try:
        args = [ast.literal_eval(a) for a in call.args]
        keywords = {kw.arg: ast.literal_eval(kw.value) for kw in call.keywords if kw.arg}
    except ValueError:
        return None
    return args, keywords


def _literal_keywords(call: ast.Call) -> dict[str, Any]:
    found = {}
    for kw in call.keywords:
        try:
            found[kw.arg] = ast.literal_eval(kw.value)
        except ValueError:
            continue
    return found


def _without_missing_files(message: str) -> str:
    """A config error less the files it names that are not on this machine (the docs name a
    user's certificate files): the keys and the types are still checked."""
    return "; ".join(p for p in message.split("; ") if not p.endswith("no such file"))


# -- TOML and shell ----------------------------------------------------------------------------


def load_toml(text: str) -> None:
    from workflows.prediction.batch_predict import load_predict_config
    from workflows.runs.config import ConfigError

    try:
        load_predict_config(tomllib.loads(text))
    except ConfigError as error:
        left = _without_missing_files(str(error))
        if left:
            raise ConfigError(left) from None


@pytest.mark.parametrize("block", _blocks("toml"), ids=_ids(_blocks("toml")))
def test_toml_blocks_load(block):
    load_toml(block.text)


def dask_train_commands(text: str) -> list[list[str]]:
    """The arguments of every ``dask-train`` command in shell lines (a ``$ `` prompt allowed),
    continuation lines joined, comments and redirections left out."""
    commands = []
    for line in text.replace("\\\n", " ").splitlines():
        words = shlex.split(line.removeprefix("$ "), comments=True)
        for i, word in enumerate(words):
            starts = i == 0 or words[i - 1] in ("&&", "||", ";", "|", "then", "else")
            if starts and (word == "dask-train" or word.endswith("/dask-train")):
                args = []
                for arg in words[i + 1 :]:
                    if arg in ("|", "&&", ";", "&", ">", ">>", "2>&1"):
                        break
                    args.append(arg)
                commands.append(args)
    return commands


def check_command(args: list[str]) -> list[str]:
    """Parse ``dask-train ARGS`` with the CLI's own click parser (nothing runs), then load its
    CONFIG with its ``--set`` overrides."""
    import click

    from workflows.cli import main
    from workflows.prediction.batch_predict import load_predict_config
    from workflows.runs.config import ConfigError

    options = [a for a in args if a in ("-v", "--verbose")]
    rest = args[len(options) :]
    if not rest or rest[0] not in main.commands:
        return [f"dask-train: no command in {args}"]
    command = main.commands[rest[0]]
    try:
        with command.make_context(rest[0], list(rest[1:])) as context:
            params = dict(context.params)
    except click.ClickException as error:
        return [f"dask-train {' '.join(args)}: {error.format_message()}"]
    config = params.get("config")
    if config is None:
        return []
    if not (REPO / config).is_file():
        return [f"dask-train {rest[0]}: {config} is not a file of this repository"]
    try:
        load_predict_config(REPO / config, params.get("overrides", ()))
    except ConfigError as error:
        left = _without_missing_files(str(error))
        if left:
            return [f"dask-train {' '.join(args)}: {left}"]
    return []


SHELL = [b for b in BLOCKS if b.language == "bash" or (b.language == "text" and "$ dask" in b.text)]


@pytest.mark.parametrize("block", SHELL, ids=_ids(SHELL))
def test_dask_train_commands_parse_and_their_configs_load(block):
    text = block.text
    if block.language == "text":
        text = "\n".join(line for line in text.splitlines() if line.startswith("$ "))
    problems = [p for args in dask_train_commands(text) for p in check_command(args)]
    assert problems == [], str(block)


def test_the_checks_fail_on_drift():
    # A renamed keyword, a removed ctx method's argument, an unknown config key, an option the
    # CLI lacks: each is reported.
    fragment = """
from workflows import launch, load_config, start_cluster


def fn(ctx, lr):
    ctx.save({}, steps=3)
    return ctx.rnak


config = load_config("workflows/configs/digits_ddp.toml", ["training.epohcs=2"])
launch(fn, cluster=None, checkpoint_directory="x", lr=0.1, momentum=0.9)
start_cluster(n_worker=2)
"""
    problems = "\n".join(check_python(fragment))
    for wrong in ("'steps'", "rnak", "epohcs", "'checkpoint_directory'", "'momentum'", "n_worker"):
        assert wrong in problems, (wrong, problems)
    assert "'lr'" not in problems
    with pytest.raises(ValueError, match=r"training\.epohcs"):
        load_toml("[training]\nepohcs = 2\n")
    assert check_command(["run", "workflows/configs/digits_ddp.toml", "--sett", "x=1"])
    assert check_command(["run", "workflows/configs/digits_ddp.toml", "--set", "training.lrr=1"])
    assert check_command(["launch", "--world-size", "2", "train.py"]) == []


# -- where the examples write ------------------------------------------------------------------

# What names a place an example writes to: dask-train's options (click's names), config keys,
# and keyword arguments of the Python API. Each such place must be one git ignores (runs/,
# data/), so that running every documented example leaves `git status` clean.
WRITING_OPTIONS = ("output", "storage")
WRITING_KEYS = ("data.store", "checkpoint.directory", "tracking.tensorboard", "tracking.mlflow_uri")
WRITING_KEYWORDS = ("output", "storage", "checkpoint_dir")


def _flat(values: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat = {}
    for name, value in values.items():
        if isinstance(value, dict):
            flat |= _flat(value, f"{prefix}{name}.")
        else:
            flat[f"{prefix}{name}"] = value
    return flat


def _override_values(items: Any) -> list[str]:
    """The values of ``key=value`` overrides (``--set``, ``load_config``'s list) that name a
    place written to."""
    found = []
    for item in items or ():
        key, _, value = str(item).partition("=")
        if key.strip() in WRITING_KEYS:
            found.append(value.strip().strip("'\""))
    return found


def written_places(block: Block) -> list[str]:
    """Where the block's example writes, as written there (paths, ``sqlite:///`` URLs)."""
    import click

    from workflows.cli import main

    places: list[str] = []
    if block.language in ("bash", "text", "cron"):
        text = block.text
        if block.language == "text":
            text = "\n".join(line for line in text.splitlines() if line.startswith("$ "))
        for args in dask_train_commands(text):
            rest = [a for a in args if a not in ("-v", "--verbose")]
            if not rest or rest[0] not in main.commands:
                continue
            try:
                with main.commands[rest[0]].make_context(rest[0], list(rest[1:])) as context:
                    params = dict(context.params)
            except click.ClickException:
                continue  # test_dask_train_commands_parse_and_their_configs_load says why
            places += [str(params[o]) for o in WRITING_OPTIONS if params.get(o) is not None]
            places += _override_values(params.get("overrides"))
        for line in text.replace("\\\n", " ").splitlines():
            words = shlex.split(line.removeprefix("$ "), comments=True)
            places += [b for a, b in itertools.pairwise(words) if a in (">", ">>")]
    elif block.language == "python":
        for node in ast.walk(ast.parse(block.text)):
            if not isinstance(node, ast.Call):
                continue
            for keyword in node.keywords:
                if keyword.arg in WRITING_KEYWORDS and isinstance(keyword.value, ast.Constant):
                    places.append(str(keyword.value.value))
            literal = _literals(node)
            for arg in literal[0] if literal else []:
                if isinstance(arg, dict):
                    flat = _flat(arg)
                    places += [str(flat[key]) for key in WRITING_KEYS if key in flat]
                elif isinstance(arg, list):
                    places += _override_values(arg)
    elif block.language == "toml":
        flat = _flat(tomllib.loads(block.text))
        places += [str(flat[key]) for key in WRITING_KEYS if key in flat]
    return places


def _in_the_checkout(place: str) -> str | None:
    """The checkout-relative path a place names; None for one elsewhere (absolute, a URL, the
    home folder) or a placeholder (``<run>``, ``$(date)``, ``DIR``)."""
    path = place.removeprefix("sqlite:///")
    if "://" in path or not path or path.startswith(("/", "~")):
        return None
    if any(mark in path for mark in "<>${}") or path.split("/")[0].isupper():
        return None
    return path


def not_ignored(paths: list[str]) -> list[str]:
    """Those of ``paths`` that git would show as new files in this checkout."""
    import subprocess

    if not paths:
        return []
    done = subprocess.run(
        ["git", "check-ignore", "--no-index", "--stdin"],
        cwd=REPO,
        input="\n".join(paths) + "\n",
        capture_output=True,
        text=True,
        timeout=60,
    )
    if "not a git repository" in done.stderr:
        pytest.skip("not a git checkout: nothing to compare with")
    assert done.returncode in (0, 1), done.stderr  # 1: none of them is ignored
    ignored = set(done.stdout.splitlines())
    return [path for path in paths if path not in ignored]


def test_every_example_writes_where_git_ignores_it():
    written = {
        (str(block), path)
        for block in BLOCKS
        for place in written_places(block)
        if (path := _in_the_checkout(place)) is not None
    }
    # The check sees what the examples write: the inference guide's output, the tracking
    # guide's database, the sweeps guide's study.
    paths = {path for _, path in written}
    assert {"runs/predictions/digits-val", "runs/mlflow.db", "runs/sweep.db"} <= paths
    stray = not_ignored(sorted(paths))
    assert [(where, path) for where, path in sorted(written) if path in stray] == []
    # And it would see one that is not ignored.
    drifted = "dask-train predict c.toml --model m --input i --output p/v\n"
    places = written_places(Block(REPO / "docs" / "x.md", 1, "bash", drifted))
    assert not_ignored([_in_the_checkout(place) for place in places]) == ["p/v"]


# -- how the commands are written -----------------------------------------------------------


def test_the_pages_write_dask_train_one_way_once_getting_started_activates_the_venv():
    # The docs write `dask-train` bare; getting-started activates the virtualenv before its
    # first one. (Cron has no virtualenv: its line names .venv/bin/dask-train.)
    written_with_a_path = [
        str(block)
        for block in SHELL
        if block.page != REPO / "README.md"
        and any(
            re.search(r"(?:^|\s)\S*/dask-train(?:\s|$)", line) for line in block.text.splitlines()
        )
    ]
    assert written_with_a_path == []
    page = REPO / "docs" / "getting-started.md"
    commands = "".join(b.text for b in SHELL if b.page == page)
    first = commands.index("dask-train ")
    assert "source .venv/bin/activate" in commands[:first]


def test_a_missing_cifar10_folder_is_one_line_naming_the_documented_download(tmp_path):
    from tests.commands import run_dask_train

    page = (REPO / "docs" / "getting-started.md").read_text()
    (fetch,) = re.findall(r'^python -c "(from torchvision\.datasets import .*)"$', page, re.M)
    assert "CIFAR10('data/cifar10', download=True)" in fetch
    root = tmp_path / "cifar"
    done = run_dask_train(
        "preprocess",
        str(REPO / "workflows/configs/cifar10_ddp.toml"),
        "--set",
        f"data.root='{root}'",
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
    assert f"{root}/cifar-10-batches-py does not exist" in done.stderr
    assert fetch.replace("data/cifar10", str(root)) in done.stderr


# -- `dask-train plan`'s output, shown -----------------------------------------------------

PLAN_SHOWN = "tests/test_docs.py::test_the_plan_shown_is_what_its_command_prints"


def plan_figures(output: str) -> list[tuple[str, ...]]:
    """The lines of ``dask-train plan``'s output that do not depend on the machine's speed,
    as words: the times masked, the cut and its stages (chosen by the times) and the device's
    memory left out."""
    figures = []
    for line in output.splitlines():
        if line.startswith(("#", "Split into ", "  stage ")):
            continue
        line = re.sub(r"[\d,]+\.\d+ ms", "<ms>", line)
        line = re.sub(r"device [\d,]+ MiB", "device <MiB>", line)
        words = line.split()
        if re.fullmatch(r"  \S+ +[\d.]+ +[\d.]+ +[\d.]+", line):  # a layer: its time masked
            words[1] = "<ms>"
        figures.append(tuple(words))
    return figures


def test_the_plan_shown_is_what_its_command_prints(cluster):
    from tests.commands import run_dask_train

    page = REPO / "docs" / "guides" / "parallelism.md"
    marked = f"# checked by {PLAN_SHOWN}"
    (shown,) = [b for b in BLOCKS if b.page == page and b.text.startswith(marked)]
    commands = [a for b in SHELL if b.page == page for a in dask_train_commands(b.text)]
    (command,) = [args for args in commands if args[0] == "plan"]
    config = REPO / command[1]  # from the checkout's root, as the page runs it
    scheduler = ("--scheduler", cluster.client.scheduler.address)
    done = run_dask_train(command[0], str(config), *command[2:], *scheduler, timeout=240)
    assert done.returncode == 0, done.stderr
    if "Per-layer profile on cpu," not in done.stdout:
        pytest.skip("the page shows a CPU profile; these workers profile on another device")
    expected = plan_figures(shown.text)
    # Every line but the cut's: the twelve layers' sizes, the memory rows, the recommendation.
    assert len(expected) == 24 and expected[-1][:2] == ("Recommendation:", "ddp:")
    assert plan_figures(done.stdout) == expected


# -- links, references, pages ------------------------------------------------------------------


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def test_the_readmes_links_lead_somewhere():
    readme = (REPO / "README.md").read_text()
    anchors = {_slug(h) for h in re.findall(r"^#+ (.*)$", readme, flags=re.M)}
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", readme):
        if target.startswith(("http://", "https://")):
            continue
        path, _, anchor = target.partition("#")
        if (REPO / path).exists() if path else anchor in anchors:
            continue
        broken.append(target)
    assert broken == []


def test_the_readme_is_short_and_its_first_screen_leads_to_your_own_loop():
    readme = (REPO / "README.md").read_text().splitlines()
    assert len(readme) <= 200
    first_screen = "\n".join(readme[:12])
    assert "docs/guides/own-loop.md" in first_screen
    assert "#quick-start-your-own-loop-launch" in first_screen


def _configuration_hook():
    spec = importlib.util.spec_from_file_location(
        "configuration_hook", REPO / "docs" / "hooks" / "configuration.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _leaf_keys(values: dict[str, Any], prefix: str = "") -> set[str]:
    """The dotted keys of a dumped config: a non-empty dict is a section, anything else a key."""
    keys = set()
    for name, value in values.items():
        if isinstance(value, dict) and value:
            keys |= _leaf_keys(value, f"{prefix}{name}.")
        else:
            keys.add(f"{prefix}{name}")
    return keys


def test_the_configuration_page_lists_every_key_with_a_description():
    from workflows.prediction.batch_predict import PredictConfig
    from workflows.runs.config import RunConfig

    hook = _configuration_hook()
    page = (REPO / "docs" / "reference" / "configuration.md").read_text()
    rendered = hook.on_page_markdown(page, page=None)
    assert hook.MARKER not in rendered
    rows = re.findall(r"^\| `([\w.]+)` \|(.*)\|$", rendered, flags=re.M)
    listed = {key for key, _ in rows}
    expected = _leaf_keys(RunConfig().model_dump()) | {
        f"predict.{key}" for key in PredictConfig().model_dump()
    }
    assert listed == expected
    undescribed = [key for key, cells in rows if not cells.split("|")[-1].strip()]
    assert undescribed == []


def _resolved(path: str) -> Any:
    """The object a dotted path names: its longest importable module, then attributes."""
    parts = path.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            found = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attribute in parts[cut:]:
            found = getattr(found, attribute)
        return found
    raise ModuleNotFoundError(path)


def _api_reference() -> dict[str, list[str]]:
    """docs/reference/api.md's ``:::`` entries: each path and the members its options list."""
    page = (REPO / "docs" / "reference" / "api.md").read_text()
    entries = re.findall(r"^::: ([\w.]+)\n((?: {4}.*\n)*)", page + "\n", flags=re.M)
    return {path: re.findall(r"^ {8}- (\w+)$", options, flags=re.M) for path, options in entries}


def test_the_api_reference_lists_the_public_names_and_nothing_else():
    # The public API is workflows.__all__ and the reference renders it: a name in one and not
    # the other is either undocumented or documented but internal (may change unannounced).
    import workflows

    public = {name: getattr(workflows, name) for name in workflows.__all__}
    documented = set()
    for path, members in _api_reference().items():
        where = f"docs/reference/api.md: ::: {path}"
        owner_path, _, name = path.rpartition(".")
        found = _resolved(path)
        owner = _resolved(owner_path)
        is_public_name = public.get(name) is found
        is_public_member = inspect.isclass(owner) and owner in public.values()
        assert is_public_name or is_public_member, f"{where}: not in workflows.__all__"
        if is_public_name:
            documented.add(name)
        for member in members:
            assert not member.startswith("_"), f"{where}: lists the private {member}"
            assert hasattr(found, member), f"{where}: lists {member}, which it does not have"
    undocumented = sorted(set(public) - documented)
    assert undocumented == [], f"docs/reference/api.md: no ::: entry for {undocumented}"


def _documented_arguments(doc: str) -> set[str]:
    section = re.search(r"^Args:\n((?: {4}.*\n?|\n)+)", doc, flags=re.M)
    if not section:
        return set()
    return set(re.findall(r"^ {4}(\*{0,2}\w+)(?: \([^)]*\))?:", section.group(1), flags=re.M))


def _public_callables() -> list[tuple[str, Any]]:
    import workflows

    found = [
        (name, getattr(workflows, name))
        for name in workflows.__all__
        if inspect.isfunction(getattr(workflows, name))
    ]
    context = _rank_context()
    for name, member in vars(context).items():
        if not name.startswith("_") and inspect.isfunction(member):
            found.append((f"RankContext.{name}", member))
    return found


@pytest.mark.parametrize("name, fn", _public_callables(), ids=[n for n, _ in _public_callables()])
def test_public_functions_document_every_parameter_and_the_return_value(name, fn):
    doc = inspect.getdoc(fn) or ""
    signature = inspect.signature(fn)
    expected = set()
    for parameter in signature.parameters.values():
        if parameter.name == "self":
            continue
        stars = {parameter.VAR_POSITIONAL: "*", parameter.VAR_KEYWORD: "**"}
        expected.add(stars.get(parameter.kind, "") + parameter.name)
    assert _documented_arguments(doc) == expected, name
    returns = signature.return_annotation
    if returns not in (None, "None", inspect.Signature.empty):
        assert "\nReturns:\n" in f"\n{doc}", f"{name}: no Returns section"


def test_the_notebook_page_lists_the_notebooks_sections_in_order():
    notebook = json.loads((REPO / "notebooks" / "train_on_dask.ipynb").read_text())
    headings = [
        line.removeprefix("## ").strip()
        for cell in notebook["cells"]
        if cell["cell_type"] == "markdown"
        for line in "".join(cell["source"]).splitlines()
        if line.startswith("## ")
    ]
    page = (REPO / "docs" / "guides" / "notebook.md").read_text()
    listed = re.findall(r"^\d+\. \*\*(.+?)\*\*", page, flags=re.M)
    assert listed == headings


# -- the train() quick start, run as pasted ----------------------------------------------------

EPOCH = re.compile(r"^(Epoch \[\d+/\d+\], .*), \d+ samples/s$")
FIGURE = re.compile(r"(Loss|Acc|Val Loss|Val Acc): (\d+\.\d+)")
# What CPUs' kernel paths agree to on the demo (docs/getting-started.md, under its output): the
# losses to the third decimal, the accuracies to one validation image of 359.
AGREED = {"Loss": 2e-3, "Val Loss": 2e-3, "Acc": 3e-3, "Val Acc": 3e-3}


def _same_figures(shown: list[str], printed: list[str]) -> bool:
    """The epoch lines shown and printed hold the same figures, within what kernel paths agree
    to (AGREED)."""

    def figures(lines: list[str]) -> list[list[tuple[str, float]]]:
        return [[(k, float(v)) for k, v in FIGURE.findall(line)] for line in lines]

    return len(shown) == len(printed) and all(
        [k for k, _ in a] == [k for k, _ in b]
        and all(abs(x - y) <= AGREED[k] for (k, x), (_, y) in zip(a, b, strict=True))
        for a, b in zip(figures(shown), figures(printed), strict=True)
    )


@pytest.mark.slow
def test_the_train_quick_start_prints_the_demos_figures(tmp_path):
    from tests.test_cluster import _run_in_own_session
    from tests.test_launch import _readme_block

    # As pasted, from a checkout's root: its relative config path, its store under data/.
    script = tmp_path / "quick.py"
    script.write_text(_readme_block(QUICK_START))
    configs = tmp_path / "workflows" / "configs"
    configs.mkdir(parents=True)
    (configs / "digits_ddp.toml").write_text(
        (REPO / "workflows/configs/digits_ddp.toml").read_text()
    )
    done = _run_in_own_session([sys.executable, str(script)], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    printed = [m.group(1) for m in map(EPOCH.match, done.stdout.splitlines()) if m]
    final_accuracy = float(done.stdout.splitlines()[-1].split()[0])
    assert len(printed) == 5, done.stdout
    # Every demo output shown, epoch for epoch, less the throughput; and its closing line.
    shown = [
        b for b in _blocks("text") if b.text.startswith(f"# checked by {PROGRAMS[QUICK_START]}")
    ]
    assert shown
    for block in shown:
        lines = block.text.splitlines()
        epochs = [m.group(1) for m in map(EPOCH.match, lines) if m]
        assert _same_figures(epochs, printed), f"{block}\nprinted:\n" + "\n".join(printed)
        (closing,) = [line for line in lines if line.startswith("done: ")]
        shown_accuracy = float(re.search(r"val accuracy (\d\.\d+),", closing).group(1))
        assert abs(shown_accuracy - final_accuracy) <= AGREED["Val Acc"], str(block)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "quick.py", "workflows"]
