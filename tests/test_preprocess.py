"""The preprocessing graph on a real cluster equals a plain sequential computation."""

import importlib.util
import os
import pickle

import numpy as np
import pytest
import zarr
from distributed import get_task_stream
from PIL import Image

from tests.commands import run_python
from tests.datasets import write_image_folder, write_tiny_cifar10
from workers.data import DataConfig, open_store
from workers.sources import SourceError, list_records
from workflows.cluster.training_cluster import start_cluster
from workflows.data.preprocess import prepare_store
from workflows.data.stores import read_manifest


def _sequential_reference(train_images: np.ndarray, val_images: np.ndarray):
    """uint8 (n, 3, h, w) → the normalized float32 arrays, computed in one plain loop."""
    pixels = train_images.astype(np.float64) / 255
    mean, std = pixels.mean(axis=(0, 2, 3)), pixels.std(axis=(0, 2, 3))

    def normalize(images):
        scaled = images.astype(np.float32) / np.float32(255)
        return (scaled - mean.astype(np.float32)[:, None, None]) / std.astype(np.float32)[
            :, None, None
        ]

    return normalize(train_images), normalize(val_images), mean, std


def _stored(config):
    store = open_store(config.store_url)
    return (
        np.asarray(store.train.images[:]),
        store.train.labels,
        np.asarray(store.val.images[:]),
        store.val.labels,
    )


