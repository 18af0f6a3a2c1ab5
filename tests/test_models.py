"""Models by name from torchvision, timm and import paths, models given in Python, and the
loss and its task's metrics: on real clusters, against one process."""

import importlib.util
import subprocess
import sys
import textwrap
import urllib.request
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch
from sklearn.metrics import mean_absolute_error, mean_squared_error, r2_score
from torch import nn

from tests.commands import CONFIGS, dask_train
from tests.reference import assert_matches_one_process, train_in_one_process
from workers.data import open_store
from workers.losses import Criterion
from workers.models import build_model, largest_unit_bytes, model_blocks
from workers.spec.sections import ModelConfig
from workers.strategies.base import EpochSums
from workflows.observe.dashboard import ROUTE
from workflows.prediction.batch_predict import prepare
from workflows.runs.config import ConfigError, check_model, load_config
from workflows.runs.driver import format_epoch, train
from workflows.runs.run_directory import RunDirectory

BASE = {"lr": 0.05, "momentum": 0.9, "batch_size": 32, "epochs": 1, "seed": 5}
HAS_TIMM = importlib.util.find_spec("timm") is not None

# A model factory in a file outside the repository: an MLP over the flattened image, sized by
# the arguments filled in from the data.
USER_MODELS = """
from torch import nn


def make_mlp(num_classes, in_features, hidden=32):
    return nn.Sequential(
        nn.Flatten(), nn.Linear(in_features, hidden), nn.ReLU(), nn.Linear(hidden, num_classes)
    )


def make_open_mlp(in_features, num_classes, hidden=32, **kwargs):
    # A bare **kwargs forwarded to a strict callable: only what the user set may reach it.
    return nn.Sequential(
        nn.Flatten(), nn.Linear(in_features, hidden, **kwargs), nn.ReLU(),
        nn.Linear(hidden, num_classes),
    )


def not_a_model(num_classes):
    return {"num_classes": num_classes}
"""


def _user_module(folder: Path, monkeypatch) -> str:
    """Write USER_MODELS under a fresh name into ``folder``, importable here only."""
    name = f"user_models_{uuid.uuid4().hex[:8]}"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.py").write_text(textwrap.dedent(USER_MODELS))
    monkeypatch.syspath_prepend(str(folder))
    return name


# -- bad input: one line, before anything launches ----------------------------------------------


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"model": {"name": "resnet18"}}, r"^model\.name: unknown model 'resnet18'; choose one"),
        ({"model": {"name": "torchvision:"}}, r"^model\.name: .*names no model after"),
        ({"model": {"name": "my models:f"}}, r"^model\.name: .*not an import path"),
        ({"training": {"loss": "crossentropy"}}, r"^training\.loss: unknown .*'cross_entropy'\?"),
        (
            {
                "model": {"name": "torchvision:resnet18"},
                "data": {"drop_last": True},
                "training": {"strategy": "pipeline"},
                "pipeline": {"split_points": ["layer9"]},
            },
            r"^pipeline\.split_points: \['layer9'\] name no module of ResNet; .*'layer3'",
        ),
    ],
)
def test_the_config_refuses_bad_model_names_and_losses_in_one_line(raw, message):
    raw = raw | {"launch": {"world_size": 2}}
    with pytest.raises(ConfigError, match=message) as error:
        load_config(raw)
    assert "\n" not in str(error.value)


