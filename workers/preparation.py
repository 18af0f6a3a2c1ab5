"""A worker gets ready for a job's rank before the job stops for it.

A worker that joins an elastic job, or takes a queued job's first rank, is often a fresh process
(a stock ``dask worker`` a deployment started: a pod, a batch job, a spot VM): it has not
imported torch, nor the job's code. Done as the rank starts, that took 5-8 s of every rank's
wait, because the old ranks stop at a step boundary and wait in the new group's rendezvous for
the newcomer (issue 58: a grow paused training 5.7-13.2 s on a stock cluster). So the
controller first asks each newcomer to :func:`prepare` while the job trains on; only once they
are ready do the ranks stop, and the switch is the group's re-forming and the state's broadcast.

What a rank needs that a fresh process lacks, each imported here once: torch and the pieces of
it every rank uses (``RANK_MODULES``), the job's own code and what it imports (unpickling the
job does both; code the workers cannot import was shipped to them, ``workflows/code_shipping``),
then a check that the rank-0 worker's rendezvous port is reachable from here. Last, what the
imports left is frozen out of the garbage collector's walk (``workers/between_jobs.py``), which
the rank's join would otherwise do on the critical path.
"""

import asyncio
import importlib
import socket
import sys
import time

import cloudpickle

# What every rank imports before its first step, heaviest first; also what the local fork
# server preloads (``workflows/cluster.py``), so the two lists cannot drift apart.
RANK_MODULES = (
    "torch",
    "torch.distributed",
    # What ranks checkpoint and cut pipelines with (the client imports them only when it
    # must): imported by each worker instead, they cost it ~1.5 s and ~130 MB of its own.
    "torch.distributed.checkpoint",
    "torch.distributed.checkpoint.state_dict",
    "torch.distributed.pipelining",
    # Every DDP job imports it (95 of the 271 modules a worker's first DDP job imported when
    # nothing here did): ~0.8 s of each worker's first job. pipelining above imports it too.
    "torch._dynamo",
    "workers.process_group",
    "workers.rank_context",
)

# job id -> when this worker finished preparing for it (epoch seconds); a few jobs remembered.
_prepared: dict[str, float] = {}
KEPT = 64


async def prepare(
    job_id: str, payload: bytes, master: tuple[str, int] | None, timeout_s: float
) -> dict[str, float]:
    """Get this worker ready to take a rank of ``job_id`` (run with ``Client.run``): in a
    thread, so that the worker's event loop keeps answering while torch is imported. Returns
    what each part took, in seconds; raises what failed (the controller leaves the worker out).
    """
    return await asyncio.to_thread(_prepare, job_id, payload, master, timeout_s)


def is_cold() -> bool:
    """Whether this worker has yet to import what a rank needs (run with ``Client.run``)."""
    return not all(name in sys.modules for name in RANK_MODULES)


def prepared() -> dict[str, float]:
    """Job id -> when this worker finished preparing for it (run with ``Client.run``)."""
    return dict(_prepared)


def _prepare(
    job_id: str, payload: bytes, master: tuple[str, int] | None, timeout_s: float
) -> dict[str, float]:
    from workers.device_policy import this_worker

    took: dict[str, float] = {}
    started = time.perf_counter()
    for name in RANK_MODULES:
        importlib.import_module(name)
    # Before any group exists (see ProcessGroupPlugin._join: its functions would hold the group).
    import torch.distributed.nn.functional  # noqa: F401

    took["torch_s"] = time.perf_counter() - started
    started = time.perf_counter()
    cloudpickle.loads(payload)  # the job's code, and the modules it refers to
    took["code_s"] = time.perf_counter() - started
    if master is not None:
        started = time.perf_counter()
        # The running generation's store on the rank-0 worker: where the next one meets too.
        with socket.create_connection(master, timeout=timeout_s):
            pass
        took["store_s"] = time.perf_counter() - started
    started = time.perf_counter()
    this_worker().freeze_what_jobs_imported()
    took["freeze_s"] = time.perf_counter() - started
    _prepared[job_id] = time.time()
    while len(_prepared) > KEPT:
        del _prepared[next(iter(_prepared))]
    return took
