"""Pipeline and model-parallel cuts of models that are not an ``nn.Sequential``: traced by
``torch.distributed.pipelining.pipeline()`` and cut at module paths.

On a real cluster over gloo, k steps of a traced cut leave the parameters one process leaves
(models without batch statistics: a micro-batch then computes what the whole batch does),
alone or with FSDP or DDP replicas, given by name or as ``train(model=...)``, under
cross-entropy or a regression loss. Validation of a model with BatchNorm and Dropout scores
what one process scores in eval mode. A model that does not trace, and a point where no stage
can begin, are refused naming why.
"""

import copy
from dataclasses import replace
from functools import partial

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.reference import (
    SGD_FEW_STEPS,
    Reference,
    assert_equivalent,
    assert_matches_one_process,
    train_in_one_process,
)
from tests.traced_models import DataDependent, ResidualNet, build
from workers.data import StoreSplit, open_store
from workers.losses import Criterion
from workers.model_pieces import assemble
from workers.models import build_model
from workers.precision import Precision
from workers.profiling import profile_module
from workers.spec.errors import ConfigError
from workers.spec.plans import get_plan
from workers.spec.plans.pipeline import StagingSettings
from workers.spec.sections import PipelineConfig, TrainingConfig
from workers.stage_cuts import check_cut, cut_points, trace_stages
from workers.strategies import get_strategy
from workers.strategies.base import EpochSums, RankPlacement, Strategy
from workflows import launch
from workflows.runs.driver import train
from workflows.runs.planner import balanced_split, plan, resolve_split_points
from workflows.runs.resolved_run import resolve_run

BATCH, STEPS, LR, SAMPLES, VAL_SAMPLES = 16, 3, 0.05, 64, 40
IMAGE = (3, 32, 32)
RESNET18_CUT_POINTS = [
    "conv1",
    "bn1",
    "maxpool",  # not relu: it is in place, and a stage cannot change its received input
    "layer1",  # layer1.0 begins where layer1 does
    "layer1.1",
    "layer2",
    "layer2.1",
    "layer3",
    "layer3.1",
    "layer4",
    "layer4.1",
    "avgpool",
    "fc",
]


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, *IMAGE, generator=generator)
    return x, torch.randint(0, 10, (SAMPLES,), generator=generator)


def _val_data() -> tuple[torch.Tensor, torch.Tensor]:
    # Not a multiple of the batch: the last validation batch is padded.
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(VAL_SAMPLES, *IMAGE, generator=generator)
    return x, torch.randint(0, 10, (VAL_SAMPLES,), generator=generator)


def _rows(step: int) -> slice:
    start = step * BATCH % SAMPLES
    return slice(start, start + BATCH)


def cut_and_trained(
    ctx, model_name: str, strategy: str, pipeline: dict, steps: int
) -> dict[str, torch.Tensor] | None:
    """A rank of ``strategy`` over the traced cut ``pipeline`` describes: ``steps`` SGD steps
    through the strategy's own forward and backward; this rank's stages' parameters back."""
    return _trained(ctx, model_name, strategy, pipeline, steps).model_pieces()


def cut_trained_and_validated(
    ctx, model_name: str, strategy: str, pipeline: dict, steps: int
) -> tuple[dict | None, dict[str, float], dict | None]:
    """:func:`cut_and_trained`, then the strategy's validation over ``_val_data``: this
    rank's stages' state before validating, the metrics, and the state after."""
    prepared = _trained(ctx, model_name, strategy, pipeline, steps)
    # A copy: the pieces share the rank's parameters and buffers, which validating must leave.
    before = copy.deepcopy(prepared.model_pieces())
    x, y = _val_data()
    split = StoreSplit(images=x.numpy(), labels=y.numpy(), chunk_size=len(y))
    metrics = prepared.evaluate(
        split, batch_size=prepared.layout.per_rank_batch, precision=Precision("fp32", ctx.device)
    )
    return before, metrics, prepared.model_pieces()


