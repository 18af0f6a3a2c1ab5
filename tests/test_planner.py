"""Stage planning: real per-layer profiles, the balanced cut, and the ``plan`` command."""

import subprocess
from collections import OrderedDict
from dataclasses import replace

import pytest
import torch
from torch import nn

from tests.commands import CONFIGS, dask_train
from workers.profiling import DeviceProfile, LayerProfile, profile_layers
from workers.stage_cuts import even_split
from workflows.cluster.training_cluster import live_workers, start_cluster
from workflows.runs.planner import (
    PipelineCut,
    ProfileFailed,
    StagePlan,
    _recommend,
    balanced_split,
    checkpoint_copies,
    estimate_memory,
    optimizer_buffers,
    plan,
    stage_memory,
    suggested_shard,
)
from workflows.runs.resolved_run import resolve_run

MIB = 2**20


def _layers(seconds: list[float], param_mib: list[float] | None = None) -> list[LayerProfile]:
    params = param_mib or [0.0] * len(seconds)
    return [
        LayerProfile(f"l{i}", s, int(p * MIB), activation_bytes=MIB, output_bytes=MIB)
        for i, (s, p) in enumerate(zip(seconds, params, strict=True))
    ]


def test_balanced_split_minimizes_the_slowest_stage():
    layers = _layers([1, 1, 1, 1, 8, 1])
    # Even by layers: [1,1,1] | [1,8,1] -> slowest 10. Balanced: [1,1,1,1] | [8,1] -> 9.
    assert even_split([layer.name for layer in layers], 2) == ["l3"]
    assert balanced_split(layers, 2, memory_bytes=10**12, in_flight=1) == ["l4"]
    assert balanced_split(layers, 3, memory_bytes=10**12, in_flight=1) == ["l4", "l5"]


def test_balanced_split_respects_the_device_memory():
    layers = _layers([1, 1, 1, 1, 8, 1], param_mib=[0, 0, 0, 0, 0, 30])
    # l5 holds 90 MiB (parameters, gradients, momentum) + 8 MiB of activations for 8
    # micro-batches in flight: with l4 beside it a 100 MiB device overflows, so the time-best
    # cut [l0-l3 | l4 l5] gives way to [l0-l4 | l5].
    assert stage_memory(layers[4:], in_flight=8) > 100 * MIB >= stage_memory(layers[5:], 8)
    assert balanced_split(layers, 2, memory_bytes=10**12, in_flight=8) == ["l4"]
    assert balanced_split(layers, 2, memory_bytes=100 * MIB, in_flight=8) == ["l5"]
    with pytest.raises(ValueError, match="does not fit in 2 stages of 95 MiB"):
        balanced_split(layers, 2, memory_bytes=95 * MIB, in_flight=8)


def test_the_planner_cuts_where_a_deliberately_unbalanced_model_needs_it():
    # Four cheap layers, then one that costs more than all of them together, then a cheap one.
    model = nn.Sequential(
        OrderedDict(
            [
                ("a", nn.Linear(64, 64)),
                ("b", nn.Linear(64, 64)),
                ("c", nn.Linear(64, 64)),
                ("d", nn.Linear(64, 64)),
                (
                    "heavy",
                    nn.Sequential(nn.Linear(64, 1024), nn.Linear(1024, 1024), nn.Linear(1024, 64)),
                ),
                ("out", nn.Linear(64, 10)),
            ]
        )
    )
    profile = profile_layers(model, sample=torch.randn(256, 64))
    assert [layer.name for layer in profile] == ["a", "b", "c", "d", "heavy", "out"]
    assert all(layer.seconds > 0 for layer in profile)
    heavy = profile[4]
    assert heavy.param_bytes == sum(p.numel() * 4 for p in model.heavy.parameters())
    assert heavy.activation_bytes > 0 and heavy.output_bytes == 256 * 64 * 4
    # The cut is checked on the layers' multiply-adds per sample in place of their measured
    # times (the heavy block does ~70x the others' work): a cut taken from timings on a shared,
    # noisy machine would test the machine, not the planner.
    work = {
        name: sum(p.numel() for p in child.parameters()) for name, child in model.named_children()
    }
    by_work = [replace(layer, seconds=work[layer.name] * 1e-9) for layer in profile]
    names = [layer.name for layer in profile]
    assert even_split(names, 2) == ["d"]  # the naive cut leaves the heavy layer with others
    assert balanced_split(by_work, 2, memory_bytes=10**12, in_flight=1) == ["heavy"]


