"""A model whose float32 parameters exceed one worker's memory limit trains under ``fsdp`` on 4
ranks and in 4 pipeline stages, on workers whose nannies kill them past that limit, and equals
one process trained on the same batches; built whole first, as every rank once built it
(``model.init = "factory"``), the same job is killed.

Too large for the suite (6-8 minutes here, ~18 GB of host memory): ``make test-large`` runs
it. The sizes: a worker with a memory limit is ~0.6 GiB before any job (torch and Dask), and
an FSDP rank of 4 holds a quarter of the parameters, their gradients and the blocks it
gathers, ~0.57 of the model here; so the smallest limit that a model larger than it fits on,
split, with room to spare, is ~2.5 GiB: a model of 681 M parameters.
"""

import pytest
import torch

from tests import reference
from tests.reference import Reference, assert_equivalent
from workflows.benchmarks.larger_than_a_worker import (
    READERS,
    blocks_for,
    run_config,
    train_on_small_workers,
    write_text,
)

pytestmark = [pytest.mark.large, pytest.mark.timeout(1500)]

LIMIT = int(2.5 * 2**30)
STEPS = 2


def _one_process(run: str, layers: int, folder) -> Reference:
    """The one-process reference of ``run``, in float32 and float64, one copy of each kept
    (the reference's cache would keep another of a model this size)."""
    config = run_config(folder, layers=layers, run=run, steps=STEPS)

    def train(dtype: torch.dtype) -> dict[str, torch.Tensor]:
        try:
            return reference.train_in_one_process(
                config, world_size=READERS[run], steps=STEPS, dtype=dtype
            )
        finally:
            reference.forget_computed()

    return Reference.of(train, steps=STEPS)


def test_a_model_larger_than_a_worker_trains_split_and_is_killed_built_whole(tmp_path):
    layers = blocks_for(LIMIT, 1.01)
    write_text(tmp_path)
    outcomes = train_on_small_workers(
        tmp_path, limit=LIMIT, layers=layers, steps=STEPS, runs=["fsdp", "pipeline", "fsdp-whole"]
    )

    # Built whole on every rank, the model does not fit a worker: the limit is real.
    whole = outcomes["fsdp-whole"]
    assert whole.failure is not None, "the model built whole fit a worker: it is too small"
    assert "its nanny restarted it" in whole.failure, whole.failure

    for run in ("fsdp", "pipeline"):
        outcome = outcomes[run]
        assert outcome.failure is None, f"{run}: {outcome.failure}"
        model_bytes = outcome.parameters * 4
        assert model_bytes > LIMIT, f"{run}: {model_bytes} bytes, within the limit {LIMIT}"
        # No rank held the model whole, at any moment of its job.
        for rank, peak in enumerate(outcome.peak_memory_mib):
            assert peak is not None and peak * 2**20 < model_bytes, (run, rank, peak)
        # The clusters are closed: the one-process references have the machine's memory.
        state = torch.load(outcome.saved, mmap=True, weights_only=True)
        assert_equivalent(state, _one_process(run, layers, tmp_path))
        del state
