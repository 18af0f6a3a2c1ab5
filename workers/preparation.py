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
job does both; code the workers cannot import was shipped to them,
``workflows/jobs/code_shipping``), then a check that the rank-0 worker's rendezvous port is
reachable from here. For the built-in trainer's jobs (``workers.train.run_rank``), also what its
rank opens and builds first: the dataset store opened and one chunk of its training split read (what
the rank then opens is this process's cached store, ``workers.data.open_store``), and the model
built once on the meta device, which imports the model's library and code and checks that it builds
here. A data source that this worker cannot reach (a path absent on its machine, credentials it
lacks) or a model it cannot build is a failure to prepare: the worker is left out, not given a rank
that would fail the job's next generation. Last, what the imports left is frozen out of the garbage
collector's walk (``workers/between_jobs.py``), which the rank's join would otherwise do on
the critical path.
"""

import asyncio
import importlib
import socket
import sys
import time
from typing import TYPE_CHECKING, Any

import cloudpickle

if TYPE_CHECKING:
    from workers.train import TrainJob

# What every rank imports before its first step, heaviest first; also what the local fork
# server preloads (``workflows/cluster/training_cluster.py``), so the two lists cannot drift apart.
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

# job id -> what this worker's preparation for it found: when it finished ("at", epoch
# seconds), and for a built-in trainer's job the store it opened ("store", its training split's
# "samples") and the model it built ("parameters", "device"); a few jobs remembered.
_prepared: dict[str, dict[str, Any]] = {}
KEPT = 64


class PreparationFailed(RuntimeError):
    """This worker cannot take a rank of the job: the message names the field and what failed."""


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


def prepared() -> dict[str, dict[str, Any]]:
    """Job id -> what this worker's preparation for it found (run with ``Client.run``): "at",
    when it finished; for the built-in trainer's jobs, "store" and "samples" (the store opened,
    its training split's size; None for Dask collections), "parameters" and "device" (the model
    built: "meta", or "cpu" for a model that cannot be built there)."""
    return {job_id: dict(found) for job_id, found in _prepared.items()}


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
    job = cloudpickle.loads(payload)  # the job's code, and the modules it refers to
    took["code_s"] = time.perf_counter() - started
    found: dict[str, Any] = {}
    trainer = sys.modules.get("workers.train")  # the unpickling imported it for its own jobs
    if trainer is not None and job.fn is trainer.run_rank:
        (train_job,) = job.args
        found = _open_and_build(train_job, took)
    # A `launch(fn)` job's function (or a script's) opens what it reads itself, as it runs:
    # there is nothing here to open or build ahead of it; its code was imported above.
    if master is not None:
        started = time.perf_counter()
        # The running generation's store on the rank-0 worker: where the next one meets too.
        with socket.create_connection(master, timeout=timeout_s):
            pass
        took["store_s"] = time.perf_counter() - started
    started = time.perf_counter()
    this_worker().freeze_what_jobs_imported()
    took["freeze_s"] = time.perf_counter() - started
    _prepared[job_id] = {"at": time.time(), **found}
    while len(_prepared) > KEPT:
        del _prepared[next(iter(_prepared))]
    return took


def _open_and_build(job: "TrainJob", took: dict[str, float]) -> dict[str, Any]:
    """What the built-in trainer's rank opens and builds first (``workers.train.build``), done
    here once: the store opened and a chunk of it read, the model built on the meta device.
    What it found; each part's seconds go into ``took``; raises `PreparationFailed`."""
    from workers.collection_shard import collections_model_inputs
    from workers.data import open_store
    from workers.losses import Criterion
    from workers.models import check_model

    started = time.perf_counter()
    found: dict[str, Any] = {"store": None, "samples": None}
    if job.collections is None:
        url = job.data.store_url
        try:
            store = open_store(url, storage_options=job.data.storage_options)
            # A chunk of the split every rank reads from: its bytes are reachable, not only
            # the metadata (which rank's part this worker takes is known once the group forms).
            store.train.images[:1]
        except Exception as error:
            raise PreparationFailed(
                f"data.store: {url} cannot be read from this worker: {type(error).__name__}: "
                f"{error}"
            ) from error
        num_classes, input_shape = store.num_classes, tuple(store.train.images.shape[1:])
        found |= {"store": url, "samples": len(store.train)}
    else:  # Dask collections: their partitions are read where they lie, once the rank starts
        num_classes, input_shape = collections_model_inputs(job.collections)
    took["data_s"] = time.perf_counter() - started
    started = time.perf_counter()
    try:
        # On the meta device (a model whose constructor computes with its tensors is built on
        # the CPU instead, as the client's check does): its library and code imported, its
        # architecture built once; the rank builds it again, for real.
        model = check_model(
            job.model,
            num_classes=Criterion.of(job.training).outputs(num_classes),
            input_shape=input_shape,
            factory=job.factory,
        )
    except Exception as error:
        raise PreparationFailed(
            f"model.name: {job.model.name} cannot be built on this worker: "
            f"{type(error).__name__}: {error}"
        ) from error
    took["model_s"] = time.perf_counter() - started
    parameters = list(model.parameters())
    return found | {
        "parameters": sum(p.numel() for p in parameters),
        "device": parameters[0].device.type if parameters else "meta",
    }
