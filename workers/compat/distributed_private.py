"""distributed's private and undocumented APIs that dask-train relies on, checked at import.

Run with distributed 2025.9.1 and 2026.7.1 (``pyproject.toml``'s range). Where one is
missing, importing this module fails with one line: ``ImportError: dask-train needs <name>
(distributed 2025.9.1 and 2026.7.1 have it; this is distributed X.Y.Z)``. Most of these are
attributes that an object gets in its constructor: what is checked is that the constructor
still sets them (their names in its code), since no object exists yet at import.

Worker side:

- ``Worker.active_threads`` (thread -> key of the task it runs): whether a rank task of a
  generation still runs (``workers/process_group.py``), until Dask's own code after the rank
  function is done too.
- ``WorkerState.executing``: the predict tasks a worker runs now (``workers/inference.py``).
- The nanny's ``process.process.pid``: its worker process, killed for a restart at once
  (``workflows/jobs/launcher.py``); ``Nanny.kill`` would stop it for good.
- ``Worker.periodic_callbacks["profile"]`` and ``["profile-cycle"]``: the worker's sampling
  profiler, paused while a rank runs on it (``workers/rank_context.py``); distributed offers
  only a setting read when the worker starts.
- The log record ``Worker.execute`` writes for a task that raised ("Compute Failed", the
  exception's repr its fourth argument): kept off the CLI's terminal for the user's own errors
  (``workers/user_errors.py``).

Scheduler and client side (``workflows/`` imports this module; ``workers/`` never imports
``workflows/``):

- ``Scheduler.handlers["adaptive_target"]``, wrapped in place: the workers waiting jobs need
  count in the target of any adaptive deployment (``cluster.adapt()`` asks the scheduler
  through this handler), for which distributed has no hook. Which held workers may be retired
  (an elastic job's above its minimum) goes through the public
  ``SchedulerPlugin.valid_workers_downscaling``.
- ``Cluster._adaptive``: the adaptive maximum of a cluster started here.
- ``distributed.dashboard.components.scheduler.env`` and
  ``distributed.dashboard.scheduler.template_variables``: the dashboard's page template and
  its navigation bar, around the Training page (``workflows/observe/dashboard.py``); distributed
  renders its bar nowhere else. Imported when the page is served: without Bokeh there is no
  dashboard.
"""

import contextlib
import inspect
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

import distributed
from distributed import Nanny, Scheduler, Status, Worker
from distributed.core import Server
from distributed.deploy.cluster import Cluster
from distributed.nanny import WorkerProcess
from distributed.process import AsyncProcess
from distributed.worker_state_machine import BaseWorker, WorkerState

from workers.compat import constructor_sets

RUN_WITH = "distributed 2025.9.1 and 2026.7.1 have it"


def _missing(name: str) -> ImportError:
    return ImportError(
        f"dask-train needs {name} ({RUN_WITH}; this is distributed {distributed.__version__})"
    )


def _sets(function: Callable[..., Any], attribute: str, name: str) -> None:
    if not constructor_sets(function, attribute):
        raise _missing(name)


_sets(Worker.__init__, "active_threads", "Worker.active_threads")
_sets(BaseWorker.__init__, "state", "Worker.state")
_sets(WorkerState.__init__, "executing", "WorkerState.executing")
_sets(Nanny.__init__, "process", "Nanny.process")
_sets(WorkerProcess.start, "process", "Nanny.process.process")
if not isinstance(getattr(AsyncProcess, "pid", None), property):
    raise _missing("Nanny.process.process.pid")
_sets(Server.__init__, "handlers", "Scheduler.handlers")
_sets(Server.__init__, "periodic_callbacks", "Worker.periodic_callbacks")
SAMPLING_PROFILER = ("profile", "profile-cycle")  # its keys there, when it is enabled
for _key in SAMPLING_PROFILER:
    if _key not in Worker.__init__.__code__.co_consts:
        raise _missing(f'Worker.periodic_callbacks["{_key}"]')
COMPUTE_FAILED = "Compute Failed\n"
if not any(
    isinstance(c, str) and c.startswith(COMPUTE_FAILED + "Key:") and c.count("%") == 5
    for c in inspect.unwrap(Worker.execute).__code__.co_consts
):
    raise _missing("Worker.execute's 'Compute Failed' log record")
if "adaptive_target" not in Scheduler.__init__.__code__.co_consts:
    raise _missing('Scheduler.handlers["adaptive_target"]')