def test_code_that_cannot_build_the_model_is_one_line_naming_the_field(tmp_path, monkeypatch):
    user = _user_module(tmp_path / "user_code", monkeypatch)
    cases = [
        (
            {"name": "torchvision:resnet81"},
            r"^model\.name: torchvision .* has no model 'resnet81'; did you mean resnet18",
        ),
        (
            {"name": "torchvision:resnet18", "kwargs": {"foo": 1}},
            r"^model\.kwargs: factory torchvision:resnet18 takes no argument 'foo'",
        ),
        (
            {"name": f"{user}:make_mlp", "kwargs": {"depth": 3}},
            rf"^model\.kwargs: factory {user}:make_mlp takes no argument 'depth'",
        ),
        (
            {"name": f"{user}:not_a_model"},
            rf"^model\.name: factory {user}:not_a_model returned a dict, not a torch\.nn\.Module",
        ),
        ({"name": f"{user}:absent"}, rf"^model\.name: module '{user}' has no attribute 'absent'"),
        ({"name": "no_such_pkg.models:f"}, r"^model\.name: cannot import module 'no_such_pkg"),
    ]
    for model, message in cases:
        with pytest.raises(ConfigError, match=message) as error:
            check_model(load_config({"model": model}), num_classes=10)
        assert "\n" not in str(error.value)
    with pytest.raises(ConfigError, match=r"^training\.loss: module 'torch\.nn' has no attribute"):
        check_model(load_config({"training": {"loss": "torch.nn:NoSuchLoss"}}), num_classes=10)
    # A factory given in Python is checked alike (staged strategies check its cut later, when
    # they plan it: tests/test_traced_pipeline.py).
    with pytest.raises(ConfigError, match=r"^model\.name: factory .*returned a str"):
        check_model(load_config({}), num_classes=10, factory=lambda num_classes: "model")


def test_timm_names_without_timm_installed_say_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "timm", None)  # import timm now fails, as where it is absent
    with pytest.raises(ConfigError, match=r"^model\.name: timm:resnet18 needs timm.*") as error:
        check_model(load_config({"model": {"name": "timm:resnet18"}}), num_classes=10)
    assert str(error.value).endswith("pip install 'dask-train[timm]'")


