"""The memory `dask-train plan` counts, held to: a run whose rank a worker cannot hold is refused
before any rank starts, and a job's asynchronous checkpoint buffers are gone when it ends."""

import gc

import pytest
import torch
from click.testing import CliRunner
from torch import nn

from tests.commands import CONFIGS
from workflows import train
from workflows.cli import main
from workflows.cluster.training_cluster import start_cluster
from workflows.runs.planner import MemoryLimitExceeded

LIMIT = "1GiB"  # a worker with torch imported is ~0.45 GiB before any job
# The refusals below are a CPU rank's, which holds everything in its worker's process; a GPU
# rank's worker holds only the checkpoints' copy (workflows.runs.planner.check_worker_memory).
cpu_ranks = pytest.mark.skipif(
    torch.cuda.is_available(), reason="the workers' ranks would hold their tensors on a GPU"
)


@pytest.fixture(scope="module")
def small_workers():
    """Two workers whose nannies restart them past 95% of 1 GiB."""
    with start_cluster(n_workers=2, memory_limit=LIMIT, dashboard_port=0) as cluster:
        yield cluster


def _wide() -> nn.Module:
    # 3,072 x 8,000 float32: 94 MiB of parameters.
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 8000), nn.Linear(8000, 10))


def _task_prefixes(dask_scheduler) -> list[str]:
    return sorted(dask_scheduler.task_prefixes)


@cpu_ranks
def test_a_rank_larger_than_its_worker_is_refused_before_any_rank_starts(
    small_workers, make_config, tmp_path
):
    client = small_workers.client
    config = make_config(
        {"checkpoint": {"directory": str(tmp_path / "checkpoints")}, "launch": {"world_size": 2}},
        # A DDP rank holds the parameters, their gradients twice (DDP's buckets), AdamW's two
        # moments, and the asynchronous checkpoints' CPU copy of parameters and moments and its
        # serialized files: 94 x (1 + 2 + 2 + 2 x 3) = 1,035 MiB.
        optimizer="adamw",
        batch_size=16,
    )
    with pytest.raises(MemoryLimitExceeded) as refused:
        train(config, model=_wide, cluster=small_workers, on_event=None)
    message = str(refused.value)
    # The figures: the estimate (its parts) against 95% of the limit.
    assert "a rank of this run needs at least 1,035 MiB (parameters 94 + gradients 188" in message
    assert "+ checkpoint copies 565" in message
    assert "95% of its 1,024 MiB limit, 973 MiB" in message
    # The fields that change them.
    for field in ("cluster.memory_limit", "checkpoint.async_save = false", "'fsdp'"):
        assert field in message
    # Refused from the model's sizes: nothing ran on the cluster, no store, no checkpoint.
    assert "train" not in client.run_on_scheduler(_task_prefixes)
    assert not (tmp_path / "checkpoints").exists()


@cpu_ranks
def test_dask_train_run_refuses_a_model_its_workers_cannot_hold_in_one_line(
    small_workers, store_dir
):
    # torchvision's vgg11 for 10 classes: 491 MiB of parameters, twice that of gradients on a
    # DDP rank (its buckets): over the limit before any activation.
    arguments = ["run", str(CONFIGS / "digits_ddp.toml"), "--output", "refused"]
    arguments += ["--scheduler", small_workers.client.scheduler.address]
    arguments += ["--set", f"data.store='{store_dir / 'digits'}'"]
    arguments += ["--set", "model.name='torchvision:vgg11'"]
    # The CLI in this process, as called from Python (tests/test_run_trust.py says why).
    done = CliRunner().invoke(main, arguments, standalone_mode=False)
    assert done.exit_code == 2, done.output
    (message,) = done.stderr.strip().splitlines()
    assert message.startswith("dask-train: cluster.memory_limit: a rank of this run needs ")
    assert "parameters 491 + gradients 983" in message, message
    assert "activations not counted" in message
    assert "train" not in small_workers.client.run_on_scheduler(_task_prefixes)
    assert "Epoch" not in done.stdout


def _staging_left(dask_worker) -> list[str]:
    """The asynchronous checkpoints' objects this worker still holds, after a collection."""
    from torch.distributed.checkpoint.staging import DefaultStager

    from workers.checkpoint import AsyncCheckpoints

    gc.collect()
    held = (AsyncCheckpoints, DefaultStager)
    return [type(o).__name__ for o in gc.get_objects() if isinstance(o, held)]


def test_a_job_that_fits_runs_and_leaves_no_checkpoint_buffers_in_its_workers(
    cluster, make_config, tmp_path
):
    # Asynchronous checkpoints at steps 2 and 4 on the session's workers (limited to their
    # share of the machine's memory): the check lets a run that fits through, and the
    # workers, which run job after job, keep none of its copies.
    config = make_config(
        {
            "checkpoint": {"directory": str(tmp_path / "checkpoints"), "every_steps": 2},
            "launch": {"world_size": 2},
        },
        epochs=1,
        max_steps=4,
        batch_size=32,
    )
    result = train(config, cluster=cluster, on_event=None)
    assert result.history and sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "step-000000002",
        "step-000000004",
    ]
    left = cluster.client.run(_staging_left)
    assert len(left) == 2 and all(held == [] for held in left.values()), left
