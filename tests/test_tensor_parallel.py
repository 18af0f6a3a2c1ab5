"""Tensor parallelism by a model's own plan, alone and under FSDP, on real gloo groups: the same
parameters as one process; a plan missing or misplaced is refused before anything starts."""

import pytest
import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from tests import test_text as text
from tests.reference import SGD_FEW_STEPS, assert_matches_one_process, train_in_one_process
from tests.refusals import refusal
from workflows.runs.driver import train

BASE = SGD_FEW_STEPS | {"batch_size": 32, "epochs": 1, "seed": 3, "max_steps": 5}
HERE = "tests.test_tensor_parallel"
MODEL = {"name": f"{HERE}:TwoLayer", "tp_plan": f"{HERE}:plan"}


class TwoLayer(nn.Module):
    """A hidden layer split by columns and one split by rows (Megatron's MLP), then a head
    every rank holds whole."""

    def __init__(self, in_features: int, num_classes: int, width: int = 64) -> None:
        super().__init__()
        self.up = nn.Linear(in_features, width)
        self.down = nn.Linear(width, width)
        self.head = nn.Linear(width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.relu(self.up(x.flatten(1)))  # each tp rank: its slice of the columns
        return self.head(torch.relu(self.down(hidden)))  # summed over the tp ranks


def plan(model: nn.Module, mesh) -> dict:
    return {"up": ColwiseParallel(), "down": RowwiseParallel()}


@pytest.fixture
def tp_config(make_config):
    def tp_config(tp: int, strategy: str = "fsdp", **training):
        raw = {"name": "tensor-parallel", "model": MODEL, "parallel": {"tp": tp}}
        return make_config(raw, strategy=strategy, **(BASE | training))

    return tp_config


def _assert_matches_reference(result, config, *, replicas: int) -> None:
    # The tp ranks of a replica read the same batches: one process on the global batches of
    # the replicas. The split layers sum partial products in another order: the same few-steps
    # float32 tolerance (tests/reference.py).
    assert_matches_one_process(
        result.state_dict, config, world_size=replicas, steps=5, factory=TwoLayer
    )
    untrained = train_in_one_process(config, world_size=replicas, steps=0, factory=TwoLayer)
    assert not torch.allclose(result.state_dict["up.weight"], untrained["up.weight"])


@pytest.mark.equivalence
def test_tensor_parallelism_alone_on_two_ranks_matches_one_process(cluster, tp_config):
    # Clipping by the norm of the whole gradient, half of it in each rank's slices.
    config = tp_config(2, max_grad_norm=0.05)
    result = train(config, cluster=cluster, on_event=None)
    assert result.world_size == 2
    _assert_matches_reference(result, config, replicas=1)


@pytest.mark.equivalence
def test_tensor_parallelism_times_fsdp_two_by_two_matches_one_process(four_workers, tp_config):
    config = tp_config(2)
    result = train(config, cluster=four_workers, on_event=None)
    assert result.world_size == 4
    _assert_matches_reference(result, config, replicas=2)


@pytest.mark.equivalence
def test_the_gpt_split_by_its_plan_under_fsdp_then_in_a_pipeline_matches_one_process(
    four_workers, make_config
):
    # TP x FSDP 2x2: the built-in GPT's plan (q, k, v by columns, the attention's output by
    # rows, ...) on the tp dimension, FSDP over the two replicas: one process on both
    # replicas' batches. Its blocks recompute their activations in the backward (full, then
    # selective in the pipeline): the reference keeps them all, and trains the same.
    raw = {"name": "gpt-tp-fsdp", "data": text.CORPUS, "model": text.GPT, "parallel": {"tp": 2}}
    training = {"activation_checkpointing": "full"}
    config = make_config(raw, **(text.BASE | training | {"strategy": "fsdp"}))
    result = train(config, cluster=four_workers, on_event=None)
    assert result.world_size == 4
    assert_matches_one_process(result.state_dict, config, world_size=2, steps=4)
    # Then PP x TP 2x2 on the same warm workers: each stage a copy of the GPT keeping its
    # blocks (layers.0 with the embeddings, layers.1 with the head), split by the whole model's
    # plan; one copy of the model, two micro-batches (the reference's too). Its tp groups have
    # other names than the job's before, on meshes that compare equal to that job's: DTensor's
    # caches of the earlier meshes failed this job (workers/device_mesh.py:
    # forget_earlier_meshes).
    raw |= {
        "name": "gpt-pp-tp",
        "parallel": {"pp": 2, "tp": 2},
        "pipeline": {"n_microbatches": 2, "balance": "layers"},
    }
    training = {"activation_checkpointing": "selective", "max_grad_norm": 0.05}
    config = make_config(raw, **(text.BASE | training | {"strategy": "pipeline"}))
    result = train(config, cluster=four_workers, on_event=None)
    assert result.world_size == 4
    assert result.split_points == ("layers.1",)  # an even cut of the two blocks
    assert_matches_one_process(result.state_dict, config, world_size=1, steps=4)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (
            {"training": {"strategy": "fsdp"}, "parallel": {"tp": 2}},
            "model.tp_plan: parallel.tp = 2 splits the model's layers",
        ),
        ({"model": MODEL, "parallel": {"tp": 2}}, "parallel.tp: tensor parallelism composes"),
        (
            {"model": MODEL, "training": {"strategy": "fsdp"}, "parallel": {"tp": 3}},
            "parallel.tp: 3 does not divide the world size 2",
        ),
        ({"model": {"tp_plan": "no import path"}}, "is not an import path"),
        (
            {
                "model": MODEL,
                "training": {"strategy": "pipeline"},
                "launch": {"world_size": 4},
                "parallel": {"pp": 2, "tp": 2},
            },
            "parallel.tp: TwoLayer's pipeline stages are traced",
        ),
        (
            {
                "model": text.GPT,
                "training": {"strategy": "pipeline"},
                "launch": {"world_size": 8},
                "parallel": {"pp": 2, "tp": 2, "dp_replicate": 2},
            },
            "parallel.dp_replicate: DDP does not average stages whose layers parallel.tp splits",
        ),
    ],
)
def test_a_bad_tensor_parallel_setting_is_refused_in_one_line(raw, message):
    base = {"launch": {"world_size": 2}, "training": {"batch_size": 32}}
    assert message in refusal(raw, base=base)