def _trained(ctx, model_name: str, strategy: str, pipeline: dict, steps: int) -> Strategy:
    x, y = _data()
    config = PipelineConfig(**pipeline)
    training = TrainingConfig(strategy=strategy, batch_size=BATCH)
    precision = Precision("fp32", ctx.device)
    layout = get_plan(training.strategy).degrees(training, config, world_size=ctx.world_size)
    placement = RankPlacement(
        layout=layout,
        rank=ctx.rank,
        device=ctx.device,
        precision=precision,
        settings=StagingSettings(pipeline=config),
        sample=torch.zeros(layout.micro_batch, *IMAGE),
    )
    prepared = get_strategy(strategy).prepare(build(model_name, seed=0), placement)
    optimizer = torch.optim.SGD(prepared.parameters(), lr=LR, momentum=0.9)
    sums = EpochSums([0.0, 0.0, 0.0], device=ctx.device)
    share = layout.per_rank_batch
    mine = slice(layout.dp_rank(ctx.rank) * share, (layout.dp_rank(ctx.rank) + 1) * share)
    for step in range(steps):
        optimizer.zero_grad()
        # A replica takes its share of the global batch; the stages of a pipeline all see it.
        xs, ys = x[_rows(step)][mine], y[_rows(step)][mine]
        prepared.forward_backward(xs, ys, precision=precision, sums=sums)
        optimizer.step()
    return prepared


