"""Dask collections written into the zarr store as Dask tasks (data.collections = "store"), on
real clusters: what the store holds, who wrote it, equivalence with one process, bad data."""

from pathlib import Path

import dask.array as da
import dask.dataframe as dd
import numpy as np
import pandas as pd
import pytest
import torch
import zarr
from distributed import get_task_stream

from tests.reference import SGD_FEW_STEPS, assert_matches_one_process, train_in_one_process
from workers.sources import SourceError
from workflows.data.stores import read_manifest
from workflows.jobs.collections import DataError
from workflows.runs.driver import train

# Uneven partitions, as a user's collections have them; the store re-cuts them into chunks.
UNEVEN = (100, 37, 200, 13, 150, 60, 140)


def _uint8_images(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Learnable uint8 images (a bright quarter in the label's channel), int32 labels 0..3."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 4, n).astype(np.int32)
    x = rng.integers(0, 120, size=(n, 3, 8, 8)).astype(np.uint8)
    x[np.arange(n), y % 3, :4, :4] += 100
    return x, y


def _image_data() -> dict:
    x, y = _uint8_images(sum(UNEVEN) + 140, 0)
    n = sum(UNEVEN)
    return {
        "train": (da.from_array(x[:n], chunks=(UNEVEN, 3, 8, 8)), da.from_array(y[:n], chunks=50)),
        "val": (da.from_array(x[n:], chunks=(70, 3, 8, 8)), da.from_array(y[n:], chunks=70)),
    }


def _stored(make_config, tmp_path, **training):
    data = {"collections": "store", "store": str(tmp_path / "arrays"), "chunk_size": 64}
    base = SGD_FEW_STEPS | {"batch_size": 32, "seed": 3} | training
    return make_config({"name": "arrays", "data": data}, **base)


def test_collections_are_written_by_tasks_keeping_dtype_and_ddp_matches_one_process(
    cluster, make_config, tmp_path
):
    config = _stored(make_config, tmp_path, max_steps=5, epochs=1)
    with get_task_stream(cluster.client) as stream:
        result = train(config, cluster=cluster, data=_image_data(), on_event=None)
    # The chunks were written by tasks on the workers, not by the client.
    writers = {t["worker"] for t in stream.data if str(t["key"]).startswith("('store-map")}
    assert writers and writers <= set(cluster.client.scheduler_info()["workers"])

    group = zarr.open_group(str(tmp_path / "arrays"), mode="r")
    features, targets = group["train/features"], group["train/targets"]
    assert (features.dtype, features.shape, features.chunks) == (
        np.uint8,
        (sum(UNEVEN), 3, 8, 8),
        (64, 3, 8, 8),
    )
    assert (targets.dtype, targets.shape) == (np.int32, (sum(UNEVEN),))
    x, y = _uint8_images(sum(UNEVEN) + 140, 0)  # what _image_data cut into partitions
    np.testing.assert_array_equal(features[:], x[: sum(UNEVEN)])
    np.testing.assert_array_equal(targets[:], y[: sum(UNEVEN)])
    np.testing.assert_array_equal(group["val/targets"][:], y[sum(UNEVEN) :])
    assert group["val/features"].shape == (140, 3, 8, 8)
    manifest = read_manifest(str(tmp_path / "arrays"))
    assert manifest["counts"] == {"train": sum(UNEVEN), "val": 140}
    assert manifest["classes"] == ["0", "1", "2", "3"]
    assert result.store is not None and not result.store.reused

    # The ranks read it as they read an image store: DDP equals one process on the same batches.
    assert_matches_one_process(result.state_dict, config, world_size=2, steps=5, bugs=())
    untrained = train_in_one_process(config, world_size=2, steps=0)
    assert not torch.allclose(result.state_dict["fc2.weight"], untrained["fc2.weight"])

    # The same collections again: the complete store is reused, nothing is rewritten.
    with get_task_stream(cluster.client) as stream:
        again = train(config, cluster=cluster, data=_image_data(), on_event=None)
    assert again.store is not None and again.store.reused
    assert not [t for t in stream.data if str(t["key"]).startswith("('store-map")]


def test_collections_without_a_store_named_get_a_store_of_their_own(cluster):
    # The config's dataset (digits, by default) keeps its store: one named by the collections'
    # fingerprint is written instead, in the client's folder (this test's own).
    from workflows.runs.config import load_config

    raw = {"name": "arrays", "data": {"collections": "store", "chunk_size": 64}}
    config = load_config(raw | {"training": SGD_FEW_STEPS | {"batch_size": 32, "max_steps": 1}})
    result = train(config, cluster=cluster, data=_image_data(), on_event=None)
    assert result.store is not None
    url = Path(result.store.url)
    assert url.parent == Path("data/stores").resolve(), url
    assert url.name == f"collections-{result.store.fingerprint[:16]}"
    assert not Path("data/stores/digits").exists()


def test_a_regressor_trains_from_a_float64_dataframe_through_the_store(
    cluster, make_config, tmp_path
):
    from sklearn.metrics import mean_squared_error, r2_score

    from workers.models import build_model

    rng = np.random.default_rng(1)
    frame = pd.DataFrame(rng.normal(size=(900, 3)), columns=["a", "b", "c"])
    frame["price"] = 2 * frame.a - frame.b + 0.5 * frame.c
    train_frame = dd.from_pandas(frame[:600], npartitions=5)
    val_frame = dd.from_pandas(frame[600:], npartitions=3)
    features = ["a", "b", "c"]
    data = {
        "train": (train_frame[features], train_frame.price),
        "val": (val_frame[features], val_frame.price),
    }
    config = make_config(
        {
            "model": {"name": "tests.test_collections:tabular_regressor"},
            "data": {"collections": "store", "store": str(tmp_path / "frame"), "chunk_size": 50},
        },
        epochs=2,
        batch_size=60,
        lr=0.05,
        loss="mse",
    )
    result = train(config, cluster=cluster, data=data, on_event=None)
    group = zarr.open_group(str(tmp_path / "frame"), mode="r")
    assert group["train/features"].dtype == np.float64  # kept; the ranks read float32
    assert group["train/features"].shape == (600, 3)
    assert read_manifest(str(tmp_path / "frame"))["classes"] == []

    final = result.final
    model = build_model(config.model, num_classes=1, seed=0, input_shape=(3,))
    model.load_state_dict(result.state_dict)
    with torch.no_grad():
        predicted = model(torch.tensor(frame[features][600:].to_numpy(np.float32))).squeeze(1)
    truth = frame.price[600:].to_numpy()
    assert final["val_mse"] == pytest.approx(mean_squared_error(truth, predicted), rel=1e-4)
    assert final["val_r2"] == pytest.approx(r2_score(truth, predicted), rel=1e-4)
    assert final["val_r2"] > 0.5


@pytest.mark.parametrize("case", ["nan", "lengths", "labels", "foreign", "unreadable"])
def test_bad_data_fails_in_one_line_before_anything_is_written(
    cluster, make_config, tmp_path, case
):
    x = da.from_array(np.zeros((100, 4), np.float32), chunks=30)
    y = da.from_array(np.arange(100) % 3, chunks=30)
    expected, error = {
        "nan": (r"data\['val'\]: y has 1 rows with NaN", DataError),
        "lengths": (r"data\['train'\]: X has 100 rows but y has 99", DataError),
        "labels": (r"data\['train'\]: y must hold class labels", DataError),
        "foreign": (r"data.store: .* is not a dask-train dataset store", SourceError),
        # Neither absent nor foreign: a location that cannot be read is said to be so.
        "unreadable": (r"data.store: .* cannot be read: OSError: .*symbolic links", SourceError),
    }[case]
    data = {"train": (x, y), "val": (x, y)}
    if case == "nan":
        data["val"] = (x, da.from_array(np.where(np.arange(100) == 7, np.nan, 1.0), chunks=30))
    elif case == "lengths":
        data["train"] = (x, y[:99])
    elif case == "labels":
        data["train"] = (x, y - 1)
    store = tmp_path / "store"
    if case == "foreign":
        store.mkdir()
        (store / "precious.txt").write_text("not ours")
    elif case == "unreadable":
        store.mkdir()
        (store / "zarr.json").symlink_to(store / "zarr.json")  # a loop: ELOOP on every read
        (store / "precious.txt").write_text("not ours")
    config = make_config({"data": {"collections": "store", "store": str(store)}})
    with pytest.raises(error, match=expected) as raised:
        train(config, cluster=cluster, data=data, on_event=None)
    assert "\n" not in str(raised.value)
    if case in ("foreign", "unreadable"):
        assert (store / "precious.txt").read_text() == "not ours"
    else:
        assert not store.exists()  # checked before the first write


def _peak_resident_bytes() -> int:
    """This process's peak resident memory (VmHWM), after torch is imported as ranks do."""
    import torch  # noqa: F401

    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


@pytest.mark.slow
def test_data_twice_the_size_of_what_a_worker_may_hold_trains_from_the_store(
    own_cluster, make_config, tmp_path
):
    # 2 GiB of float32 samples made by Dask tasks: persisted, each worker would hold 1 GiB.
    rows, width, chunk = 1 << 19, 1024, 8192
    x = da.random.default_rng(0).random((rows, width), chunks=(chunk, width), dtype=np.float32)
    y = (x[:, 0] > 0.5).astype(np.int64)
    x_val = da.random.default_rng(1).random((512, width), chunks=(256, width), dtype=np.float32)
    data = {"train": (x, y), "val": (x_val, (x_val[:, 0] > 0.5).astype(np.int64))}
    config = make_config(
        {
            "model": {"name": "tests.test_collections:tabular_regressor"},
            "data": {"collections": "store", "store": str(tmp_path / "big"), "chunk_size": chunk},
        },
        epochs=1,
        max_steps=20,
        batch_size=64,
    )
    client = own_cluster.client
    before = client.run(_peak_resident_bytes)
    result = train(config, cluster=own_cluster, data=data, on_event=None)
    after = client.run(_peak_resident_bytes)

    assert result.history[-1]["step"] == 20
    assert zarr.open_group(str(tmp_path / "big"), mode="r")["train/features"].nbytes == 2 << 30
    # No worker came near holding its half (1 GiB): each held some 32 MiB chunks at a time. How
    # many depends on Dask's order and timing (an X chunk waits for y's task, which reads it
    # too): 212-213 MiB alone, 290 once in a whole suite's run. Half the half is the bound.
    grown = {worker: after[worker] - before[worker] for worker in before}
    assert max(grown.values()) < 512 << 20, grown


def test_parquet_files_go_through_the_store_once_and_again_when_they_change(
    cluster, make_config, tmp_path
):
    n = 1000
    frame = pd.DataFrame({"id": np.arange(n, dtype=np.float64), "b": np.arange(n) % 7})
    frame["label"] = np.arange(n) % 5
    frame["note"] = "text the features leave out"
    dd.from_pandas(frame, npartitions=5).to_parquet(tmp_path / "table")
    config = make_config(
        {
            "model": {"name": "tests.test_collections:tabular_regressor"},
            "data": {
                "dataset": "parquet",
                "root": str(tmp_path / "table"),
                "features": ["id", "b"],
                "target": "label",
                "collections": "store",
                "store": str(tmp_path / "store"),
            },
        },
        epochs=1,
        batch_size=50,
    )
    first = train(config, cluster=cluster, on_event=None)
    group = zarr.open_group(str(tmp_path / "store"), mode="r")
    ids = np.concatenate([group["train/features"][:, 0], group["val/features"][:, 0]])
    assert sorted(ids.astype(int).tolist()) == list(range(n))  # every row, once, in one split
    labels = np.concatenate([group["train/targets"][:], group["val/targets"][:]])
    np.testing.assert_array_equal(labels, ids.astype(int) % 5)  # rows stay paired

    again = train(config, cluster=cluster, on_event=None)
    assert not first.store.reused and again.store.reused
    # Changed files make other collections: the store is written anew.
    frame["b"] = frame["b"] + 1
    dd.from_pandas(frame, npartitions=5).to_parquet(tmp_path / "table", overwrite=True)
    changed = train(config, cluster=cluster, on_event=None)
    assert not changed.store.reused
    assert changed.store.fingerprint != first.store.fingerprint
