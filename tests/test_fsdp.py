"""FSDP2 and HSDP end to end on real gloo process groups: the same parameters as one process,
the degrees checked before anything starts, sharded checkpoints that reshard on resume."""

import json
import os
import shutil
import signal
import time

import pytest
import torch
from torch import nn

from tests.reference import (
    SGD_FEW_STEPS,
    assert_matches_one_process,
    assert_same_parameters,
    train_in_one_process,
)
from tests.refusals import refusal
from workers.checkpoint import MANIFEST, list_checkpoints
from workflows.runs.config import load_config
from workflows.runs.driver import train

BASE = SGD_FEW_STEPS | {"batch_size": 32, "epochs": 1, "seed": 3, "max_steps": 5}


@pytest.fixture
def sharded_config(make_config):
    def sharded_config(strategy="fsdp", parallel=None, checkpoint=None, fsdp=None, **training):
        raw = {"name": "sharded", "parallel": parallel or {}, "checkpoint": checkpoint or {}}
        raw["fsdp"] = fsdp or {}
        return make_config(raw, strategy=strategy, **(BASE | training))

    return sharded_config


def _assert_matches_reference(result, config, *, world_size: int, steps: int = 5) -> None:
    # Each rank reads its own share of the batch, as under DDP: one process on the global
    # batches those ranks make up. FSDP reduce-scatters where DDP all-reduces.
    assert_matches_one_process(result.state_dict, config, world_size=world_size, steps=steps)
    untrained = train_in_one_process(config, world_size=world_size, steps=0)
    assert not torch.allclose(result.state_dict["fc2.weight"], untrained["fc2.weight"])


@pytest.mark.equivalence
@pytest.mark.parametrize(
    "training",
    [
        {},
        # Accumulation without a reduce between micro-batches, clipping by the norm of the
        # whole model, whose gradients no rank holds whole, and FSDP's other settings.
        {
            "grad_accum_steps": 2,
            "max_grad_norm": 0.05,
            "fsdp": {"reshard_after_forward": False},
        },
    ],
    ids=["plain", "accumulated-clipped-unresharded"],
)
def test_fsdp_on_two_ranks_matches_one_process(cluster, sharded_config, training):
    config = sharded_config(**training)
    result = train(config, cluster=cluster, on_event=None)
    assert (result.strategy, result.world_size) == ("fsdp", 2)
    # Each rank's peak: at least its halves of the parameters, their gradients and momentum
    # (1.5 P at 2 ranks). No upper bound here: on warm workers it moves with what earlier jobs
    # left (measured up to 650 MiB for this 0.5 MiB model); tests/test_peak_memory.py holds
    # the ratio to DDP's on fresh workers.
    params_mib = sum(t.numel() * t.element_size() for t in result.state_dict.values()) / 2**20
    peaks = result.peak_memory_mib
    assert len(peaks) == 2 and all(1.5 * params_mib <= peak for peak in peaks), peaks
    # model.pt's parameters: the shards gathered into the full model's names.
    _assert_matches_reference(result, config, world_size=2)


class Blocks(nn.Module):
    """Blocks in an ``nn.ModuleList``, which is never called itself: each block is a unit."""

    def __init__(self, in_features: int, num_classes: int, width: int = 32) -> None:
        super().__init__()
        self.stem = nn.Linear(in_features, width)
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(3))
        self.head = nn.Linear(width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.stem(x.flatten(1)))
        for block in self.blocks:
            x = x + torch.relu(block(x))
        return self.head(x)


@pytest.mark.equivalence
def test_a_model_whose_blocks_sit_in_a_module_list_matches_one_process(cluster, sharded_config):
    config = sharded_config()
    result = train(config, model=Blocks, cluster=cluster, on_event=None)
    assert_matches_one_process(result.state_dict, config, world_size=2, steps=5, factory=Blocks)
    untrained = train_in_one_process(config, world_size=2, steps=0, factory=Blocks)
    assert not torch.allclose(result.state_dict["blocks.2.weight"], untrained["blocks.2.weight"])


@pytest.mark.equivalence
def test_hsdp_two_by_two_on_four_workers_matches_one_process(four_workers, sharded_config):
    config = sharded_config("hsdp", parallel={"dp_shard": 2})
    result = train(config, cluster=four_workers, on_event=None)
    assert (result.strategy, result.world_size) == ("hsdp", 4)
    _assert_matches_reference(result, config, world_size=4)