def _one_process(model_name: str, steps: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    x, y = _data()
    x = x.to(dtype)
    model = build(model_name, seed=0).to(dtype)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    for step in range(steps):
        optimizer.zero_grad()
        F.cross_entropy(model(x[_rows(step)]), y[_rows(step)]).backward()
        optimizer.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize(
    ("model_name", "strategy", "pipeline"),
    [
        # A cut inside a ModuleList, with a skip connection on each side of it.
        ("residual_net", "pipeline", {"split_points": ["blocks.1"], "n_microbatches": 4}),
        (
            "residual_net",
            "pipeline",
            {
                "split_points": ["blocks.0", "blocks.1", "blocks.2"],
                "schedule": "interleaved_1f1b",
                "stages_per_rank": 2,
                "n_microbatches": 4,
            },
        ),
        pytest.param(
            "resnet18_group_norm",
            "model_parallel",
            {"split_points": ["layer4.1"]},
            marks=pytest.mark.slow,
        ),
        pytest.param(
            "resnet18_group_norm",
            "pipeline",
            {"split_points": ["layer3"], "schedule": "gpipe", "n_microbatches": 2},
            marks=pytest.mark.slow,
        ),
    ],
    ids=["residual-1f1b", "residual-interleaved", "resnet18-model-parallel", "resnet18-gpipe"],
)
def test_a_traced_cut_matches_one_process(cluster, model_name, strategy, pipeline):
    result = launch(
        cut_and_trained, model_name, strategy, pipeline, STEPS, cluster=cluster, world_size=2
    )
    assert all(result.results), "every rank sends a stage"
    _assert_matches_one_process(result.results, model_name)


def _assert_matches_one_process(stages: list, model_name: str) -> None:
    # Refuses a parameter sent twice or not covered: the full model's names, each once.
    got = assemble(stages)
    reference = Reference.of(lambda dtype: _one_process(model_name, STEPS, dtype), steps=STEPS)
    # The full model's names, every parameter once.
    assert_equivalent(got, reference)
    untrained = build(model_name, seed=0).state_dict()
    assert any(not torch.equal(got[name], untrained[name]) for name in reference.float32)


@pytest.mark.slow
def test_a_traced_cut_times_fsdp_matches_one_process(four_workers):
    pipeline = {"split_points": ["blocks.1"], "n_microbatches": 2, "dp": 2, "dp_mode": "fsdp"}
    result = launch(
        cut_and_trained, "residual_net", "pipeline", pipeline, STEPS, cluster=four_workers
    )
    assert len(result.results) == 4
    _assert_matches_one_process(result.results, "residual_net")


@pytest.mark.slow
def test_a_traced_cut_times_ddp_matches_one_process(four_workers):
    # 2 stages x 2 replicas; each replica's stage runs under DDP, which averages the gradients
    # over the replicas at the last micro-batch's backward.
    pipeline = {"split_points": ["blocks.1"], "n_microbatches": 2, "dp": 2, "dp_mode": "ddp"}
    result = launch(
        cut_and_trained, "residual_net", "pipeline", pipeline, STEPS, cluster=four_workers
    )
    assert len(result.results) == 4
    _assert_matches_one_process(result.results, "residual_net")


@pytest.mark.parametrize(
    ("strategy", "pipeline"),
    [
        ("pipeline", {"split_points": ["blocks.1"], "n_microbatches": 4}),
        ("model_parallel", {"split_points": ["head"]}),
        pytest.param(
            "pipeline",
            {
                "split_points": ["blocks.0", "blocks.1", "head"],
                "schedule": "interleaved_1f1b",
                "stages_per_rank": 2,
                "n_microbatches": 4,
            },
            marks=pytest.mark.slow,
        ),
    ],
    ids=["pipeline-1f1b", "model-parallel", "interleaved"],
)
def test_a_traced_cut_validates_in_eval_mode(cluster, strategy, pipeline):
    # BatchNorm and Dropout: validation in training mode would normalize each micro-batch by
    # its own statistics and drop activations; eval mode uses the running statistics.
    result = launch(
        cut_trained_and_validated,
        "norm_dropout_net",
        strategy,
        pipeline,
        STEPS,
        cluster=cluster,
        world_size=2,
    )
    _assert_validated_in_eval_mode(result.results)


@pytest.mark.slow
def test_ddp_replicas_of_a_traced_cut_validate_in_eval_mode(four_workers):
    # The eval-mode stages share the parameters and buffers of the stages DDP wraps.
    pipeline = {"split_points": ["blocks.1"], "n_microbatches": 2, "dp": 2, "dp_mode": "ddp"}
    result = launch(
        cut_trained_and_validated,
        "norm_dropout_net",
        "pipeline",
        pipeline,
        STEPS,
        cluster=four_workers,
    )
    assert len(result.results) == 4
    _assert_validated_in_eval_mode(result.results)


def _assert_validated_in_eval_mode(results: list) -> None:
    """The ranks' validation figures are the uncut model's in eval mode, on the parameters
    and running statistics they trained, which validating left as they were."""
    for before, _, after in results:
        # Validating moved no running statistic (nor anything else).
        assert before.keys() == after.keys()
        moved = [n for n in before if not torch.equal(before[n].tensor, after[n].tensor)]
        assert not moved, f"state moved: {moved}"
    state = assemble(before for before, _, _ in results)
    model = build("norm_dropout_net", seed=0)
    untrained = model.state_dict()
    assert not torch.equal(state["stem.1.running_mean"], untrained["stem.1.running_mean"])
    model.load_state_dict(state)
    model.eval()
    x, y = _val_data()
    with torch.no_grad():
        logits = model(x)
    expected = {
        "loss": F.cross_entropy(logits, y).item(),
        "accuracy": (logits.argmax(1) == y).float().mean().item(),
    }
    for _, metrics, _ in results:  # every rank gets the same figures
        assert metrics.keys() == expected.keys()
        assert metrics["loss"] == pytest.approx(expected["loss"], rel=1e-5)
        assert metrics["accuracy"] == pytest.approx(expected["accuracy"])
    # The same parameters in training mode score otherwise: the test tells the modes apart.
    model.train()
    with torch.no_grad():
        assert F.cross_entropy(model(x), y).item() != pytest.approx(expected["loss"], rel=1e-3)


def test_a_model_that_does_not_trace_is_refused_with_the_tracers_reason():
    sample = torch.zeros(4, *IMAGE)
    with pytest.raises(ValueError) as error:
        trace_stages(build("data_dependent", seed=0), sample, ["fc"])
    message = str(error.value)
    assert message.startswith("model: DataDependent does not trace into pipeline stages")
    assert "data-dependent" in message and "if x.sum() > 0:" in message
    assert "\n" not in message
    # The planner meets the same refusal when it profiles the model.
    with pytest.raises(ValueError, match="DataDependent does not trace"):
        profile_module(build("data_dependent", seed=0), sample=sample, repeats=1)


@pytest.mark.parametrize(
    ("model_name", "points", "message"),
    [
        (
            "resnet18_group_norm",
            ["layer9"],
            "pipeline.split_points: ['layer9'] name no module of ResNet; a stage can begin at "
            "['bn1', 'maxpool', 'layer1', 'layer1.1', 'layer2'",
        ),
        ("shared_layer", ["act"], "'act' runs 2 times in one forward of SharedLayer"),
        ("resnet18_group_norm", ["conv1"], "'conv1' is where ResNet begins"),
        ("resnet18_group_norm", ["layer4", "layer3"], "in the order ResNet's forward runs"),
        ("resnet18_group_norm", ["layer1", "layer1.0"], "must begin at different places"),
        ("resnet18_group_norm", ["relu"], "cannot begin by changing its input in place"),
    ],
    ids=["unknown", "runs-twice", "the-beginning", "out-of-order", "same-place", "in-place"],
)
def test_a_point_where_no_stage_can_begin_is_refused_naming_the_field(model_name, points, message):
    model = build(model_name, seed=0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError) as error:
        trace_stages(model, torch.zeros(4, *IMAGE), points)
    assert message in str(error.value)
    # A refused cut leaves the model as it was: same numbers, forwards not wrapped.
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert not any("forward" in module.__dict__ for module in model.modules())


def test_the_planner_profiles_the_cut_points_of_a_traced_model():
    model = build("resnet18_group_norm", seed=0)
    sample = torch.randn(8, *IMAGE)
    assert cut_points(model, sample) == RESNET18_CUT_POINTS
    profile = profile_module(model, sample=sample, repeats=1)
    assert [layer.name for layer in profile] == RESNET18_CUT_POINTS
    params = dict(model.named_parameters())
    assert sum(layer.param_bytes for layer in profile) == sum(
        p.numel() * p.element_size() for p in params.values()
    )
    by_name = {layer.name: layer for layer in profile}
    # What crosses the cut before fc: the pooled features of 8 images.
    assert by_name["avgpool"].output_bytes == 8 * 512 * 4
    assert all(layer.seconds > 0 and layer.activation_bytes >= 0 for layer in profile)
    (point,) = balanced_split(profile, 2, memory_bytes=10**12, in_flight=2)
    assert point in RESNET18_CUT_POINTS[1:]
    assert trace_stages(model, sample, [point]).num_stages == 2


def test_the_planner_plans_a_traced_model_on_a_worker(cluster, make_config):
    config = make_config(
        {
            "name": "traced-plan",
            "pipeline": {"schedule": "1f1b", "n_microbatches": 4},
            "launch": {"world_size": 2},
        },
        strategy="pipeline",
        batch_size=32,
    )
    resnet18 = partial(build, "resnet18_group_norm", seed=0)
    run = resolve_run(cluster.client, config)
    result = plan(cluster.client, run, num_classes=10, build=resnet18)
    assert [layer.name for layer in result.profile.layers] == RESNET18_CUT_POINTS
    (point,) = result.split_points
    assert point in RESNET18_CUT_POINTS[1:]
    first, second = result.stages
    assert first.layers + second.layers == tuple(RESNET18_CUT_POINTS)
    assert second.layers[0] == point
    assert f"Split into 2 stages at ['{point}']" in result.render()
    # The equal-layers cut of the same candidates, without a profile; here from the config's
    # model.name (torchvision's own resnet18, the same module paths), as `dask-train plan` does.
    by_layers = config.pipeline.model_copy(update={"balance": "layers"})
    named = config.model.model_copy(update={"name": "torchvision:resnet18"})
    even = resolve_split_points(
        cluster.client,
        replace(run, config=run.config.model_copy(update={"pipeline": by_layers, "model": named})),
        num_classes=10,
    )
    assert even == ("layer3",)  # 13 pieces: 7 in the first stage, 6 in the second


def test_check_cut_keeps_the_sequential_path_and_traces_any_other_model():
    sample = torch.zeros(2, *IMAGE)
    sequential = build_model("cifar_cnn", num_classes=10, seed=0)
    assert check_cut(sequential, sample, None)[:2] == ["conv1", "relu1"]
    with pytest.raises(ValueError, match="'conv9' names no top-level module"):
        check_cut(sequential, sample, ["conv9"])
    residual = build("residual_net", seed=0)
    assert check_cut(residual, sample, ["blocks.1"]) == [
        "stem",
        "blocks.0",
        "blocks.1",
        "blocks.2",
        "head",
    ]
    with pytest.raises(ValueError, match="does not trace"):
        check_cut(build("data_dependent", seed=0), sample, None)


@pytest.mark.slow
def test_a_model_given_in_python_is_traced_cut_and_matches_one_process(cluster, make_config):
    # Defined here, in a function: it travels to the workers by value. The client calls it as
    # the ranks do (num_classes and in_channels from the data) to check and plan the cut.
    def residual(num_classes: int, in_channels: int) -> nn.Module:
        return ResidualNet(num_classes=num_classes, in_channels=in_channels, width=8)

    # The moderate step of the few-steps references (at lr 0.05, measured, the cut's float32
    # result drifted 20 times further from float64 than the one-process float32 result did,
    # on every kernel path: ReLU near-ties that the larger step amplifies).
    training = SGD_FEW_STEPS | {"batch_size": 32, "epochs": 1, "seed": 3}
    config = make_config(
        {"name": "traced-factory", "pipeline": {"n_microbatches": 4}},
        strategy="pipeline",
        max_steps=STEPS,
        **training,
    )
    result = train(config, model=residual, cluster=cluster, on_event=None)
    # Planned on the factory's model: a cut point of the residual net, not of model.name's.
    (point,) = result.split_points
    assert point in ["blocks.0", "blocks.1", "blocks.2", "head"]
    assert_matches_one_process(
        result.state_dict, config, world_size=1, steps=STEPS, factory=residual, bugs=()
    )
    untrained = train_in_one_process(config, world_size=1, steps=0, factory=residual)
    assert not torch.equal(result.state_dict["head.weight"], untrained["head.weight"])
    # Split points are checked against model.name's model when the config loads; where that
    # is the default, the message says how to cut a model given in Python.
    with pytest.raises(ConfigError, match=r"leave split_points to the planner\)$"):
        make_config({"pipeline": {"split_points": ["blocks.1"]}}, strategy="pipeline", **training)
    # A factory whose model does not trace is refused on the client, before any rank starts.
    with pytest.raises(ConfigError, match=r"^model: DataDependent does not trace") as error:
        train(config, model=DataDependent, cluster=cluster, on_event=None)
    assert "\n" not in str(error.value)


@pytest.mark.slow
def test_a_regression_on_a_traced_cut_reports_what_ddp_reports(cluster, make_config):
    # The digits' labels read as numbers, one output: the schedule trains with training.loss,
    # and validation reports the regression figures (MSE, MAE, R²) as DDP's does.
    config = make_config(
        {
            "name": "traced-mse",
            "model": {"name": "tests.traced_models:ResidualNet", "kwargs": {"width": 8}},
            "pipeline": {"split_points": ["blocks.1"], "n_microbatches": 4},
        },
        strategy="pipeline",
        loss="mse",
        max_steps=STEPS,
        lr=0.002,
        momentum=0.9,
        batch_size=32,
        epochs=1,
        seed=3,
    )
    result = train(config, cluster=cluster, on_event=None)
    assert_matches_one_process(result.state_dict, config, world_size=1, steps=STEPS, bugs=())
    assert result.state_dict["head.weight"].shape == (1, 8)

    # Validation of the trained parameters in one process, scored by the same criterion.
    store = open_store(config.data.resolved().store_url)
    x = torch.from_numpy(np.asarray(store.val.images[:]))
    y = torch.from_numpy(store.val.labels)
    model = build_model(config.model, num_classes=1, seed=0, input_shape=tuple(x.shape[1:]))
    model.load_state_dict(result.state_dict)
    model.eval()
    criterion = Criterion.of(config.training)
    sums = EpochSums(device=torch.device("cpu"), criterion=criterion)
    with torch.no_grad():
        output = model(x)
    sums.add(criterion(output, y), output, y)
    figures = criterion.metrics(sums.all_reduced())
    (epoch,) = result.history
    assert {"loss", "mse", "mae", "r2"} <= epoch.keys() and "accuracy" not in epoch
    for key in ("loss", "mse", "mae", "r2"):
        assert epoch[f"val_{key}"] == pytest.approx(figures[key], rel=1e-5), key
    assert epoch["val_loss"] == pytest.approx(epoch["val_mse"])
