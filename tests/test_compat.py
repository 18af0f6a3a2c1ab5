"""The libraries' private APIs are touched in one module per library (``workers/compat/``,
``workflows/compat/``), and each of those checks at import that what it needs is there.

A module missing here fails CI at once, naming the name and the version; a private name used
anywhere else fails the grep below.
"""

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.extras import needs_extra

COMPAT = (REPO / "workers" / "compat", REPO / "workflows" / "compat")
# Whose private names only the compat modules may touch; and the standard library's.
LIBRARIES = {"torch", "distributed", "optuna"}
STANDARD = set(sys.stdlib_module_names) - {"__future__"}
# Documented in spite of the underscore.
DOCUMENTED = {"_thread", "os._exit", "sys._getframe"}
# The libraries' private names dask-train has used: flagged on any object, also where our own
# code has a name alike (``study._storage`` beside ``self._storage``), and as strings
# (``getattr(cluster, "_adaptive")``).
KNOWN = {
    *("_run", "_adaptive"),  # distributed: Client._run, Cluster._adaptive
    *("_trial_id", "_storage", "_thread_local"),  # optuna
    *("_flatten", "_foreach_copy_", "_get_layout", "_StorageInfo", "_MEM_FORMAT_ENCODING"),
    *("_redistribute", "_gen_transform_infos", "_collective_utils", "_clear_sharding_prop_cache"),
    *("_IR", "_modify_graph_op_device", "_orig_forward", "_parameters", "_buffers"),  # torch
    *("_forkserver", "_preload_modules", "_forkserver_pid", "_Unpickler", "_base"),  # CPython
}
# Other libraries' private names, which this test is not about (file, name).
ELSEWHERE = {("workflows/prediction/batch_predict.py", "_strip_protocol")}  # fsspec's


def _compat_modules() -> list[str]:
    return [
        ".".join(path.relative_to(REPO).with_suffix("").parts)
        for folder in COMPAT
        for path in sorted(folder.glob("*.py"))
        if path.name != "__init__.py"
    ]


def _with_extras(name: str) -> object:
    """Optuna's compat module needs the sweep extra; the others what ``[test]`` installs."""
    return pytest.param(name, marks=needs_extra("optuna")) if "optuna" in name else name


@pytest.mark.parametrize("name", [_with_extras(name) for name in _compat_modules()])
def test_every_compat_module_imports(name):
    importlib.import_module(name)


def test_there_is_one_compat_module_per_library():
    assert sorted(name.rpartition(".")[2] for name in _compat_modules()) == [
        "cpython_private",
        "distributed_private",
        "optuna_private",
        "torch_private",
    ]


def test_a_missing_name_is_one_line_naming_the_library_and_its_version():
    import distributed
    import torch

    from workers.compat import distributed_private, torch_private

    with pytest.raises(ImportError) as torch_error:
        torch_private._needed("torch.distributed.tensor._redistribute:_gone")
    assert str(torch_error.value) == (
        "dask-train needs torch.distributed.tensor._redistribute._gone (torch 2.13.0 and "
        f"2.14.1 have it; this is torch {torch.__version__})"
    )
    with pytest.raises(ImportError) as module_error:
        torch_private._needed("torch.distributed._gone")
    assert str(module_error.value).startswith("dask-train needs torch.distributed._gone (")
    with pytest.raises(ImportError) as distributed_error:
        distributed_private._sets(_nothing, "active_threads", "Worker.active_threads")
    assert str(distributed_error.value) == (
        "dask-train needs Worker.active_threads (distributed 2025.9.1 and 2026.7.1 have it; "
        f"this is distributed {distributed.__version__})"
    )


@needs_extra("optuna")
def test_a_missing_optuna_name_is_one_line_naming_optuna_and_its_version():
    import optuna

    from workflows.compat import optuna_private

    with pytest.raises(ImportError) as optuna_error:
        optuna_private._sets(_nothing, "_trial_id", "Trial._trial_id")
    assert str(optuna_error.value) == (
        "dask-train needs Trial._trial_id (optuna 4.2.0 and 5.0.0 have it; this is optuna "
        f"{optuna.__version__})"
    )


def _nothing() -> None:
    pass


