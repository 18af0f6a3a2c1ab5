"""A user's error reads as one message: Dask's "Compute Failed" log of a task that raised one of
our own error types (a bad file, a wrong setting: the client says it in one line) is kept off
the stderr of the workers the CLI started, which is the CLI's terminal.

The worker's own log keeps it (``client.get_worker_logs()``, the dashboard's worker logs), and
every other failure (a bug, an error of the user's own code) is shown as Dask shows it.
"""

import logging
import sys

from distributed import Worker
from distributed.diagnostics.plugin import WorkerPlugin

from workers.compat.distributed_private import failed_task_exception

# The error types that say what the user should change, each naming the field or file
# (tests/test_run_trust.py checks every name against its class, subclasses included).
USER_ERRORS = (
    "ActivationCheckpointingError",  # workers/activation_checkpointing.py
    "BatchRefused",  # workers/sources/cifar10.py
    "CheckpointDamaged",  # workers/checkpoint.py
    "CheckpointError",  # workers/inference.py
    "ConfigError",  # workers/spec/errors.py
    "DataError",  # workflows/jobs/collections.py
    "InPlaceInitError",  # workers/in_place_init.py
    "MemoryLimitExceeded",  # workflows/runs/planner.py (a ConfigError, raised on the client)
    "ModelError",  # workers/model_sources/base.py
    "OptimizerError",  # workers/optimizers.py
    "SourceError",  # workers/sources/base.py
    "StoreRefused",  # workers/data.py
    "WeightsError",  # workers/weight_files.py
)


class _UserErrorsOff(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        exception = failed_task_exception(record)
        return exception is None or not exception.startswith(tuple(f"{n}(" for n in USER_ERRORS))


def _stderr_handlers() -> list[logging.Handler]:
    """The handlers writing a worker's log records to its stderr (Dask's logging config puts
    one on the ``distributed`` logger)."""
    found = []
    for name in ("distributed", "distributed.worker", ""):
        for handler in logging.getLogger(name).handlers:
            stream = getattr(handler, "stream", None)
            if type(handler) is logging.StreamHandler and stream in (sys.stderr, sys.__stderr__):
                found.append(handler)
    return found


class UserErrorsOffStderr(WorkerPlugin):
    """On each worker, now and joining later: the filter on its stderr handlers."""

    name = "dask-train-user-errors-off-stderr"

    def setup(self, worker: Worker) -> None:
        for handler in _stderr_handlers():
            if not any(isinstance(f, _UserErrorsOff) for f in handler.filters):
                handler.addFilter(_UserErrorsOff())

    def teardown(self, worker: Worker) -> None:
        for handler in _stderr_handlers():
            for found in [f for f in handler.filters if isinstance(f, _UserErrorsOff)]:
                handler.removeFilter(found)
