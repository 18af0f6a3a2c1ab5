"""A local worker process lets Ctrl-C pass (a Dask worker preload).

A terminal's Ctrl-C (SIGINT) reaches the whole foreground process group: the CLI, and every
worker process of the local cluster it started. Each worker's event loop then cancelled its
work and printed a ``KeyboardInterrupt`` traceback ("Process Dask Worker process (from
Nanny)"), while the CLI was already stopping the ranks and closing those workers in order.
The CLI owns the interrupt; a worker takes it and does nothing. A handler, not ``SIG_IGN``:
a script a worker runs (``dask-train launch``) starts with Python's default handling again,
as an ignored signal would stay ignored across its ``exec``.
"""

import signal
import threading


def _let_pass(signum: int, frame: object) -> None:
    """The CLI that started this worker stops it."""


def dask_setup(worker: object) -> None:
    """The preload hook: runs once in each worker process as it starts, in its main thread
    (where the event loop put its own Ctrl-C handler, which this replaces). Only in a process
    of its own, which a nanny started: a worker made in the caller's process while our
    cluster's settings are in Dask's config (``Worker(...)``, ``processes=False``) would take
    the caller's Ctrl-C away (seen: the test process's, after test_compat made one)."""
    in_a_process_of_its_own = getattr(worker, "nanny", None) is not None
    if in_a_process_of_its_own and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, _let_pass)
