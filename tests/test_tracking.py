"""TensorBoard event files and MLflow runs, read back with the tools people use to read them:
tensorboard's EventAccumulator, and MlflowClient on a local SQLite store."""

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.extras import needs_extra
from workers.models import build_model
from workers.records import ReportRecord
from workflows.data.preprocess import prepare_store
from workflows.observe.tracking import Tracker, TrackingConfig
from workflows.prediction.batch_predict import predict
from workflows.runs.config import ConfigError, load_config
from workflows.runs.driver import train

if TYPE_CHECKING:
    from mlflow.tracking import MlflowClient

CONFIGS = Path(__file__).parents[1] / "workflows" / "configs"


def _scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    events = EventAccumulator(str(folder), size_guidance={"scalars": 0})  # 0: keep every point
    events.Reload()
    return {
        tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]
    }


def _only_run(client: "MlflowClient", experiment: str):
    found = client.get_experiment_by_name(experiment)
    assert found is not None, f"no MLflow experiment {experiment!r}"
    runs = client.search_runs([found.experiment_id])
    assert len(runs) == 1, [r.info.run_id for r in runs]
    return runs[0]


def test_a_plain_directory_as_mlflow_store_is_one_line_naming_the_field():
    with pytest.raises(ConfigError) as raised:
        load_config({"tracking": {"mlflow_uri": "./mlruns"}})
    message = str(raised.value)
    assert message.startswith("tracking.mlflow_uri: ") and "sqlite:///" in message
    assert "\n" not in message


def test_an_experiment_without_a_store_is_refused():
    with pytest.raises(ConfigError, match=r"^tracking.experiment: set tracking.mlflow_uri"):
        load_config({"tracking": {"experiment": "digits"}})


def test_without_mlflow_installed_the_store_is_a_config_error_saying_what_to_install(
    monkeypatch,
):
    monkeypatch.setitem(sys.modules, "mlflow", None)  # how Python spells "not importable"
    with pytest.raises(ConfigError) as raised:
        load_config({"tracking": {"mlflow_uri": "sqlite:///mlflow.db"}})
    assert str(raised.value) == (
        "tracking.mlflow_uri: MLflow is not installed; pip install 'dask-train[mlflow]' "
        "(or mlflow-skinny, sqlalchemy and alembic)"
    )


@needs_extra("mlflow")
def test_training_writes_tensorboard_events_and_one_mlflow_run(cluster, make_config, tmp_path):
    from mlflow.tracking import MlflowClient

    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    config = make_config(
        {
            "name": "tracked",
            "tracking": {"tensorboard": str(tmp_path / "tb"), "mlflow_uri": store},
        },
        epochs=3,
        log_every_steps=5,
    )
    records = []
    result = train(config, cluster=cluster, on_event=records.append)
    epochs = [r for r in records if r["kind"] == "epoch"]
    steps = [r for r in records if r["kind"] == "step"]
    assert len(epochs) == 3 and steps

    scalars = _scalars(tmp_path / "tb")
    # One point per epoch, at the epoch's optimizer step, with the epoch's value.
    assert [s for s, _ in scalars["val/accuracy"]] == [r["step"] for r in epochs]
    for (_, logged), record in zip(scalars["val/accuracy"], epochs, strict=True):
        assert logged == pytest.approx(record["val_accuracy"], rel=1e-6)
    for tag in ("train/accuracy", "val/loss", "perf/samples_per_s", "lr"):
        assert len(scalars[tag]) == 3, tag
    # train/loss: every logged step, and each epoch's mean.
    assert len(scalars["train/loss"]) == len(steps) + 3

    client = MlflowClient(tracking_uri=store)
    run = _only_run(client, "tracked")  # the experiment defaults to the config's name
    assert run.info.status == "FINISHED"
    history = client.get_metric_history(run.info.run_id, "val_accuracy")
    assert [(m.step, m.value) for m in history] == [
        (r["step"], pytest.approx(r["val_accuracy"])) for r in epochs
    ]
    for name in ("accuracy", "val_loss", "samples_per_s", "lr"):
        assert len(client.get_metric_history(run.info.run_id, name)) == 3, name
    assert len(client.get_metric_history(run.info.run_id, "loss")) == len(steps) + 3
    params = run.data.params
    assert params["training.epochs"] == "3" and params["training.strategy"] == "ddp"
    assert params["tracking.mlflow_uri"] == store and params["name"] == "tracked"
    tags = run.data.tags
    assert (tags["strategy"], tags["world_size"], tags["recoveries"]) == ("ddp", "2", "0")
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert artifacts == {"model.pt", "summary.json"}
    local = client.download_artifacts(run.info.run_id, "model.pt", str(tmp_path / "back"))
    state = torch.load(local, weights_only=True)
    torch.testing.assert_close(state, result.state_dict)


