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
from pathlib import Path
from typing import Any

from distributed import Client
from distributed.diagnostics.plugin import UploadFile

logger = logging.getLogger(__name__)

_STRING_OPS = {"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE"}
_GET_OPS = {"BINGET", "LONG_BINGET", "GET"}
_COMPILED = (".so", ".pyd", ".dylib")


class CodeNotShippable(RuntimeError):
    """A module the workers lack that cannot be sent as source."""


def referenced_modules(pickled: bytes) -> set[str]:
    """The top-level modules that unpickling ``pickled`` imports."""
    modules: set[str] = set()
    recent: list[Any] = []  # what the pickle pushed last: a string, or None for anything else
    memo: dict[int, Any] = {}
    subimport = False
    for opcode, argument, _ in pickletools.genops(pickled):
        name = opcode.name
        if name in _STRING_OPS:
            if subimport:  # cloudpickle's subimport(name): a module a by-value function uses
                modules.add(argument)
                subimport = False
            recent.append(argument)
        elif name == "MEMOIZE":
            memo[len(memo)] = recent[-1] if recent else None
        elif name in ("PUT", "BINPUT", "LONG_BINPUT"):
            memo[int(argument)] = recent[-1] if recent else None
        elif name in _GET_OPS:
            recent.append(memo.get(int(argument)))
        elif name == "STACK_GLOBAL" and len(recent) >= 2:
            module, attribute = recent[-2], recent[-1]
            if isinstance(module, str):
                modules.add(module)
                subimport = module.startswith("cloudpickle") and attribute == "subimport"
            recent.append(None)
        elif name == "GLOBAL":
            module, _, attribute = str(argument).partition(" ")
            modules.add(module)
            subimport = module.startswith("cloudpickle") and attribute == "subimport"
            recent.append(None)
        elif name not in ("FRAME", "PROTO", "STOP"):
            recent.append(None)
        del recent[:-4]
    return {m.split(".")[0] for m in modules if m and m != "__main__"}


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
