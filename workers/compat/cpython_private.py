"""The standard library's private APIs that dask-train relies on, checked at import.

Run with CPython 3.11, 3.12 and 3.13 (``requires-python``; CI runs the suite's subset on the
two later ones, ``make test-python``). Where one is missing, importing this module fails with
one line: ``ImportError: dask-train needs <name> (CPython 3.11, 3.12 and 3.13 have it; this is
CPython X.Y.Z)``.

- The fork server's preload list and pid (``multiprocessing.forkserver``): local workers are
  forked from a server that imported torch (``workflows/cluster/training_cluster.py``); the list is
  extended, not replaced, and the server is stopped at exit. The module offers a setter only.
- ``pickle._Unpickler``, the pure-Python unpickler, whose opcode table and ``load_*`` methods
  the checkpoint metadata reader narrows (``workers/checkpoint.py``): the C unpickler has no
  such table.
"""

import multiprocessing.forkserver
import pickle
import platform

RUN_WITH = "CPython 3.11, 3.12 and 3.13 have it"


def _needed(owner: object, name: str, *attributes: str) -> None:
    missing = [a for a in attributes if not hasattr(owner, a)]
    if missing:
        raise ImportError(
            f"dask-train needs {name}.{missing[0]} ({RUN_WITH}; this is "
            f"{platform.python_implementation()} {platform.python_version()})"
        )


_needed(multiprocessing.forkserver, "multiprocessing.forkserver", "_forkserver")
_needed(
    multiprocessing.forkserver._forkserver,
    "multiprocessing.forkserver._forkserver",
    "_preload_modules",
    "_forkserver_pid",
)
_needed(pickle, "pickle", "_Unpickler")
_needed(
    pickle._Unpickler,  # type: ignore[attr-defined]
    "pickle._Unpickler",
    "dispatch",
    "load_reduce",
    "load_newobj",
    "load_build",
)


def forkserver_preload() -> list[str]:
    """The modules the fork server will import when it starts (``set_forkserver_preload``'s
    last list; ``["__main__"]`` unless set)."""
    return list(multiprocessing.forkserver._forkserver._preload_modules)


def forkserver_pid() -> int | None:
    """The fork server's pid; None when this process has not started one."""
    return multiprocessing.forkserver._forkserver._forkserver_pid


# The pure-Python unpickler: a subclass may replace entries of its ``dispatch`` table (opcode
# -> method) and override its ``load_*`` methods, which work on ``self.stack``.
PurePythonUnpickler: type[pickle.Unpickler] = pickle._Unpickler  # type: ignore[attr-defined]