def test_hsdp_degrees_lay_the_ranks_out_as_replicas_of_shards():
    config = load_config(
        {"training": {"strategy": "hsdp", "batch_size": 32}, "parallel": {"dp_replicate": 2}}
    )
    layout = config.layout(8)
    assert (layout.pp, layout.dp, layout.dp_replicate, layout.dp_shard) == (1, 8, 2, 4)
    assert layout.per_rank_batch == 4  # every rank reads its own share, as under DDP
    fsdp = load_config({"training": {"strategy": "fsdp", "batch_size": 32}}).layout(4)
    assert (fsdp.dp_replicate, fsdp.dp_shard) == (1, 4)
    ddp = load_config({"training": {"batch_size": 32}}).layout(4)
    assert (ddp.dp_replicate, ddp.dp_shard) == (4, 1)
    # With tensor parallelism innermost: the two ranks splitting a layer read the same data.
    split = load_config(
        {
            "training": {"strategy": "fsdp", "batch_size": 32},
            "parallel": {"tp": 2},
            "model": {"name": "tests.test_tensor_parallel:TwoLayer", "tp_plan": "m:plan"},
        }
    ).layout(8)
    assert (split.dp, split.dp_shard, split.tp, split.per_rank_batch) == (4, 4, 2, 8)
    assert [split.dp_rank(rank) for rank in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [split.tp_rank(rank) for rank in range(8)] == [0, 1] * 4


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (
            {"training": {"strategy": "hsdp"}, "parallel": {"dp_replicate": 2, "dp_shard": 2}},
            "dp_replicate x dp_shard = 2 x 2 must equal the world size 2",
        ),
        ({"training": {"strategy": "hsdp"}}, "parallel.dp_shard: hsdp needs the ranks"),
        (
            {"training": {"strategy": "hsdp"}, "parallel": {"dp_shard": 3}},
            "parallel.dp_shard: 3 does not divide the world size 2",
        ),
        (
            {"training": {"strategy": "fsdp"}, "parallel": {"dp_replicate": 2}},
            "fsdp shards over all 2 ranks",
        ),
        ({"parallel": {"dp_shard": 2}}, "parallel: ddp replicates the whole model"),
        ({"training": {"strategy": "fsdp", "precision": "fp16"}}, "no loss scaling for fp16"),
        (
            {
                "training": {"strategy": "fsdp"},
                "cluster": {"kind": "cpu"},
                "fsdp": {"cpu_offload": True},
            },
            "fsdp.cpu_offload: a CPU cluster's shards are in host memory already",
        ),
    ],
)
def test_bad_degrees_are_refused_in_one_line_naming_the_field(raw, message):
    base = {"launch": {"world_size": 2}, "training": {"batch_size": 32}}
    assert message in refusal(raw, base=base)


@pytest.mark.equivalence
def test_a_sharded_checkpoint_saved_at_four_ranks_resumes_at_two_and_continues_exactly(
    four_workers, cluster, sharded_config, tmp_path
):
    # DCP writes each rank's shards; at two ranks it reads them back into halves as large.
    folder = tmp_path / "checkpoints"
    config = sharded_config(checkpoint={"directory": str(folder), "every_steps": 1})
    assert train(config, cluster=four_workers, on_event=None).world_size == 4
    # As if the four ranks had been stopped after step 3, in the middle of the epoch.
    for newer in list_checkpoints(folder)[:2]:
        shutil.rmtree(newer)
    (at_step_3,) = [json.loads((p / MANIFEST).read_text()) for p in list_checkpoints(folder)[:1]]
    assert (at_step_3["step"], at_step_3["epoch"], at_step_3["batch"]) == (3, 0, 3)
    resumed = train(config, cluster=cluster, on_event=None)
    assert (resumed.world_size, resumed.history[-1]["step"]) == (2, 5)
    # Three steps on what four ranks read, then two on what two ranks read from the same place
    # in the epoch: what the resumed run did, or it started over or lost the optimizer state.
    assert_matches_one_process(resumed.state_dict, config, world_size=4, steps=3, then=(2, 2))


def test_a_worker_killed_mid_run_under_fsdp_is_recovered_from_the_sharded_checkpoint(
    own_cluster, sharded_config, tmp_path
):
    def config(name: str):
        checkpoint = {"directory": str(tmp_path / name), "every_steps": 4}
        return sharded_config(max_steps=8, log_every_steps=1, checkpoint=checkpoint)

    victim = max(own_cluster.client.run(os.getpid).values())
    killed: list[int] = []

    def kill_after_step_5(record: dict) -> None:
        if not killed and record["kind"] == "step" and record["step"] >= 5:
            # Once step 4's checkpoint is committed (saves are asynchronous: its upload may
            # still be in flight a moment after the step).
            deadline = time.monotonic() + 60
            while not list_checkpoints(tmp_path / "killed") and time.monotonic() < deadline:
                time.sleep(0.01)
            os.kill(victim, signal.SIGKILL)
            killed.append(record["step"])

    result = train(config("killed"), cluster=own_cluster, on_event=kill_after_step_5)
    assert killed, "the kill never happened"
    (recovery,) = result.recoveries
    # No rank holds another's shards: the job goes back to the checkpoint of step 4.
    assert (recovery["recovered_from"], recovery["resumed_from_step"]) == ("checkpoint", 4)
    uninterrupted = train(config("straight"), cluster=own_cluster, on_event=None)
    # The same code on the same ranks and kernels, so the same order of every sum: equal to
    # the last bit, the redone steps included.
    assert_same_parameters(result.state_dict, uninterrupted.state_dict)