@pytest.mark.slow
def test_dask_train_validate_checks_the_factory_and_the_example_config():
    command = dask_train("validate")
    example = str(CONFIGS / "cifar10_resnet18.toml")
    done = subprocess.run([*command, example], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert '"name": "torchvision:resnet18"' in done.stdout
    bad = [*command, example, "--set", "model.kwargs.depth=3"]
    done = subprocess.run(bad, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    assert done.stderr.strip() == (
        "dask-train: invalid config: model.kwargs: factory torchvision:resnet18 takes no "
        "argument 'depth'; it takes ['block', 'groups', 'layers', 'norm_layer', 'num_classes', "
        "'replace_stride_with_dilation', 'width_per_group', 'zero_init_residual']"
    )


# -- arguments from the data ---------------------------------------------------------------------


def test_num_classes_and_the_input_shape_are_filled_in_where_the_factory_takes_them():
    seen = []

    def factory(num_classes, in_channels, image_size, in_features, width=4):
        seen.append((num_classes, in_channels, image_size, in_features, width))
        return nn.Linear(in_features, num_classes)

    build_model(ModelConfig(kwargs={"width": 8}), num_classes=7, seed=0, factory=factory)
    assert seen == [(7, 3, 32, 3 * 32 * 32, 8)]
    # What the user set wins over the data.
    build_model(ModelConfig(kwargs={"num_classes": 2}), num_classes=7, seed=0, factory=factory)
    assert seen[-1][0] == 2
    # torchvision's builders take num_classes behind **kwargs; the class they return says so.
    model = build_model("torchvision:squeezenet1_1", num_classes=7, seed=0)
    assert model(torch.zeros(2, 3, 32, 32)).shape == (2, 7)
    # Regression: one output per sample.
    outputs = Criterion.of(load_config({"training": {"loss": "mse"}}).training).outputs(10)
    assert outputs == 1


def test_a_factory_with_a_bare_kwargs_gets_the_facts_its_signature_names(tmp_path, monkeypatch):
    seen = []

    def mlp(in_features, num_classes, hidden=64, **kwargs):
        seen.append((in_features, num_classes, hidden, kwargs))
        return nn.Linear(in_features, num_classes)

    config = ModelConfig(kwargs={"hidden": 8, "dropout": 0.5})
    build_model(config, num_classes=7, seed=0, factory=mlp)
    # Named facts filled in, the user's kwargs passed through, in_channels and image_size
    # (which the signature does not name) kept out of **kwargs.
    assert seen == [(3 * 32 * 32, 7, 8, {"dropout": 0.5})]
    # By import path, forwarding its **kwargs to nn.Linear, which would refuse in_channels.
    user = _user_module(tmp_path / "user_code", monkeypatch)
    by_name = ModelConfig(name=f"{user}:make_open_mlp", kwargs={"bias": False})
    model = build_model(by_name, num_classes=7, seed=0)
    assert model[1].weight.shape == (32, 3 * 32 * 32) and model[1].bias is None
    assert model(torch.zeros(2, 3, 32, 32)).shape == (2, 7)
    # The config check (what train() runs before launching) accepts it too.
    check_model(load_config({"model": {"name": f"{user}:make_open_mlp"}}), num_classes=10)


# -- the loss and the task's metrics -------------------------------------------------------------


def test_regression_metrics_over_batches_equal_sklearns_over_all_predictions():
    generator = torch.Generator().manual_seed(0)
    config = load_config({"training": {"loss": "mse"}}).training
    criterion = Criterion.of(config)
    assert criterion.task == "regression"
    sums = EpochSums(device=torch.device("cpu"), criterion=criterion)
    outputs, targets = [], []
    for size in (16, 16, 5):  # a last partial batch, as an epoch has
        output = torch.randn(size, 1, generator=generator)
        y = torch.randint(0, 10, (size,), generator=generator)  # the store's labels
        sums.add(criterion(output, y), output, y)
        outputs.append(output.squeeze(1).numpy())
        targets.append(y.numpy().astype(np.float64))
    metrics = criterion.metrics(sums.all_reduced())
    predicted, truth = np.concatenate(outputs), np.concatenate(targets)
    assert metrics["loss"] == pytest.approx(mean_squared_error(truth, predicted), rel=1e-6)
    assert metrics["mse"] == pytest.approx(mean_squared_error(truth, predicted), rel=1e-6)
    assert metrics["mae"] == pytest.approx(mean_absolute_error(truth, predicted), rel=1e-6)
    assert metrics["r2"] == pytest.approx(r2_score(truth, predicted), rel=1e-6)
    assert set(metrics) == {"loss", "mse", "mae", "r2"}
    # l1 is regression too; its loss is the MAE.
    l1 = Criterion.of(load_config({"training": {"loss": "l1"}}).training)
    output, y = torch.tensor([[1.0], [4.0]]), torch.tensor([2, 2])
    assert l1(output, y).item() == pytest.approx(1.5)


def test_classification_losses_report_accuracy():
    logits = torch.tensor([[2.0, -1.0], [0.5, 1.5], [3.0, 0.0]])
    y = torch.tensor([0, 1, 1])
    for loss in ("cross_entropy", "bce_with_logits", "torch.nn:CrossEntropyLoss"):
        criterion = Criterion.of(load_config({"training": {"loss": loss}}).training)
        sums = EpochSums(device=torch.device("cpu"), criterion=criterion)
        sums.add(criterion(logits, y), logits, y)
        metrics = criterion.metrics(sums.all_reduced())
        assert metrics["accuracy"] == pytest.approx(2 / 3), loss
    # BCE over class indices: one-hot targets.
    bce = Criterion.of(load_config({"training": {"loss": "bce_with_logits"}}).training)
    expected = nn.functional.binary_cross_entropy_with_logits(
        logits, torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 1.0]])
    )
    torch.testing.assert_close(bce(logits, y), expected)
    # One logit per sample: binary, right where the logit is on its label's side of zero.
    single = torch.tensor([[2.0], [-1.0], [0.5]])
    assert bce.terms(single, torch.tensor([1, 1, 1])).item() == 2


# -- training on real clusters -------------------------------------------------------------------