_sets(Cluster.adapt, "_adaptive", "Cluster._adaptive")


# -- worker side ---------------------------------------------------------------------------


def running_task_keys(worker: Worker) -> list[Any]:
    """The keys of the tasks ``worker``'s threads run now (run in its event loop)."""
    return list(worker.active_threads.values())


def executing_task_keys(worker: Worker) -> list[Any]:
    """The keys of the tasks ``worker`` is executing now."""
    return [ts.key for ts in worker.state.executing]


def failed_task_exception(record: logging.LogRecord) -> str | None:
    """The repr of the exception a task raised, from the worker's "Compute Failed" record;
    None for any other record."""
    if not str(record.msg).startswith(COMPUTE_FAILED) or not isinstance(record.args, tuple):
        return None
    return str(record.args[3]) if len(record.args) == 5 else None


def worker_process_pid(nanny: Any) -> int | None:
    """The pid of ``nanny``'s worker process; None when it has none now."""
    process = getattr(getattr(nanny, "process", None), "process", None)
    return None if process is None else process.pid


_profiler_pauses: dict[int, int] = {}  # id(worker) -> ranks running on it now
_profiler_pauses_lock = threading.Lock()


@contextlib.contextmanager
def sampling_profiler_paused(worker: Worker, *, timeout_s: float = 10.0) -> Iterator[None]:
    """Inside, ``worker``'s sampling profiler takes no samples; called from a task's thread.

    Every 10 ms the profiler walks the stack of each thread running a task, in the worker's
    event loop, under the GIL that the rank's thread needs too: measured, 6-13% of a training
    worker's CPU (FSDP's hooks make the deepest stacks). Stopped by the event loop itself
    (tornado's callbacks belong to it), waited for at most ``timeout_s``; started again when
    the last rank running on this worker leaves."""
    # None where the worker started with distributed.worker.profile.enabled off.
    found = [worker.periodic_callbacks.get(key) for key in SAMPLING_PROFILER]
    callbacks = [c for c in found if c is not None]
    stopped = threading.Event()

    def stop() -> None:
        for callback in callbacks:
            callback.stop()
        stopped.set()

    def start() -> None:
        if worker.status in (Status.running, Status.paused):  # a closing worker stops them
            for callback in callbacks:
                callback.start()

    with _profiler_pauses_lock:
        running = _profiler_pauses.get(id(worker), 0)
        _profiler_pauses[id(worker)] = running + 1
        # Under the lock: the loop runs stops and starts in the order the ranks asked.
        if running == 0:
            worker.loop.add_callback(stop)
        else:
            stopped.set()
    stopped.wait(timeout_s)
    try:
        yield
    finally:
        with _profiler_pauses_lock:
            _profiler_pauses[id(worker)] -= 1
            if _profiler_pauses[id(worker)] == 0:
                del _profiler_pauses[id(worker)]
                worker.loop.add_callback(start)


def sampling_profiler_running(worker: Worker) -> bool:
    """Whether ``worker``'s sampling profiler takes samples now (False where it is off)."""
    callbacks = [worker.periodic_callbacks.get(key) for key in SAMPLING_PROFILER]
    return bool(callbacks) and all(c is not None and c.is_running() for c in callbacks)


# -- scheduler and client side -------------------------------------------------------------


def raise_adaptive_target(scheduler: Scheduler, floor: Callable[[], int]) -> None:
    """From now on the scheduler's adaptive target is at least ``floor()``."""
    target = scheduler.handlers["adaptive_target"]

    def adaptive_target(*args: Any, **kwargs: Any) -> int:
        return max(target(*args, **kwargs), floor())

    scheduler.handlers["adaptive_target"] = adaptive_target


def adaptive_of(cluster: Any) -> Any:
    """The ``Adaptive`` that ``cluster.adapt()`` made, or None."""
    return getattr(cluster, "_adaptive", None)


def dashboard_page_template(scheduler: Scheduler) -> tuple[Any, dict[str, Any]] | None:
    """distributed's Jinja template of its dashboard's Bokeh pages (``simple.html``: the
    navigation bar above one document) and the variables it renders ``scheduler``'s bar from
    (``template_variables``: memoized per scheduler, the very dict its pages render from);
    None without Bokeh, where the dashboard has no pages."""
    try:
        from distributed.dashboard.components.scheduler import env
        from distributed.dashboard.scheduler import template_variables
    except ImportError:
        return None
    return env.get_template("simple.html"), template_variables(scheduler)
