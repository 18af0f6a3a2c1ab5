"""Tasks for tests/test_run_trust.py that look at a worker's log, in a module of their own: a
worker unpickling them imports this, not the test module's imports (torch, the CLI)."""

import logging


def raise_it(error: Exception) -> None:
    raise error


def what_stderr_shows(dask_worker, keys: list[str]) -> dict[str, bool]:
    """For each task key whose "Compute Failed" record the worker's log kept: whether the
    worker's stderr handlers pass that record."""
    from workers.user_errors import _stderr_handlers

    kept = {
        str(record.args[0]): record
        for handler in logging.getLogger("distributed.worker").handlers
        for record in getattr(handler, "deque", ())
        if str(record.msg).startswith("Compute Failed")
    }
    handlers = _stderr_handlers()
    assert handlers, "the worker writes no log to its stderr"
    return {key: all(h.filter(kept[key]) for h in handlers) for key in keys if key in kept}