@needs_extra("mlflow")
def test_rank_api_reports_log_rank_0_with_its_step_or_a_counter(tmp_path):
    from mlflow.tracking import MlflowClient

    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    config = TrackingConfig(tensorboard=str(tmp_path / "tb"), mlflow_uri=store, experiment="api")
    tracker = Tracker.open(config, {"name": "fit", "training": {"epochs": 2}})
    sent: dict[int, int] = {}

    def report(rank: int, **metrics) -> dict:
        """ctx.report(**metrics)'s record from ``rank``, numbered as the rank numbers them."""
        seq = sent[rank] = sent.get(rank, -1) + 1
        return ReportRecord(rank=rank, attempt=0, seq=seq, time=0.0, **metrics).to_event()

    for rank in (0, 1, 0):
        tracker.record(report(rank, reward=rank + 0.5))
    tracker.record(report(0, step=10, reward=2.0))
    tracker.record(report(1, step=10, reward=9.0))
    tracker.record(report(0, note="text is no metric"))
    tracker.finish({"strategy": "launch", "world_size": 2, "recoveries": []})

    assert _scalars(tmp_path / "tb") == {"report/reward": [(1, 0.5), (2, 0.5), (10, 2.0)]}
    client = MlflowClient(tracking_uri=store)
    run = _only_run(client, "api")
    history = client.get_metric_history(run.info.run_id, "reward")
    assert [(m.step, m.value) for m in history] == [(1, 0.5), (2, 0.5), (10, 2.0)]
    assert run.data.params == {"name": "fit", "training.epochs": "2"}
    assert run.data.tags["world_size"] == "2" and run.info.status == "FINISHED"


@needs_extra("mlflow")
def test_a_prediction_is_an_mlflow_run_with_its_metrics_and_confusion_matrix(
    cluster, make_config, tmp_path
):
    from mlflow.tracking import MlflowClient

    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    config = make_config({"name": "scored", "tracking": {"mlflow_uri": store}})
    prepare_store(cluster.client, config.data.resolved(), seed=config.training.seed)
    checkpoint = tmp_path / "model.pt"
    torch.save(build_model("cifar_cnn", num_classes=10, seed=0).state_dict(), checkpoint)
    result = predict(
        model=checkpoint,
        config=config,
        input=config.data.store,
        output=tmp_path / "predictions",
        settings={"partition_size": 200},
        cluster=cluster,
    )
    client = MlflowClient(tracking_uri=store)
    run = _only_run(client, "scored")
    assert run.info.run_name == "scored-predict" and run.info.status == "FINISHED"
    assert run.data.tags["kind"] == "predict"
    assert run.data.metrics["accuracy"] == pytest.approx(result.metrics["accuracy"])
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert artifacts == {"metrics.json", "confusion_matrix.png", "summary.json"}
    local = client.download_artifacts(run.info.run_id, "metrics.json", str(tmp_path / "back"))
    assert json.loads(Path(local).read_text()) == result.metrics
