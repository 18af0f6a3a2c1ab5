"""What a worker keeps from one job to the next: nothing of other jobs' state, and the code its
jobs imported, moved out of the garbage collector's reach as the fork server's heap is before
any worker is forked from it (``workers/frozen_heap.py``).

Every rank starts with a full collection: ``PeakMemory.start`` keeps the last job's garbage out
of this job's peak, and a trained model's reference cycles are only ever freed by one. Python's
full collection walks every object it tracks, and on a long-lived worker most of them are the
code of the libraries earlier jobs imported (their functions, classes and dicts), which live as
long as the process. Measured (``make bench-workers``: medians of 20 one-step ``train`` jobs on
a warm 2-worker cluster): a job took 0.28 s on fresh workers and 0.44 s once the workers had
imported torchvision, timm, Optuna and MLflow (a full collection then took 103-107 ms, and a
rank ran two); with this freeze, 0.20 s both ways, and a full collection 1 ms.

So before a worker joins a job's process group, it collects and freezes what survives, but
only when modules were imported since the last freeze: the library code is then walked once,
not at every job. Before the group: nothing of the job's group, store or sockets exists yet.
And only when the worker holds no job's state: a model kept for a live recovery (a restarted
attempt, an elastic job's next generation) or left for a client, whose reference cycles would
never be freed once frozen. What a freeze takes in besides is never freed by the collector
again, only when nothing refers to it any more: a few objects of the Dask messages in flight,
once for each time the jobs import something new.
"""

import gc
import sys

from workers import live_recovery, model_pieces
from workers.device_mesh import forget_earlier_meshes

_modules_when_frozen = 0


def forget_other_jobs(job_id: str) -> None:
    """Drop what other jobs left on this worker."""
    # A state another job left here (its client died) must not share the device with this one.
    live_recovery.forget(job_id, others=True)
    model_pieces.forget(job_id, others=True)  # nor the pieces it left for its client
    forget_earlier_meshes()  # nor may DTensor's caches of another job's meshes


def freeze_what_earlier_jobs_imported() -> bool:
    """Before this worker joins a job's process group: collect, then freeze what survives if
    modules were imported since the last freeze and no job's state is held here.

    Returns:
        Whether it froze.
    """
    global _modules_when_frozen
    gc.collect()
    imported = len(sys.modules)
    # A state kept for a live recovery (modules, optimizers: reference cycles), or pieces of a
    # model left for a client, would never be freed by the collector once frozen: the next job
    # drops another job's as its rank starts, and the one after freezes.
    if imported <= _modules_when_frozen or live_recovery.holding() or model_pieces.holding():
        return False
    gc.freeze()
    _modules_when_frozen = imported
    return True
