"""Model parallel, pipeline schedules and pipeline x data parallel on real gloo process groups.

Every case trains k steps on a real cluster and must leave the parameters the single-process
reference leaves, within float32's rounding (tests/reference.py): the reference computes the same
micro-batches.
"""

import pytest
import torch

from tests.commands import dask_train, digits_run
from tests.reference import SGD_FEW_STEPS, assert_matches_one_process, train_in_one_process
from tests.refusals import refusal
from workers.spec.errors import ConfigError
from workflows.runs.driver import train

BASE = SGD_FEW_STEPS | {"batch_size": 32, "epochs": 1, "seed": 3}
STEPS = 5


def _assert_matches_reference(result, config, *, steps: int = STEPS) -> None:
    # One process, reading the batches as the run's replicas of each stage do together.
    replicas = config.layout(result.world_size).dp
    assert_matches_one_process(result.state_dict, config, world_size=replicas, steps=steps)
    # The run moved the parameters: equality is not the initial state twice.
    untrained = train_in_one_process(config, world_size=replicas, steps=0)
    assert not torch.allclose(result.state_dict["fc2.weight"], untrained["fc2.weight"])


@pytest.fixture
def staged_config(make_config):
    def staged_config(strategy="pipeline", pipeline=None, data=None, parallel=None, **training):
        raw = {"name": "staged", "pipeline": pipeline or {}, "data": data or {}}
        raw |= {"parallel": parallel} if parallel else {}
        return make_config(raw, strategy=strategy, **(BASE | {"max_steps": STEPS} | training))

    return staged_config


@pytest.mark.equivalence
def test_model_parallel_with_the_seed_articles_split_matches_one_process(cluster, staged_config):
    # The seed's ModelPart1 (convolutions) and ModelPart2 (linear layers) as a config.
    config = staged_config("model_parallel", {"split_points": ["flatten"]})
    result = train(config, cluster=cluster, on_event=None)
    assert result.strategy == "model_parallel" and result.world_size == 2
    assert result.split_points == ("flatten",)
    _assert_matches_reference(result, config)


@pytest.mark.equivalence
@pytest.mark.parametrize(
    "pipeline",
    [
        {"schedule": "gpipe", "n_microbatches": 8},
        {"schedule": "1f1b", "n_microbatches": 4},
        {"schedule": "interleaved_1f1b", "n_microbatches": 4, "stages_per_rank": 2},
    ],
    ids=["gpipe", "1f1b", "interleaved_1f1b"],
)
def test_pipeline_schedules_match_one_process(cluster, staged_config, pipeline):
    events = []
    config = staged_config(pipeline=pipeline, log_every_steps=1)
    result = train(config, cluster=cluster, on_event=events.append)
    # Planned cut: 2 ranks x stages_per_rank stages, in the model's order.
    assert len(result.split_points) == 2 * pipeline.get("stages_per_rank", 1) - 1
    _assert_matches_reference(result, config)
    # The last stage reports the loss, like rank 0 does under DDP.
    steps = [e for e in events if e["kind"] == "step"]
    assert [e["step"] for e in steps] == list(range(1, STEPS + 1))
    assert all(e["loss"] > 0 for e in steps)
    (epoch,) = result.history
    assert 0 < epoch["val_accuracy"] <= 1 and epoch["val_loss"] > 0


def test_pipeline_clips_by_the_norm_of_the_whole_model(cluster, staged_config):
    # The norm spans both stages: clipping each stage by its own norm would differ.
    config = staged_config(pipeline={"n_microbatches": 4}, max_grad_norm=0.05)
    result = train(config, cluster=cluster, on_event=None)
    _assert_matches_reference(result, config)


