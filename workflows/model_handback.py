"""The trained model from the ranks' workers to the client, a batch of pieces at a time.

Each rank leaves its pieces on its worker (``workers/model_pieces.py``: ``hold``); its result
names them. The client takes them in batches of at most :data:`BATCH_BYTES`, one task on that
worker each, fetched directly and let go before the next: a worker never holds more than a
batch beyond the pieces it trained, whatever Dask does with a task's result while it waits
(spill it to disk, a copy of it, past ``distributed.worker.memory.spill``).
"""

from collections.abc import Mapping, Sequence

import torch
from distributed import Client

from workers import model_pieces
from workers.model_pieces import HeldPieces, Piece, assemble
from workflows.controller import TrainingFailed
from workflows.launcher import WorkerLost, fetch_from_worker

# A batch's bytes: large enough that a model of gigabytes takes a few dozen tasks, small enough
# that a copy of one batch is nothing beside a rank's share of such a model.
BATCH_BYTES = 64 * 2**20


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
        # Taken, or lost with a failure here: nothing of this job stays on the workers.
        for job_id in {part.job_id for part in held}:
            client.run(model_pieces.forget, job_id, on_error="ignore")


def _take(client: Client, held: HeldPieces, *, rank: int) -> dict[str, Piece]:
    pieces: dict[str, Piece] = {}
    for batch in held.batches(BATCH_BYTES):
        future = client.submit(
            model_pieces.take,
            held.job_id,
            batch,
            workers=[held.worker],
            allow_other_workers=False,
            pure=False,
            key=f"take-pieces-{held.job_id}-{rank}-{len(pieces)}",
        )
        try:
            pieces |= fetch_from_worker(
                client,
                future,
                worker=held.worker,
                lost=lambda: WorkerLost(
                    f"rank {rank}'s worker {held.worker} left the cluster before its part of "
                    "the trained model reached the client",
                    rank=rank,
                    worker=held.worker,
                ),
            )
        except WorkerLost as lost:
            raise TrainingFailed(
                f"{lost}; training itself finished (its last checkpoint, if the run keeps "
                "them, holds the model)"
            ) from lost
        finally:
            future.release()  # the worker lets the batch go
    return pieces