def test_cifar10_store_equals_the_sequential_reference(cluster, tmp_path):
    batches = write_tiny_cifar10(tmp_path / "raw", per_batch=7)
    config = DataConfig(
        dataset="cifar10", root=str(tmp_path / "raw"), store=str(tmp_path / "store"), chunk_size=8
    )
    manifest = prepare_store(cluster.client, config, seed=0)
    assert manifest.counts == {"train": 35, "val": 7} and not manifest.reused

    train_raw = np.concatenate([batches[f"data_batch_{i}"][0] for i in range(1, 6)])
    val_raw = batches["test_batch"][0]
    want_train, want_val, mean, std = _sequential_reference(
        train_raw.reshape(-1, 3, 32, 32), val_raw.reshape(-1, 3, 32, 32)
    )
    train_x, train_y, val_x, val_y = _stored(config)
    np.testing.assert_allclose(manifest.mean, mean, rtol=1e-10)
    np.testing.assert_allclose(manifest.std, std, rtol=1e-10)
    np.testing.assert_allclose(train_x, want_train, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(val_x, want_val, rtol=1e-5, atol=1e-5)
    assert train_y.tolist() == [v for i in range(1, 6) for v in batches[f"data_batch_{i}"][1]]
    assert val_y.tolist() == batches["test_batch"][1]


def test_image_folder_store_equals_the_sequential_reference(cluster, tmp_path):
    write_image_folder(tmp_path / "images", per_class=6)
    config = DataConfig(
        dataset="imagefolder",
        root=str(tmp_path / "images"),
        store=str(tmp_path / "store"),
        image_size=16,
        val_fraction=0.25,
        chunk_size=5,
    )
    manifest = prepare_store(cluster.client, config, seed=5)
    assert manifest.classes == ["cat", "dog", "eel"]
    listing = list_records(config, seed=5)

    def decode_sequentially(records):
        images = []
        for url, _ in records:
            with Image.open(url.removeprefix("file://")) as image:
                resized = image.convert("RGB").resize((16, 16), Image.Resampling.BILINEAR)
            images.append(np.asarray(resized).transpose(2, 0, 1))
        return np.stack(images), [label for _, label in records]

    train_raw, train_labels = decode_sequentially(listing.train)
    val_raw, val_labels = decode_sequentially(listing.val)
    want_train, want_val, _, _ = _sequential_reference(train_raw, val_raw)
    train_x, train_y, val_x, val_y = _stored(config)
    assert (len(train_y), len(val_y)) == (14, 4)
    np.testing.assert_allclose(train_x, want_train, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(val_x, want_val, rtol=1e-5, atol=1e-5)
    assert train_y.tolist() == train_labels and val_y.tolist() == val_labels


def _folder_config(tmp_path, **fields) -> DataConfig:
    return DataConfig(
        dataset="imagefolder",
        root=str(tmp_path / "images"),
        store=str(tmp_path / "store"),
        image_size=16,
        **fields,
    )


def test_second_run_reuses_the_store_and_a_changed_input_rebuilds_it(cluster, tmp_path):
    files = write_image_folder(tmp_path / "images")
    config = _folder_config(tmp_path)
    first = prepare_store(cluster.client, config, seed=0)
    stamp = os.stat(tmp_path / "store" / "zarr.json").st_mtime_ns

    with get_task_stream(client=cluster.client) as stream:
        again = prepare_store(cluster.client, config, seed=0)
    assert again.reused and again.fingerprint == first.fingerprint
    assert stream.data == []  # no task ran: the work was not redone
    assert os.stat(tmp_path / "store" / "zarr.json").st_mtime_ns == stamp

    before = os.stat(files[0])
    Image.fromarray(np.zeros((30, 30, 3), np.uint8)).save(files[0])
    # The listing stamps each file with its size and mtime. The mtime may not move (the kernel
    # takes it from a clock that ticks every few ms); the size does, whatever the clock.
    assert os.stat(files[0]).st_size != before.st_size
    with get_task_stream(client=cluster.client) as stream:
        rebuilt = prepare_store(cluster.client, config, seed=0)
    assert not rebuilt.reused and rebuilt.fingerprint != first.fingerprint
    keys = " ".join(str(t["key"]) for t in stream.data)
    assert "decode-train-" in keys and "normalize-train-" in keys  # readable task names


def test_a_half_written_store_is_rebuilt_not_reused(cluster, tmp_path):
    files = write_image_folder(tmp_path / "images")
    config = _folder_config(tmp_path)
    good = files[3].read_bytes()
    files[3].write_bytes(b"not an image")
    with pytest.raises(SourceError, match=rf"{files[3].name}: not a readable image"):
        prepare_store(cluster.client, config, seed=0)
    # The interrupted build left files behind, but no complete manifest.
    assert (tmp_path / "store").exists()
    assert read_manifest(config.store_url) is None
    files[3].write_bytes(good)
    manifest = prepare_store(cluster.client, config, seed=0)
    assert not manifest.reused and sum(manifest.counts.values()) == len(files)


def test_bad_records_can_be_skipped_and_counted(cluster, tmp_path):
    files = write_image_folder(tmp_path / "images")
    files[2].write_bytes(b"\x89PNG truncated")
    config = DataConfig(
        dataset="imagefolder",
        root=str(tmp_path / "images"),
        store=str(tmp_path / "store"),
        image_size=16,
        on_bad="skip",
    )
    manifest = prepare_store(cluster.client, config, seed=0)
    assert sum(manifest.counts.values()) == len(files) - 1
    assert [path for path, _ in manifest.bad_records] == [f"file://{files[2]}"]


def test_a_truncated_cifar_batch_is_named(cluster, tmp_path):
    write_tiny_cifar10(tmp_path / "raw")
    batch = tmp_path / "raw" / "cifar-10-batches-py" / "data_batch_4"
    batch.write_bytes(batch.read_bytes()[:200])
    config = DataConfig(dataset="cifar10", root=str(tmp_path / "raw"), store=str(tmp_path / "s"))
    with pytest.raises(SourceError, match=r"data_batch_4: not a readable CIFAR-10 batch"):
        prepare_store(cluster.client, config, seed=0)
    skipping = config.model_copy(update={"on_bad": "skip"})
    manifest = prepare_store(cluster.client, skipping, seed=0)
    assert manifest.counts["train"] == 4 * 6
    assert manifest.bad_records[0][0].endswith("data_batch_4")


@pytest.mark.parametrize(
    ("layout", "message"),
    [
        ("empty_class", r"class folder .*/images/dog holds no images"),
        ("val_only_class", r"/images/val has classes that .*/images/train lacks: fox"),
        ("no_classes", r"/images has no class folders"),
        ("missing", r"data\.root: .*/images is not a readable folder"),
    ],
)
def test_bad_layouts_fail_before_any_task_runs(cluster, tmp_path, layout, message):
    root = tmp_path / "images"
    if layout == "empty_class":
        write_image_folder(root, classes=("cat",))
        (root / "dog").mkdir()
    elif layout == "val_only_class":
        write_image_folder(root / "train", classes=("cat", "dog"))
        write_image_folder(root / "val", classes=("cat", "fox"))
    elif layout == "no_classes":
        root.mkdir()
    config = DataConfig(dataset="imagefolder", root=str(root), store=str(tmp_path / "store"))
    with (
        get_task_stream(client=cluster.client) as stream,
        pytest.raises(SourceError, match=message),
    ):
        prepare_store(cluster.client, config, seed=0)
    assert stream.data == []


def test_an_unreadable_url_is_a_clear_error(cluster, tmp_path):
    # A protocol fsspec knows whose package is not installed (ossfs); an unknown one is refused
    # as the config loads (tests/test_run_trust.py).
    if importlib.util.find_spec("ossfs") is not None:
        pytest.skip("ossfs is installed here: oss:// can be read")
    config = DataConfig(
        dataset="imagefolder", root="oss://bucket/images", store=str(tmp_path / "s")
    )
    with pytest.raises(SourceError, match=r"data\.root: cannot read oss://bucket/images"):
        prepare_store(cluster.client, config, seed=0)


@pytest.mark.slow
def test_out_of_core_preprocessing_with_small_workers(tmp_path):
    # 72,000 synthetic images: ~0.9 GB normalized, workers limited to 350 MB each: more than
    # both workers may hold together, and each worker's half more than it may hold alone.
    config = DataConfig(
        dataset="synthetic",
        synthetic_samples=72_000,
        store=str(tmp_path / "store"),
        chunk_size=2048,
    )
    # Nothing in the graph may import torch on the workers: that alone is ~400 MB.
    with start_cluster(n_workers=2, dashboard_port=0, memory_limit="350MB") as small:
        pids = small.client.run(os.getpid)
        manifest = prepare_store(small.client, config, seed=0)
        assert small.client.run(os.getpid) == pids  # same workers at the same addresses: no restart
    assert manifest.counts["train"] + manifest.counts["val"] == 72_000
    stored = [
        zarr.open_array(str(tmp_path / "store"), path=f"{split}/images", mode="r")
        for split in ("train", "val")
    ]
    assert sum(a.nbytes for a in stored) > 2.5 * 350e6  # what the workers may hold, and more
    sample = np.asarray(stored[0][:4096])
    assert abs(float(sample.mean())) < 0.1 and 0.8 < float(sample.std()) < 1.2


def test_pickled_cifar_labels_round_trip_through_the_listing(tmp_path):
    write_tiny_cifar10(tmp_path)
    listing = list_records(DataConfig(dataset="cifar10", root=str(tmp_path)), seed=0)
    assert [url.rsplit("/", 1)[-1] for url in listing.train] == [
        f"data_batch_{i}" for i in range(1, 6)
    ]
    with open(listing.val[0].removeprefix("file://"), "rb") as f:
        assert len(pickle.load(f, encoding="latin1")["labels"]) == 6


def test_a_store_path_holding_something_else_is_never_overwritten(cluster, tmp_path):
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "thesis.txt").write_text("do not delete")
    config = DataConfig(dataset="digits", store=str(precious))
    with pytest.raises(
        SourceError, match=r"data\.store: .*precious exists and is not a dask-train"
    ):
        prepare_store(cluster.client, config, seed=0)
    assert (precious / "thesis.txt").read_text() == "do not delete"


def test_the_digits_listing_counts_what_load_digits_returns_without_importing_it():
    from sklearn.datasets import load_digits

    from workers.sources.digits import digits_count

    # The client counts the lines of the file load_digits reads (no scikit-learn import on
    # every run); the workers decode with load_digits itself: the two must agree.
    assert digits_count() == len(load_digits().target) == 1797


def test_every_source_module_registers_the_source_its_name_says():
    import importlib
    import pkgutil
    import typing

    import workers.sources
    from workers.sources import (
        COLLECTION_SOURCES,
        PREDICTION_INPUTS,
        SOURCES,
        Source,
        StoreKind,
        get_source,
    )

    # Adding a source is one module: its name in SOURCES (and in its kind's table), its class
    # registered under it. The tables are what a config validates with, torch-free.
    modules = {m.name for m in pkgutil.iter_modules(workers.sources.__path__)}
    assert set(SOURCES) <= modules
    for name in modules:
        importlib.import_module(f"workers.sources.{name}")
    # Each source's module defines its one Source; the others (what the sources share) none.
    defined = [cls for cls in Source.__subclasses__() if cls.__module__.startswith("workers.")]
    assert sorted(cls.__module__ for cls in defined) == sorted(
        f"workers.sources.{name}" for name in SOURCES
    )
    assert {name: get_source(name).__module__ for name in SOURCES} == {
        n: f"workers.sources.{n}" for n in SOURCES
    }
    assert {name: get_source(name).name for name in SOURCES} == {n: n for n in SOURCES}
    kinds = {name: get_source(name).store for name in SOURCES}
    assert set(kinds.values()) <= set(typing.get_args(StoreKind))
    assert {n for n, kind in kinds.items() if kind == "text"} == {"text"}
    assert {n for n, kind in kinds.items() if kind == "collections"} == set(COLLECTION_SOURCES)
    for name in COLLECTION_SOURCES:
        assert get_source(name).collections.__func__ is not Source.collections.__func__, name
    # The sources predict scores are those that list inputs and read them, the folder of
    # images last.
    for method in ("prediction_input", "prediction_images"):
        scoring = {
            name
            for name in SOURCES
            if getattr(get_source(name), method).__func__ is not getattr(Source, method).__func__
        }
        assert scoring == set(PREDICTION_INPUTS), method
    assert PREDICTION_INPUTS[-1] == "imagefolder"
    with pytest.raises(SourceError, match="unknown dataset 'mnist'"):
        get_source("mnist")


def test_a_config_validates_without_importing_any_source_module():

    code = (
        "import sys\n"
        "from workers.spec.sections import DataConfig\n"
        "DataConfig(dataset='imagefolder', root='x')\n"
        "print(sorted(m for m in sys.modules if m.startswith('workers.sources.')))"
    )
    done = run_python(code, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
