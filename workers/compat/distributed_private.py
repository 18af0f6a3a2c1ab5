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
  (``workflows/launcher.py``); ``Nanny.kill`` would stop it for good.

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
  its navigation bar, around the Training page (``workflows/dashboard.py``); distributed
  renders its bar nowhere else. Imported when the page is served: without Bokeh there is no
  dashboard.
"""

from collections.abc import Callable
from typing import Any

import distributed
from distributed import Nanny, Scheduler, Worker
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


def worker_process_pid(nanny: Any) -> int | None:
    """The pid of ``nanny``'s worker process; None when it has none now."""
    process = getattr(getattr(nanny, "process", None), "process", None)
    return None if process is None else process.pid


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