def test_a_python_without_the_fork_servers_pid_fails_the_import_with_one_line():
    code = (
        "import multiprocessing.forkserver as f; del f._forkserver._forkserver_pid; "
        "import workers.compat.cpython_private"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO
    )
    assert done.returncode == 1
    version = ".".join(map(str, sys.version_info[:3]))
    assert done.stderr.splitlines()[-1] == (
        "ImportError: dask-train needs multiprocessing.forkserver._forkserver._forkserver_pid "
        f"(CPython 3.11, 3.12 and 3.13 have it; this is CPython {version})"
    )


# -- public APIs where there are ----------------------------------------------------------------


def test_held_workers_are_never_retired_and_waiting_jobs_count_in_the_adaptive_target():
    # SchedulerPlugin.valid_workers_downscaling keeps held workers out of every retirement
    # (cluster.adapt(), retire_workers); the adaptive target is still the wrapped handler.
    import asyncio

    from distributed import Scheduler, Worker

    from workflows.jobs.admission import (
        QUEUE_PLUGIN_NAME,
        Request,
        WorkerQueue,
        WorkerSelection,
        _Entry,
    )

    async def check() -> tuple[list[str], list[str], int, str]:
        async with (
            Scheduler(port=0, dashboard_address=":0") as scheduler,
            Worker(scheduler.address, nthreads=1, dashboard=False) as held,
            Worker(scheduler.address, nthreads=1, dashboard=False) as free,
        ):
            await scheduler.register_scheduler_plugin(
                WorkerQueue(), name=QUEUE_PLUGIN_NAME, idempotent=True
            )
            queue = scheduler.plugins[QUEUE_PLUGIN_NAME]
            before = sorted(scheduler.workers_to_close(n=2))
            request = Request("job", "job", "client", 1, 1, WorkerSelection())
            queue.entries["job"] = _Entry(request, 0.0, float("inf"), granted=[held.address])
            waiting = Request("waiting", "waiting", "client", 3, 3, WorkerSelection())
            queue.entries["waiting"] = _Entry(waiting, 1.0, float("inf"))
            after = scheduler.workers_to_close(n=2)
            target = scheduler.handlers["adaptive_target"]()
            return before, after, target, free.address

    before, after, target, free = asyncio.run(check())
    assert len(before) == 2 and after == [free]
    assert target == 4  # the job holding one worker, and the one waiting for three


# -- nobody else touches them ----------------------------------------------------------------


def _sources() -> dict[Path, ast.Module]:
    found = {}
    for package in ("workers", "workflows"):
        for path in sorted((REPO / package).rglob("*.py")):
            if not any(path.is_relative_to(folder) for folder in COMPAT):
                found[path] = ast.parse(path.read_text(), filename=str(path))
    return found


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _own_names(trees: list[ast.Module]) -> set[str]:
    """The names our code defines: functions, classes, variables, attributes it assigns."""
    own = set()
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                own.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                own.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                own.add(node.attr)
            elif isinstance(node, ast.ImportFrom) and (
                node.level or (node.module or "").split(".")[0] in ("workers", "workflows")
            ):
                own.update(alias.asname or alias.name for alias in node.names)
    return own


def _library(module: str) -> bool:
    top = module.split(".")[0]
    return top in LIBRARIES or top in STANDARD