@pytest.mark.slow
def test_a_torchvision_model_under_ddp_equals_one_process(cluster, make_config):
    # SqueezeNet has no batch norm (each rank's batch statistics would differ from the whole
    # batch's); its dropout, off through model.kwargs, would draw other masks on each rank.
    model = {"name": "torchvision:squeezenet1_1", "kwargs": {"dropout": 0.0}}
    config = make_config({"name": "tv-squeezenet", "model": model}, max_steps=2, **BASE)
    result = train(config, cluster=cluster, on_event=None)
    assert result.world_size == 2 and result.final["step"] == 2
    # num_classes came from the store: digits' 10, not ImageNet's 1,000.
    assert result.state_dict["classifier.1.weight"].shape[0] == 10
    assert_matches_one_process(result.state_dict, config, world_size=2, steps=2, bugs=())
    untrained = train_in_one_process(config, world_size=2, steps=0)
    assert not torch.equal(
        result.state_dict["classifier.1.weight"], untrained["classifier.1.weight"]
    )


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TIMM, reason="timm is not installed: pip install 'dask-train[timm]'")
def test_a_timm_model_under_ddp_equals_one_process(cluster, make_config):
    # timm's test_vit: layer norm, no dropout by default; img_size and in_chans come from the data.
    config = make_config(
        {"name": "timm-vit", "model": {"name": "timm:test_vit"}}, max_steps=2, **BASE
    )
    result = train(config, cluster=cluster, on_event=None)
    assert result.state_dict["head.weight"].shape[0] == 10
    assert_matches_one_process(result.state_dict, config, world_size=2, steps=2, bugs=())


@pytest.mark.slow
def test_a_model_given_in_python_trains_on_the_shared_cluster(cluster, make_config):
    # Defined here, in a function: it travels to the workers by value.
    def small_cnn(num_classes, in_channels, image_size):
        return nn.Sequential(
            nn.Conv2d(in_channels, 8, 3, padding=1),
            nn.ReLU(),
            nn.Flatten(),
            nn.Linear(8 * image_size * image_size, num_classes),
        )

    config = make_config({"name": "py-factory"}, max_steps=2, **BASE)
    result = train(config, model=small_cnn, cluster=cluster, on_event=None)
    assert result.state_dict["3.weight"].shape == (10, 8 * 32 * 32)
    assert_matches_one_process(
        result.state_dict, config, world_size=2, steps=2, factory=small_cnn, bugs=()
    )
    untrained = train_in_one_process(config, world_size=2, steps=0, factory=small_cnn)
    assert not torch.equal(result.state_dict["3.weight"], untrained["3.weight"])
    # A factory that refuses a kwarg is stopped before any rank starts.
    bad = make_config({"name": "py-factory", "model": {"kwargs": {"depth": 2}}}, **BASE)
    with pytest.raises(ConfigError, match=r"^model\.kwargs: factory .*small_cnn takes no arg"):
        train(bad, model=small_cnn, cluster=cluster, on_event=None)


def test_a_factory_with_a_bare_kwargs_trains_on_the_shared_cluster(cluster, make_config):
    # num_classes and in_features come from the store although **kwargs hides what else it takes.
    def mlp(in_features, num_classes, hidden=64, **kwargs):
        return nn.Sequential(
            nn.Flatten(), nn.Linear(in_features, hidden), nn.ReLU(), nn.Linear(hidden, num_classes)
        )

    config = make_config({"name": "py-open-factory"}, max_steps=1, **BASE)
    result = train(config, model=mlp, cluster=cluster, on_event=None)
    assert result.state_dict["1.weight"].shape == (64, 3 * 32 * 32)
    assert result.state_dict["3.weight"].shape == (10, 64)


