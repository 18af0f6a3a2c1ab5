"""`dask-train predict` end to end, as a scheduler would call it: real processes, real files."""

import json
from pathlib import Path

import pandas as pd
import pytest
import torch

from tests.commands import run_dask_train
from workers.models import build_model
from workflows.data.preprocess import prepare_store
from workflows.runs.config import load_config

CONFIGS = Path(__file__).parents[1] / "workflows" / "configs"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A bare checkpoint of the registry's model for digits' 10 classes."""
    path = tmp_path_factory.mktemp("model") / "model.pt"
    torch.save(build_model("cifar_cnn", num_classes=10, seed=0).state_dict(), path)
    return path


@pytest.fixture(scope="module")
def digits_store(cluster, store_dir) -> Path:
    """The session's digits store (built here unless an earlier test did): a bare checkpoint
    takes its normalization statistics from it."""
    config = load_config(CONFIGS / "digits_ddp.toml", [f"data.store='{store_dir / 'digits'}'"])
    prepare_store(cluster.client, config.data.resolved(), seed=config.training.seed)
    return store_dir / "digits"


def _settings(store_dir: Path) -> list[str]:
    return [
        *("--set", f"data.store='{store_dir / 'digits'}'"),
        *("--set", "cluster.dashboard_port=0"),
    ]


@pytest.mark.slow
def test_predict_scores_the_store_and_writes_predictions_and_metrics(
    tmp_path, store_dir, checkpoint, digits_store, cluster
):
    output = tmp_path / "scored"
    done = run_dask_train(
        "predict",
        str(CONFIGS / "digits_ddp.toml"),
        *_settings(store_dir),
        # The session's cluster: the command connects to it instead of starting its own.
        *("--scheduler", cluster.cluster.scheduler_address),
        *("--set", "predict.outputs='top_k'", "--set", "predict.partition_size=100"),
        *("--model", str(checkpoint), "--input", str(store_dir / "digits")),
        *("--output", str(output)),
    )
    assert done.returncode == 0, done.stderr
    assert "in 4 partitions" in done.stdout and "done: 359 predictions on 2 workers" in done.stdout
    frame = pd.read_parquet(output / "predictions.parquet")
    assert sorted(frame["index"]) == list(range(359))
    assert {"top1", "top3_prob"} <= set(frame.columns)
    metrics = json.loads((output / "metrics.json").read_text())
    assert f"accuracy {metrics['accuracy']:.4f}" in done.stdout
    assert (output / "confusion_matrix.png").is_file()


def test_predict_with_a_foreign_checkpoint_exits_2_with_one_line(tmp_path, store_dir, digits_store):
    foreign = tmp_path / "five.pt"
    torch.save(build_model("cifar_cnn", num_classes=5, seed=0).state_dict(), foreign)
    (tmp_path / "images" / "cat").mkdir(parents=True)
    done = run_dask_train(
        "predict",
        str(CONFIGS / "digits_ddp.toml"),
        *_settings(store_dir),
        *("--model", str(foreign), "--input", str(tmp_path / "images")),
        *("--output", str(tmp_path / "out")),
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().count("\n") == 0 and "Traceback" not in done.stderr
    assert "five.pt: fc2.weight has shape (5, 64)" in done.stderr
    assert not (tmp_path / "out").exists()


def test_predict_rejects_a_bad_setting_with_exit_2_naming_the_field(tmp_path, checkpoint):
    done = run_dask_train(
        "predict",
        str(CONFIGS / "digits_ddp.toml"),
        *("--set", "predict.batch_sise=8"),
        *("--model", str(checkpoint), "--input", str(tmp_path), "--output", str(tmp_path / "o")),
    )
    assert done.returncode == 2
    assert "predict.batch_sise: unknown key" in done.stderr
    assert done.stderr.strip().count("\n") == 0 and "Traceback" not in done.stderr


def test_predict_from_python_names_its_keywords_and_fails_before_a_cluster_starts(
    tmp_path, checkpoint, digits_store
):
    from workflows import predict

    (tmp_path / "taken").mkdir()
    foreign = tmp_path / "five.pt"
    torch.save(build_model("cifar_cnn", num_classes=5, seed=0).state_dict(), foreign)
    # A scheduler nobody listens on: predict() reaching for its cluster first would fail on
    # that, not on the request.
    config = load_config(
        {
            "data": {"dataset": "digits", "store": str(digits_store)},
            "cluster": {"scheduler": "tcp://127.0.0.1:9", "connect_timeout_s": 1},
        }
    )
    request = {"model": checkpoint, "input": digits_store, "output": tmp_path / "new"}
    cases = [
        # The output is looked at first: before the model is built (a foreign checkpoint).
        ("output", {"model": foreign, "output": tmp_path / "taken"}, "taken exists"),
        ("model", {"model": tmp_path / "absent.pt"}, "absent.pt does not exist"),
        ("model", {"model": foreign}, "fc2.weight has shape (5, 64)"),
        ("input", {"input": tmp_path / "absent"}, "absent does not exist"),
    ]
    for keyword, given, why in cases:
        # ConfigError, or CheckpointError for a checkpoint of another shape: ValueErrors.
        with pytest.raises(ValueError) as caught:
            predict(**(request | given), config=config)
        message = str(caught.value)
        assert message.startswith(f"predict({keyword}=...): "), message
        assert why in message and "--" not in message and "\n" not in message, message
    assert not (tmp_path / "new").exists()
