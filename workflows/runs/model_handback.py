"""The trained model from the ranks' workers to the client, a batch of pieces at a time.

Each rank leaves its pieces on its worker (``workers/model_pieces.py``: ``hold``); its result
names them. The client takes them in batches of at most :data:`BATCH_BYTES`, each by
``Client.run`` on that worker: not a task, so neither Dask's spilling of a task's result (a
copy of it, past ``distributed.worker.memory.spill``) nor a paused worker's queue (past
``distributed.worker.memory.pause``, where a worker that holds a rank's share may well be
after training) stands in the way. A worker never holds more than a batch beyond the pieces it
trained.
"""

import contextlib
from collections.abc import Mapping, Sequence

import torch
from distributed import Client

from workers import model_pieces
from workers.model_pieces import HeldPieces, Piece, assemble
from workflows.cluster.training_cluster import live_workers
from workflows.jobs.controller import TrainingFailed
from workflows.jobs.launcher import run_bounded

# A batch's bytes: large enough that a model of gigabytes takes a few dozen hand-overs, small enough
# that a copy of one batch is nothing beside a rank's share of such a model.
BATCH_BYTES = 64 * 2**20
# A bound on one batch's hand-over: 64 MiB take well under a second on a local network.
TAKE_TIMEOUT_S = 120.0


def collect_model(
    client: Client, parts: Sequence[Mapping[str, Piece] | HeldPieces]
) -> dict[str, torch.Tensor]:
    """The whole model from every rank's part: pieces already here, or held on a worker.

    Raises:
        TrainingFailed: A worker left the cluster before its pieces reached the client.
    """
    held = [part for part in parts if isinstance(part, HeldPieces)]
    try:
        return assemble(
            part if not isinstance(part, HeldPieces) else _take(client, part, rank=rank)
            for rank, part in enumerate(parts)
        )
    finally:
        # Taken, or lost with a failure here: nothing of this job stays on its workers.
        workers = sorted({part.worker for part in held})
        for job_id in {part.job_id for part in held}:
            with contextlib.suppress(Exception):  # a worker that does not answer keeps them
                run_bounded(client, model_pieces.forget, job_id, workers=workers, timeout_s=5.0)


def _take(client: Client, held: HeldPieces, *, rank: int) -> dict[str, Piece]:
    pieces: dict[str, Piece] = {}
    lost = (
        f"rank {rank}'s worker {held.worker} left the cluster before its part of the trained "
        "model reached the client; training itself finished (its last checkpoint, if the run "
        "keeps them, holds the model)"
    )
    for batch in held.batches(BATCH_BYTES):
        try:
            answers = run_bounded(
                client,
                model_pieces.take,
                held.job_id,
                batch,
                workers=[held.worker],
                timeout_s=TAKE_TIMEOUT_S,
            )
        except TimeoutError:
            raise TrainingFailed(
                f"rank {rank}'s worker {held.worker} did not hand over its part of the trained "
                f"model within {TAKE_TIMEOUT_S:g} s (a stopped process?)"
            ) from None
        except OSError:
            # Dask's CommClosedError: the scheduler reached for a worker that died before it
            # noticed (a killed process's connection resets at once; its departure comes later).
            raise TrainingFailed(lost) from None
        taken = answers.get(held.worker)
        if not isinstance(taken, dict):  # the worker left, or the pieces were not there
            raise TrainingFailed(lost if held.worker not in live_workers(client) else str(taken))
        pieces |= taken
    return pieces