def _module_names(tree: ast.Module) -> dict[str, str]:
    """Local name -> what it is bound to, for imports of the libraries and the standard library."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _library(alias.name):
                    local = alias.asname or alias.name.split(".")[0]
                    names[local] = alias.name if alias.asname else local
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names if _library(node.module) else ():
                names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return names


def _root(node: ast.expr) -> ast.expr:
    while isinstance(node, ast.Attribute | ast.Subscript | ast.Call):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node


def _is_attribute(node: ast.AST, attr: str) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == attr


def _string(node: ast.AST) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _getattr_of(node: ast.AST) -> str | None:
    """The attribute name of ``getattr(x, "name", ...)`` (and has/set/delattr)."""
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in ("getattr", "hasattr", "setattr", "delattr")
        and len(node.args) >= 2
    ):
        return _string(node.args[1])
    return None


def private_uses(tree: ast.Module, own: set[str]) -> list[tuple[int, str]]:
    """(line, what) for each use in ``tree`` of a library's private or undocumented name."""
    modules = _module_names(tree)
    found = []
    for node in ast.walk(tree):
        what = None
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if (
                    _library(alias.name)
                    and any(map(_private, parts))
                    and alias.name not in DOCUMENTED
                ):
                    what = f"import {alias.name}"
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            if _library(node.module):
                names = [a.name for a in node.names]
                if any(map(_private, node.module.split("."))) or any(
                    _private(n) and f"{node.module}.{n}" not in DOCUMENTED for n in names
                ):
                    what = f"from {node.module} import {', '.join(names)}"
        elif isinstance(node, ast.Attribute) and _private(node.attr):
            receiver = node.value
            root = _root(receiver)
            bound = modules.get(root.id) if isinstance(root, ast.Name) else None
            if isinstance(receiver, ast.Name) and receiver.id in ("self", "cls"):
                pass
            elif bound is not None:
                if f"{bound}.{node.attr}" not in DOCUMENTED:
                    what = f"{ast.unparse(node)}"
            elif node.attr in KNOWN or node.attr not in own:
                what = f"{ast.unparse(node)}"
        elif _is_attribute(node, "active_threads"):
            what = ast.unparse(node)  # Worker.active_threads
        elif _is_attribute(node, "executing") and _is_attribute(node.value, "state"):
            what = ast.unparse(node)  # WorkerState.executing
        elif _is_attribute(node, "process") and _is_attribute(node.value, "process"):
            what = ast.unparse(node)  # the nanny's worker process
        elif isinstance(node, ast.Subscript) and _is_attribute(node.value, "handlers"):
            if _string(node.slice) is not None:
                what = ast.unparse(node)  # Scheduler.handlers
        elif _getattr_of(node) is not None:
            name = _getattr_of(node)
            assert isinstance(node, ast.Call)
            nanny = name == "process" and _getattr_of(node.args[0]) == "process"
            if nanny or (name and _private(name) and (name in KNOWN or name not in own)):
                what = ast.unparse(node)
        elif _string(node) in KNOWN:
            what = repr(_string(node))
        if what is not None:
            found.append((node.lineno, what))
    return found


def test_no_other_module_touches_a_librarys_private_names():
    sources = _sources()
    own = _own_names(list(sources.values()))
    found = []
    for path, tree in sources.items():
        relative = path.relative_to(REPO).as_posix()
        for line, what in private_uses(tree, own):
            if not any(relative == file and name in what for file, name in ELSEWHERE):
                found.append(f"{relative}:{line}: {what}")
    assert found == [], "use workers/compat/ or workflows/compat/:\n" + "\n".join(found)


@pytest.mark.parametrize(
    "code",
    [
        "from torch.distributed.pipelining._IR import _modify_graph_op_device",
        "from torch.distributed.tensor import _redistribute",
        "from concurrent.futures._base import DoneAndNotDoneFutures",
        "import torch\ntorch._foreach_copy_(a, b)",
        "from torch import nn\nnn.Module._parameters",
        "import pickle\nclass U(pickle._Unpickler): pass",
        "import multiprocessing.forkserver\nmultiprocessing.forkserver._forkserver._forkserver_pid",
        "client._run(f, workers=w)",
        "self.client._run(f)",
        "x = study._storage",
        "trial.trial._trial_id",
        "getattr(cluster, '_adaptive', None)",
        "t._a_name_nobody_here_defines",
        "dask_worker.active_threads.values()",
        "dask_worker.state.executing",
        "scheduler.handlers['adaptive_target'] = f",
        "nanny.process.process.pid",
        "getattr(getattr(nanny, 'process', None), 'process', None)",
        "module.__dict__.pop('_orig_forward', None)",
    ],
)
def test_the_check_finds_a_private_use(code):
    assert private_uses(ast.parse(code), own={"_storage", "_run"}) != []


@pytest.mark.parametrize(
    "code",
    [
        "self._storage = storage\nself._run()",
        "import os, sys, _thread\nos._exit(1)\nsys._getframe(1)",
        "directory._finished_summary()",
        "from workflows.runs.config import _one_line",
        "logging.getLogger().handlers",
        "worker.process",
        "'_prob'",
    ],
)
def test_the_check_passes_our_own_names_and_documented_ones(code):
    assert private_uses(ast.parse(code), own={"_storage", "_run", "_finished_summary"}) == []
