"""The user's code on workers that cannot import it.

A training function, a model or any object handed to ``launch`` travels pickled; a function or
class defined in a notebook or a script's ``__main__`` travels by value, but one from a module
travels by reference, and a worker that cannot import that module cannot run it. Before a
launch, the top-level modules the pickle refers to are looked up on the workers; each one they
lack is uploaded with distributed's ``UploadFile`` (a module file as it is, a package as a zip
archive, which workers put on ``sys.path``). Workers that join later (a restarted worker) get
them too. Code that cannot travel as source (a compiled extension) is refused in one line.
"""

import importlib.util
import logging
import pickletools
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from distributed import Client
from distributed.diagnostics.plugin import UploadFile

logger = logging.getLogger(__name__)

_COMPILED = (".so", ".pyd", ".dylib")


class CodeNotShippable(RuntimeError):
    """A module the workers lack that cannot be sent as source."""


def referenced_modules(pickled: bytes) -> set[str]:
    """The top-level modules that unpickling ``pickled`` imports: those of its globals, and
    those a by-value function refers to (cloudpickle's ``subimport(name)``).

    The pickle's stack is followed symbolically, op by op (``pickletools`` gives each op's
    stack effect), so a memoized string is known for what it is wherever it is reused; nothing
    is loaded or run.
    """
    modules: set[str] = set()
    stack: list[Any] = []
    memo: dict[Any, Any] = {}
    for opcode, argument, _ in pickletools.genops(pickled):
        consumed = _pop(stack, opcode.stack_before)
        pushed: list[Any] = [None] * len(opcode.stack_after)
        name = opcode.name
        if name in _STRINGS:
            pushed = [argument]
        elif name in _MEMO_GETS:
            pushed = [memo.get(argument)]
        elif name == "MEMOIZE" or name in _MEMO_PUTS:  # the top stays where it is
            memo[len(memo) if name == "MEMOIZE" else argument] = consumed[0]
            pushed = consumed
        elif name == "MARK":
            pushed = [_MARK]
        elif name in ("GLOBAL", "STACK_GLOBAL"):
            module, _, attribute = (
                str(argument).partition(" ") if name == "GLOBAL" else (consumed[0], "", consumed[1])
            )
            if isinstance(module, str):
                modules.add(module)
            pushed = [_Global(module, attribute)]
        elif name.startswith("TUPLE") or name == "EMPTY_TUPLE":
            pushed = [tuple(consumed)]
        elif name == "REDUCE":
            function, arguments = consumed
            if (
                _is_subimport(function)
                and isinstance(arguments, tuple)
                and arguments
                and isinstance(arguments[0], str)
            ):
                modules.add(arguments[0])
        stack.extend(pushed)
    return {m.split(".")[0] for m in modules if m and m != "__main__"}


@dataclass(frozen=True)
class _Global:
    module: Any
    attribute: Any


_MARK = object()
_STRINGS = {"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE"}
_MEMO_GETS = {"BINGET", "LONG_BINGET", "GET"}
_MEMO_PUTS = {"PUT", "BINPUT", "LONG_BINPUT"}


def _pop(stack: list[Any], before: list[Any]) -> list[Any]:
    """Take an op's operands off ``stack``: those above the topmost mark where the op reads
    to the mark (TUPLE, APPENDS), and the fixed ones, in push order."""
    taken: list[Any] = []
    if pickletools.markobject in before:
        mark = max((i for i, item in enumerate(stack) if item is _MARK), default=-1)
        taken = stack[mark + 1 :]
        del stack[max(mark, 0) :]
        before = before[: before.index(pickletools.markobject)]
    fixed = len(before)
    below = stack[-fixed:] if fixed else []
    del stack[len(stack) - len(below) :]
    below = [None] * (fixed - len(below)) + below
    return below + taken


def _is_subimport(function: Any) -> bool:
    return (
        isinstance(function, _Global)
        and isinstance(function.module, str)
        and function.module.startswith("cloudpickle")
        and function.attribute == "subimport"
    )


def _unimportable(names: list[str]) -> list[str]:
    return [name for name in names if importlib.util.find_spec(name) is None]


def ship_code(client: Client, pickled: bytes) -> list[str]:
    """Upload the modules that unpickling ``pickled`` needs and some worker lacks; returns
    their names."""
    return ship_modules(client, referenced_modules(pickled))


def ship_modules(client: Client, names: set[str]) -> list[str]:
    """Upload the top-level modules ``names`` that some worker lacks; returns their names."""
    candidates = sorted(
        name
        for name in names
        if name not in sys.stdlib_module_names and name not in sys.builtin_module_names
    )
    if not candidates:
        return []
    answers = client.run(_unimportable, candidates)
    missing = sorted({name for names in answers.values() for name in names})
    for name in missing:
        path = _source_of(name)
        plugin_name = f"dask-train-code-{name}"
        if path.is_dir():
            with tempfile.TemporaryDirectory() as folder:
                archive = Path(folder) / f"{name}.zip"
                _zip_package(path, archive)
                client.register_plugin(UploadFile(str(archive)), name=plugin_name)
        else:
            client.register_plugin(UploadFile(str(path)), name=plugin_name)
        logger.info("shipped %s (%s) to the workers", name, path)
    return missing


def _source_of(name: str) -> Path:
    """The file or package folder of module ``name`` on this machine, if it can travel."""
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin in (None, "built-in", "frozen"):
        raise CodeNotShippable(
            f"module {name!r}: the workers cannot import it and neither can this process; "
            "install it on the workers"
        )
    if spec.submodule_search_locations:
        folder = Path(next(iter(spec.submodule_search_locations)))
        compiled = next((p for p in folder.rglob("*") if p.suffix in _COMPILED), None)
        if compiled is not None:
            raise CodeNotShippable(
                f"module {name!r}: the workers cannot import it, and it holds a compiled "
                f"extension ({compiled}) that cannot be shipped; install it on the workers"
            )
        return folder
    origin = Path(spec.origin)
    if origin.suffix != ".py":
        raise CodeNotShippable(
            f"module {name!r}: the workers cannot import it, and it is a compiled extension "
            f"({origin}) that cannot be shipped; install it on the workers"
        )
    return origin


def _zip_package(folder: Path, archive: Path) -> None:
    with zipfile.ZipFile(archive, "w", zipfile.ZIP_DEFLATED) as bundle:
        for path in sorted(folder.rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts:
                bundle.write(path, path.relative_to(folder.parent))