def test_memory_per_rank_is_a_replica_under_ddp_and_a_shard_plus_two_units_under_fsdp():
    # 60 MiB of parameters in units of 10, 30 and 20; 1 MiB of activations per layer and
    # micro-batch of 8 rows, 16 rows a rank.
    layers = _layers([1, 1, 1], param_mib=[10, 30, 20])
    profile = DeviceProfile("cpu", memory_bytes=0, micro_batch=8, layers=tuple(layers))
    ddp = estimate_memory(profile, rows=16, optimizer_buffers=1)
    # Parameters, gradients and DDP's buckets, momentum, activations.
    assert (ddp.parameters, ddp.gradients, ddp.optimizer) == (60 * MIB, 120 * MIB, 60 * MIB)
    assert ddp.activations == 6 * MIB and ddp.total == 246 * MIB
    # AdamW's two moments.
    assert estimate_memory(profile, rows=16, optimizer_buffers=2).total == 306 * MIB
    # Sharded over 2: half of everything, and the largest unit (30) gathered twice (the one
    # running and the one prefetched), its gradient twice (whole, and the reduce-scatter's copy).
    assert (
        estimate_memory(profile, rows=16, optimizer_buffers=1, shard=2).total
        == ((30 + 60) + (30 + 60) + 30 + 6) * MIB
    )
    no_momentum = estimate_memory(profile, rows=16, optimizer_buffers=0, shard=4)
    assert no_momentum.optimizer == 0 and no_momentum.total == (75 + 75 + 6) * MIB
    estimates = {
        shard: estimate_memory(profile, rows=16, optimizer_buffers=1, shard=shard)
        for shard in (1, 2, 4)
    }
    assert [suggested_shard(estimates, mib * MIB) for mib in (300, 230, 200, 160)] == [
        1,
        2,
        4,
        None,
    ]


@pytest.mark.parametrize(
    ("optimizer", "extra", "buffers"),
    [
        ("sgd", {"momentum": 0.9}, 1),
        ("sgd", {"momentum": 0.0}, 0),
        ("adamw", {}, 2),
        ("adam", {"optimizer_kwargs": {"amsgrad": True}}, 3),
        ("RMSprop", {"optimizer_kwargs": {"momentum": 0.9, "centered": True}}, 3),
        ("Adagrad", {}, 1),
    ],
)
def test_the_optimizer_state_counted_is_the_configured_optimizers(
    make_config, optimizer, extra, buffers
):
    config = make_config(optimizer=optimizer, **extra)
    assert optimizer_buffers(config.training) == buffers


def _one_stage(dp: int) -> PipelineCut:
    """The whole three-layer model as one stage of 3 s, run on one micro-batch."""
    stage = StagePlan(layers=("l0", "l1", "l2"), seconds=3.0, memory_bytes=0)
    return PipelineCut(points=(), stages=(stage,), n_microbatches=1, dp=dp)


@pytest.mark.parametrize(("world", "advice"), [(2, "fsdp"), (4, "hsdp")])
def test_the_plan_suggests_sharding_when_a_replica_does_not_fit(make_config, world, advice):
    layers = _layers([1, 1, 1], param_mib=[10, 30, 20])
    profile = DeviceProfile("cpu", memory_bytes=230 * MIB, micro_batch=8, layers=tuple(layers))
    config = make_config(batch_size=16 * world, momentum=0.9)
    plan = _recommend(config, profile, _one_stage(dp=world), world_size=world)
    assert not plan.fits_one_device
    assert plan.recommendation.startswith(f"{advice} with parallel.dp_shard = 2: a DDP replica")
    rendered = plan.render().splitlines()
    assert "  ddp                      246.0 MiB  (60.0 + 120.0 + 60.0 + 6.0 + 0.0)" in rendered
    assert "  fsdp, dp_shard=2         216.0 MiB  (90.0 + 90.0 + 30.0 + 6.0 + 0.0)" in rendered


