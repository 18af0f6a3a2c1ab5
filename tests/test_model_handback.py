"""The trained model handed back: each rank's pieces wait on its worker and the client takes
them a batch at a time (workflows/runs/model_handback.py), leaving nothing behind, and fails, naming
the rank, when a worker is lost first."""

import os
import signal
import time

import numpy as np
import pytest
import torch
from distributed import get_worker

from workers import model_pieces
from workers.model_pieces import HeldPieces, Piece
from workflows import launch
from workflows.jobs.controller import TrainingFailed
from workflows.runs import model_handback
from workflows.runs.model_handback import collect_model

ROWS, COLUMNS = 4, 250  # each tensor 4 KB of float32; each rank holds half of its rows


def _whole(index: int) -> torch.Tensor:
    return torch.arange(ROWS * COLUMNS, dtype=torch.float32).view(ROWS, COLUMNS) + 1000 * index


def _hold_half_of_each(ctx, count: int) -> HeldPieces:
    """This rank's rows of ``count`` tensors, and one plain tensor on rank 0, held."""
    half = ROWS // ctx.world_size
    at = slice(ctx.rank * half, (ctx.rank + 1) * half)
    pieces = {
        f"layer{i}.weight": Piece(_whole(i)[at].numpy().copy(), (at.start, 0), (ROWS, COLUMNS))
        for i in range(count)
    }
    if ctx.rank == 0:
        pieces["scale"] = Piece(np.full(3, 2.5, dtype=np.float32), (0,), (3,))
    return model_pieces.hold(ctx.job_id, pieces, worker=get_worker().address)


def _waiting(dask_worker=None) -> int:
    return len(model_pieces._waiting)


def test_the_model_comes_back_a_batch_at_a_time_and_nothing_stays_on_the_workers(
    cluster, monkeypatch
):
    # Two 2 KB halves fit a batch of 5,000 bytes: each rank's 5 pieces in 3 tasks.
    monkeypatch.setattr(model_handback, "BATCH_BYTES", 5000)
    handles = launch(_hold_half_of_each, 5, cluster=cluster, world_size=2).results
    assert [len(list(h.batches(5000))) for h in handles] == [3, 3]
    assert set(cluster.client.run(_waiting).values()) == {1}  # each worker holds its rank's
    whole = collect_model(cluster.client, handles)
    assert list(whole) == [*(f"layer{i}.weight" for i in range(5)), "scale"]
    for i in range(5):
        assert torch.equal(whole[f"layer{i}.weight"], _whole(i))
    assert torch.equal(whole["scale"], torch.full((3,), 2.5))
    assert set(cluster.client.run(_waiting).values()) == {0}


def test_a_worker_lost_before_its_pieces_are_taken_fails_the_run_naming_it(own_cluster):
    client = own_cluster.client
    handles = launch(_hold_half_of_each, 2, cluster=own_cluster, world_size=2).results
    # Its nanny killing it past its memory limit, as the job ended.
    pid = client.run(os.getpid, workers=[handles[0].worker])[handles[0].worker]
    os.kill(pid, signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(
        TrainingFailed,
        match=r"rank 0's worker .* left the cluster before its part of the trained model",
    ):
        collect_model(client, handles)
    # Dask would wait forever for a task pinned to the dead worker.
    assert time.monotonic() - started < 30
    # Rank 1's pieces, never taken, are gone from its worker too.
    assert client.run(_waiting, workers=[handles[1].worker]) == {handles[1].worker: 0}


def test_held_pieces_come_in_batches_of_at_most_the_bound_in_order():
    held = HeldPieces("job", "tcp://127.0.0.1:1", {"a": 3, "b": 3, "c": 10, "d": 1, "e": 1})
    # A piece larger than the bound travels alone.
    assert list(held.batches(6)) == [["a", "b"], ["c"], ["d", "e"]]
    assert list(held.batches(100)) == [["a", "b", "c", "d", "e"]]