def test_pipeline_across_an_epoch_boundary_drops_the_partial_batch(cluster, staged_config):
    # 1,438 training digits in batches of 256: 5 full batches an epoch, the rest dropped.
    config = staged_config(
        pipeline={"schedule": "gpipe", "n_microbatches": 8}, batch_size=256, epochs=2, max_steps=7
    )
    assert config.data.drop_last
    result = train(config, cluster=cluster, on_event=None)
    assert [r["step"] for r in result.history] == [5, 7]
    _assert_matches_reference(result, config, steps=7)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("pipeline", "parallel", "shards"),
    [
        # The degrees of [parallel]: PP x DDP, and PP x FSDP with the replicas the world leaves.
        ({"schedule": "1f1b"}, {"pp": 2, "dp_replicate": 2}, 1),
        ({"schedule": "1f1b"}, {"pp": 2}, 2),
        # An older config's [pipeline] dp and dp_mode say the same.
        ({"schedule": "gpipe", "dp": 2, "dp_mode": "fsdp"}, None, 2),
        # Clipping over FSDP's sharded gradients: the norm still spans the whole model.
        ({"schedule": "1f1b", "clip": 0.05}, {"dp_shard": 2}, 2),
    ],
    ids=["1f1b-ddp", "1f1b-fsdp", "gpipe-fsdp", "1f1b-fsdp-clipped"],
)
def test_pipeline_times_data_parallel_on_four_workers_matches_one_process(
    four_workers, staged_config, pipeline, parallel, shards
):
    pipeline = dict(pipeline)
    clip = pipeline.pop("clip", None)
    config = staged_config(
        pipeline={"n_microbatches": 4, **pipeline}, parallel=parallel, max_grad_norm=clip
    )
    layout = config.layout(4)
    assert (layout.pp, layout.dp, layout.dp_shard) == (2, 2, shards)
    result = train(config, cluster=four_workers, on_event=None)
    assert result.world_size == 4
    _assert_matches_reference(result, config)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"data": {"drop_last": False}}, "data.drop_last: pipeline needs every batch"),
        ({"training": {"batch_size": 60}}, "pipeline.dp x pipeline.n_microbatches = 1 x 8"),
        ({"pipeline": {"split_points": ["conv9"]}}, "['conv9'] name no top-level module"),
        (
            {"pipeline": {"split_points": ["conv2", "fc1"]}},
            "2 points make 3 stages, but 2 workers",
        ),
        ({"launch": {"world_size": 2}, "pipeline": {"dp": 3}}, "pp x dp must equal the worker"),
        ({"pipeline": {"dp": 2, "schedule": "gpipe", "dp_mode": "ddp"}}, "use dp_mode = 'fsdp'"),
        ({"pipeline": {"schedule": "interleaved_1f1b"}}, "set stages_per_rank = 2 or more"),
        ({"pipeline": {"stages_per_rank": 2}}, "use schedule = 'interleaved_1f1b'"),
        ({"training": {"grad_accum_steps": 2}}, "accumulates over pipeline.n_microbatches"),
        (
            {
                "launch": {"world_size": 12},
                "cluster": {"n_workers": 12},
                "pipeline": {"n_microbatches": 16},
                "training": {"batch_size": 64},
            },
            "need at least 12 layers",
        ),
        ({"parallel": {"pp": 3}}, "parallel.pp: 3 does not divide the world size 2"),
        ({"parallel": {"pp": 2, "dp_shard": 2}}, "pp x replicas = 2 x 2 must equal the world size"),
        (
            {"parallel": {"dp_shard": 2, "dp_replicate": 2}},
            "parallel.dp_shard: 2 workers do not split into replicas of 4",
        ),
        ({"parallel": {"dp_shard": 2}, "pipeline": {"dp": 2}}, "replaces pipeline.dp"),
        (
            {"parallel": {"dp_replicate": 2}, "pipeline": {"schedule": "gpipe"}},
            "parallel.dp_replicate: DDP-wrapped stages only work with the 1f1b",
        ),
        (
            {
                "parallel": {"pp": 12},
                "launch": {"world_size": 12},
                "cluster": {"n_workers": 12},
                "pipeline": {"n_microbatches": 16},
                "training": {"batch_size": 64},
            },
            "parallel.pp: 12 ranks x 1 stages per rank need at least 12 layers",
        ),
        ({"parallel": {"pp": 2}, "training": {"strategy": "ddp"}}, "parallel.pp: ddp keeps the"),
        (
            {"parallel": {"dp_shard": 2}, "training": {"strategy": "model_parallel"}},
            "parallel: model_parallel runs one copy",
        ),
        ({"training": {"strategy": "model_parallel"}, "launch": {"world_size": 1}}, "at least 2"),
        (
            {
                "parallel": {"pp": 2},
                "training": {"strategy": "model_parallel"},
                "launch": {"world_size": 4},
                "cluster": {"n_workers": 4},
            },
            "parallel.pp: model_parallel runs one copy of the model, one stage per rank, and 2",
        ),
        ({"training": {"precision": "fp16"}}, "no loss scaling for fp16"),
        (
            {
                "parallel": {"pp": 4},
                "pipeline": {"n_microbatches": 2},
                "launch": {"world_size": 4},
                "cluster": {"n_workers": 4},
            },
            "pipeline.n_microbatches: schedule '1f1b' runs at least as many micro-batches as "
            "pipeline ranks (pp = 4), got 2",
        ),
        (
            {
                "model": {"name": "tests.traced_models:ResidualNet"},
                "pipeline": {"split_points": ["blocks.1"]},
                "training": {"activation_checkpointing": "full"},
            },
            "training.activation_checkpointing: ResidualNet is cut into stages by tracing",
        ),
    ],
)
def test_bad_staged_configs_are_refused_before_launch_naming_the_field(raw, message):
    base = {
        "launch": {"world_size": 2},
        "training": {"strategy": "pipeline", "batch_size": 32},
    }
    assert message in refusal(raw, base=base)


def test_a_world_known_only_at_launch_is_checked_before_anything_runs(cluster, staged_config):
    # The cluster has 2 workers; 3 replicas cannot split them. No rank task may start.
    config = staged_config(pipeline={"dp": 3})
    with pytest.raises(ConfigError, match="2 workers do not split into replicas of 3"):
        train(config, cluster=cluster, on_event=None)
    # 2 ranks of 6 stages each are 12 stages, and the CNN has 10 layers to cut between.
    interleaved = {"schedule": "interleaved_1f1b", "stages_per_rank": 6, "balance": "layers"}
    config = staged_config(pipeline=interleaved)
    with pytest.raises(ConfigError, match="pipeline: 12 stages need at least 12 layers"):
        train(config, cluster=cluster, on_event=None)


def test_cli_runs_the_pipeline_example_and_writes_the_whole_model(tmp_path, store_dir, cluster):
    import json
    import subprocess

    from workers.models import build_model

    # On the session's cluster: a local cluster's start is the other CLI tests'.
    on_cluster = ("--scheduler", cluster.client.scheduler.address)
    done = subprocess.run(
        dask_train(
            *digits_run(store_dir, tmp_path / "run", config="digits_pipeline.toml", epochs=2),
            *on_cluster,
        ),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["strategy"] == "pipeline" and summary["world_size"] == 2
    assert len(summary["split_points"]) == 1
    # Chance is 0.1; the example's stable settings give 0.858 after 2 epochs on every kernel path.
    assert summary["final"]["val_accuracy"] > 0.5
    # Both stages' parameters came back: the file loads into the uncut model.
    state = torch.load(tmp_path / "run" / "model.pt", weights_only=True)
    build_model("cifar_cnn", num_classes=10, seed=0).load_state_dict(state)