@pytest.mark.parametrize(
    ("checkpoint", "copies", "advice"),
    [
        ({"directory": "ckpt"}, 2, "fsdp"),  # asynchronous, the default
        ({"directory": "ckpt", "async_save": False}, 0, "ddp"),
        ({}, 0, "ddp"),  # no checkpoints
    ],
)
def test_an_asynchronous_checkpoints_copies_count_against_the_workers_memory(
    make_config, checkpoint, copies, advice
):
    # 60 MiB of parameters and as much momentum: a replica needs 246 MiB without checkpoints,
    # and 2 x 120 more with asynchronous ones (the staged copy and its serialized files).
    layers = _layers([1, 1, 1], param_mib=[10, 30, 20])
    profile = DeviceProfile("cpu", memory_bytes=340 * MIB, micro_batch=8, layers=tuple(layers))
    config = make_config({"checkpoint": checkpoint}, batch_size=32, momentum=0.9)
    assert checkpoint_copies(config) == copies
    plan = _recommend(
        config,
        profile,
        _one_stage(dp=2),
        world_size=2,
        checkpoint_copies=checkpoint_copies(config),
    )
    assert plan.memory[1].checkpoint == copies * 120 * MIB
    assert plan.memory[2].checkpoint == copies * 60 * MIB  # a shard's: half
    assert plan.recommendation.startswith(advice)
    if copies:
        line = "  ddp                      486.0 MiB  (60.0 + 120.0 + 60.0 + 6.0 + 240.0)"
        assert line in plan.render().splitlines()


def test_plan_command_prints_profile_split_bubble_and_recommendation(store_dir, cluster):
    command = dask_train(
        *("plan", str(CONFIGS / "digits_ddp.toml")),
        *("--set", f"data.store='{store_dir / 'digits'}'"),
        # The session's cluster and store: a local cluster's start and the store's build are
        # the other CLI tests'.
        *("--scheduler", cluster.client.scheduler.address),
        *("--set", "model.name='small_resnet'"),
        *("--set", "training.strategy='pipeline'"),
        *("--set", "training.batch_size=64"),
    )
    done = subprocess.run(command, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "small_resnet on 2 workers, global batch 64" in out
    for layer in ("stem", "block1", "block6", "fc"):
        assert f"\n  {layer} " in out
    assert "Split into 2 stages at ['" in out
    assert "(p-1)/(m+p-1) = 11.1%" in out  # p=2, m=8
    assert "Recommendation: ddp: the whole model" in out  # a small model fits one device
    assert "Memory per rank at 2 ranks" in out and "\n  fsdp, dp_shard=2 " in out


def test_plan_command_refuses_a_config_that_cannot_be_staged(tmp_path):
    command = dask_train(
        *("plan", str(CONFIGS / "digits_ddp.toml")),
        *("--set", "training.strategy='pipeline'"),
        *("--set", "pipeline.split_points=['nope']"),
    )
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "pipeline.split_points: ['nope'] name no top-level module" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_worker_killed_for_memory_while_profiling_is_an_error_naming_it(make_config):
    # A model of ~1.5 GiB on a worker allowed 1 GiB: the nanny kills the worker while the
    # profile builds it, whatever the profile does next (its parameters alone pass the limit;
    # a model of 0.25 GiB, whose profiled step only neared it, was once not killed).
    # Dask would keep the task bound to the gone worker forever.
    # A DDP run on the one worker: planned as a 2-stage pipeline beside it, profiled all the same.
    config = make_config(
        {"cluster": {"n_workers": 1, "memory_limit": "1GiB", "dashboard_port": 0}},
        strategy="ddp",
    )

    def too_large() -> nn.Module:
        width = 130_000  # 3,072 x 130,000 float32: 1.5 GiB, every page written by the init
        return nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, width), nn.Linear(width, 10))

    with start_cluster(config.cluster) as cluster:
        (worker,) = live_workers(cluster.client)
        with pytest.raises(ProfileFailed) as failed:
            plan(
                cluster.client,
                resolve_run(cluster.client, config),
                num_classes=10,
                build=too_large,
            )
    message = str(failed.value)
    assert f"({worker}) left the cluster" in message
    assert "cluster.memory_limit = '1GiB'" in message and "pipeline.split_points" in message