@pytest.mark.slow
def test_regression_with_mse_equals_one_process_and_reports_its_metrics(
    cluster, make_config, tmp_path
):
    # The digits' labels read as numbers: a regression target on data the store holds. The
    # built-in CNN gets one output (num_classes = 1).
    config = make_config({"name": "regression"}, loss="mse", max_steps=3, **BASE | {"lr": 0.01})
    events = []
    run = RunDirectory.create(config, tmp_path / "run")
    with run:
        result = train(config, cluster=cluster, on_event=events.append)
        run.finish(result)
    assert result.state_dict["fc2.weight"].shape == (1, 64)
    assert_matches_one_process(result.state_dict, config, world_size=2, steps=3, bugs=())
    final = result.final
    assert {"loss", "mse", "mae", "r2", "val_loss", "val_mse", "val_mae", "val_r2"} <= set(final)
    assert "accuracy" not in final and "val_accuracy" not in final
    # The validation figures are sklearn's over the trained model's predictions.
    store_url = config.data.resolved().store_url
    store = open_store(store_url)
    model = build_model(config.model, num_classes=1, seed=0)
    model.load_state_dict(result.state_dict)
    with torch.no_grad():
        predicted = model(torch.from_numpy(np.asarray(store.val.images[:]))).squeeze(1).numpy()
    truth = store.val.labels.astype(np.float64)
    assert final["val_mse"] == pytest.approx(mean_squared_error(truth, predicted), rel=1e-5)
    assert final["val_mae"] == pytest.approx(mean_absolute_error(truth, predicted), rel=1e-5)
    assert final["val_r2"] == pytest.approx(r2_score(truth, predicted), rel=1e-5, abs=1e-6)
    # The epoch line, /metrics and the Training page show the task's figures.
    (epoch,) = [e for e in events if e["kind"] == "epoch"]
    line = format_epoch(epoch)
    assert "MSE: " in line and "Val R2: " in line and "Acc" not in line
    metrics_url = cluster.dashboard_link.replace("/status", "/metrics")
    with urllib.request.urlopen(metrics_url, timeout=30) as response:
        gauges = [
            line
            for line in response.read().decode().splitlines()
            if line.startswith("dask_train_val_r2{") and 'job="regression-' in line
        ]
    assert gauges and float(gauges[-1].rsplit(" ", 1)[1]) == pytest.approx(final["val_r2"])
    page_url = cluster.dashboard_link.replace("/status", ROUTE)
    with urllib.request.urlopen(page_url, timeout=30) as response:
        page = response.read().decode()
    assert "val_r2" in page and "val_mae" in page
    # Batch prediction scores classifiers: a regression run is refused before anything runs.
    with pytest.raises(ConfigError, match=r"^--model: .*model\.pt was trained for regression"):
        prepare(model=run.path, input=str(store_url), output=tmp_path / "predictions")


def _block_names(model) -> list[str]:
    blocks = {id(block) for block in model_blocks(model)}
    return [name for name, module in model.named_modules() if id(module) in blocks]


def test_fsdp_units_are_the_repeated_blocks_wherever_the_model_holds_them():
    """The units FSDP gathers one at a time (and activation checkpointing recomputes): a
    transformer's blocks at the top (the GPT), held deeper (torchvision's ViT, a ResNet's
    stages), or the top-level layers of a model without repeats."""
    from torchvision.models import resnet18, vit_b_16

    vit = vit_b_16(image_size=32)
    assert _block_names(vit) == [f"encoder.layers.encoder_layer_{i}" for i in range(12)]
    block = sum(p.numel() * 4 for p in vit.encoder.layers[0].parameters())
    # The largest unit is a block: the root keeps the patch projection, embeddings and head.
    assert largest_unit_bytes(vit) == block
    assert _block_names(resnet18()) == [f"layer{i}.{j}" for i in range(1, 5) for j in range(2)]
    gpt = build_model(
        ModelConfig(name="gpt", kwargs={"dim": 32, "n_layers": 3, "n_heads": 4}),
        num_classes=256,
        seed=0,
        input_shape=(8,),
    )
    assert _block_names(gpt) == [
        "tok_embeddings", "pos_embeddings", "layers.0", "layers.1", "layers.2", "norm", "output"
    ]  # fmt: skip
    assert _block_names(build_model("cifar_cnn", num_classes=10, seed=0)) == [
        "conv1", "conv2", "fc1", "fc2"
    ]  # fmt: skip
