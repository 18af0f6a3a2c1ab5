"""Per-rank loading from the store: every sample once per epoch, deterministic, lazy."""

import contextlib
import importlib.metadata
import json
import pickle
import shutil
import threading
import time

import numpy as np
import pytest
import torch
import zarr
from packaging.version import Version

from workers import data
from workers.data import (
    WORKER_CHUNKS,
    BatchShare,
    DataConfig,
    RankBatches,
    SampleOrder,
    eval_batches,
    fixed_shape_eval_batches,
    open_store,
    rank_epoch_indices,
)
from workflows.data.preprocess import prepare_store


@pytest.mark.parametrize(
    ("n", "world_size", "chunk_size", "drop_last"),
    [
        (40, 2, 8, False),
        (41, 2, 8, False),
        (41, 2, 8, True),
        (30, 3, 7, False),
        (1000, 4, 64, True),
    ],
)
def test_every_sample_once_per_epoch_across_ranks(n, world_size, chunk_size, drop_last):
    def shards(epoch, seed=1):
        return [
            rank_epoch_indices(
                SampleOrder(
                    n, seed=seed, chunk_size=chunk_size, shuffle_window=2, drop_last=drop_last
                ),
                epoch=epoch,
                rank=r,
                world_size=world_size,
            )
            for r in range(world_size)
        ]

    for epoch in range(3):
        flat = np.concatenate(shards(epoch))
        assert len({len(s) for s in shards(epoch)}) == 1  # equal shares: equal step counts
        if drop_last:
            assert len(flat) == (n // world_size) * world_size
            assert len(set(flat.tolist())) == len(flat)  # no sample twice
        else:
            # Padded with repeats up to a multiple of the world size, like DistributedSampler.
            assert len(flat) == -(-n // world_size) * world_size
            assert set(flat.tolist()) == set(range(n))
    assert all(np.array_equal(a, b) for a, b in zip(shards(0), shards(0), strict=True))
    assert not np.array_equal(np.concatenate(shards(0)), np.concatenate(shards(1)))
    assert not np.array_equal(np.concatenate(shards(0)), np.concatenate(shards(0, seed=2)))


def test_a_rank_touches_only_a_few_chunks_per_window():
    # Contiguous shares of a chunk-shuffled order: each rank reads about half of the chunks.
    n, chunk = 64 * 32, 64
    order = SampleOrder(n, seed=0, chunk_size=chunk, shuffle_window=4, drop_last=False)
    share = rank_epoch_indices(order, epoch=0, rank=0, world_size=2)
    assert len(np.unique(share // chunk)) <= 32 // 2 + 1
    for start in range(0, len(share), 32):  # any batch of 32 spans at most two windows
        assert len(np.unique(share[start : start + 32] // chunk)) <= 8


@pytest.fixture(scope="module")
def digits_store(cluster, store_dir):
    config = DataConfig(dataset="digits", store=str(store_dir / "digits"), chunk_size=128)
    prepare_store(cluster.client, config, seed=0)
    return config


def _collect(batches, epoch):
    xs, ys = zip(*batches.epoch(epoch), strict=True)
    return torch.cat(xs), torch.cat(ys)


def test_rank_batches_read_exactly_the_indexed_samples(digits_store):
    store = open_store(digits_store.store_url)
    everything = torch.from_numpy(np.asarray(store.train.images[:]))
    batches = RankBatches(
        store.train, digits_store, BatchShare(rank=1, world_size=2, batch_size=50), seed=4
    )
    x, y = _collect(batches, epoch=2)
    index = torch.from_numpy(batches.indices(2))
    assert torch.equal(x, everything[index])
    assert torch.equal(y, torch.from_numpy(store.train.labels)[index])
    assert len(batches) == -(-len(index) // 50)
    # Every replica holds an equal share, so a step's rows for the job (its samples/s) are
    # this rank's batch times the replicas, the last partial batch and drop_last's cut too.
    for config in (digits_store, digits_store.model_copy(update={"drop_last": True})):
        batches = RankBatches(
            store.train, config, BatchShare(rank=1, world_size=2, batch_size=50), seed=4
        )
        sizes = [len(y) for _, y in batches.epoch(0)]
        assert [batches.job_rows(step) for step in range(len(batches))] == [2 * n for n in sizes]


def test_a_warm_workers_next_job_reuses_the_store_and_a_rebuilt_one_is_read_again(
    digits_store, tmp_path
):
    # A copy: this test rewrites it as a rebuild for other inputs would.
    url = str(tmp_path / "digits")
    shutil.copytree(digits_store.store_url, url)
    config = digits_store.model_copy(update={"store": url})
    WORKER_CHUNKS.clear()

    def first_epoch(store):
        return _collect(
            RankBatches(
                store.train, config, BatchShare(rank=0, world_size=2, batch_size=32), seed=0
            ),
            0,
        )

    store = open_store(url)
    x, _ = first_epoch(store)
    index = torch.from_numpy(
        RankBatches(
            store.train, config, BatchShare(rank=0, world_size=2, batch_size=32), seed=0
        ).indices(0)
    )
    assert torch.equal(x, torch.from_numpy(np.asarray(store.train.images[:]))[index])
    # The next job on this worker: the same opened store, its chunks from memory, same batches.
    again = open_store(url)
    assert again is store
    fingerprint = zarr.open_group(url, mode="r").attrs["fingerprint"]
    assert WORKER_CHUNKS.get((url, fingerprint, "train", 0)) is not None
    assert torch.equal(first_epoch(again)[0], x)

    # Rebuilt for other inputs: another fingerprint, other samples; nothing stale is served.
    group = zarr.open_group(url, mode="r+")
    group["train/images"][:] = np.asarray(group["train/images"][:]) + 1
    group.attrs["fingerprint"] = "rebuilt-for-other-inputs"
    rebuilt = open_store(url)
    assert rebuilt is not store
    assert torch.equal(first_epoch(rebuilt)[0], x + 1)

    # Being rebuilt (not complete): refused, not served from memory.
    group.attrs["complete"] = False
    with pytest.raises(FileNotFoundError):
        open_store(url)


def test_in_memory_prefetched_and_lazy_reads_give_the_same_batches(digits_store):
    store = open_store(digits_store.store_url)
    variants = [
        digits_store,
        digits_store.model_copy(update={"in_memory": True}),
        digits_store.model_copy(update={"prefetch_batches": 0}),
    ]
    results = [
        _collect(
            RankBatches(store.train, c, BatchShare(rank=0, world_size=2, batch_size=32), seed=0), 1
        )
        for c in variants
    ]
    for x, y in results[1:]:
        assert torch.equal(x, results[0][0]) and torch.equal(y, results[0][1])


def test_a_rank_that_stops_mid_epoch_ends_its_prefetch_thread_without_waiting_for_its_poll(
    monkeypatch,
):
    # A run that stops before its epoch's end (max_steps, a resize, a stop) closes its batches;
    # the prefetch thread, waiting for room in the full queue, must end then, not at its next
    # look (before: up to 0.1 s on every such job; here the look would come after a minute,
    # past the 5 s the close waits for the thread, which would still be alive).
    monkeypatch.setattr(data, "HAND_OVER_POLL_S", 60.0)
    read = []

    def batches():
        for batch in range(100):
            read.append(batch)
            yield batch

    prefetched = data._prefetched(batches(), depth=1)
    assert next(prefetched) == 0
    while len(read) < 3:  # 1 waits in the queue, 2 for room in it
        time.sleep(0.01)
    time.sleep(0.2)  # well into its wait for room
    prefetched.close()
    assert not [t for t in threading.enumerate() if t.name == "dask-train-prefetch"]
    assert read == [0, 1, 2]  # nothing read after the stop


def test_augmentation_is_seeded_per_epoch_and_keeps_shapes(digits_store):
    store = open_store(digits_store.store_url)
    augmented = digits_store.model_copy(update={"augment": True})

    def batches(config):
        return RankBatches(
            store.train, config, BatchShare(rank=0, world_size=1, batch_size=64), seed=0
        )

    plain = _collect(batches(digits_store), 0)[0]
    first = _collect(batches(augmented), 0)[0]
    assert first.shape == plain.shape
    assert not torch.equal(first, plain)
    assert torch.equal(first, _collect(batches(augmented), 0)[0])  # same seed, same crops
    assert not torch.equal(first, _collect(batches(augmented), 1)[0])  # new epoch, new crops


def test_validation_shares_cover_the_split_once(digits_store):
    store = open_store(digits_store.store_url)
    seen = torch.cat(
        [
            y
            for r in range(3)
            for _, y in eval_batches(store.val, rank=r, world_size=3, batch_size=16)
        ]
    )
    assert torch.equal(seen, torch.from_numpy(store.val.labels))


def test_an_incomplete_store_is_refused(tmp_path):
    import zarr

    zarr.open_group(str(tmp_path / "half"), mode="w")
    with pytest.raises(FileNotFoundError, match="holds no complete dataset store"):
        open_store(str(tmp_path / "half"))


def test_fixed_shape_eval_batches_pad_the_tail_and_give_every_rank_as_many_batches(digits_store):
    # Pipelines need one batch shape and sharded replicas need equal batch counts.
    split = open_store(digits_store.store_url).val
    n, world, batch = len(split), 3, 64
    per_rank = [
        list(fixed_shape_eval_batches(split, rank=r, world_size=world, batch_size=batch))
        for r in range(world)
    ]
    assert len({len(batches) for batches in per_rank}) == 1
    assert all(x.shape == (batch, *split.images.shape[1:]) for b in per_rank for x, _, _ in b)
    assert sum(real for b in per_rank for _, _, real in b) == n
    labels = torch.cat([y[:real] for b in per_rank for _, y, real in b])
    assert labels.tolist() == split.labels.tolist()  # each sample once, in order


# -- a planted store ---------------------------------------------------------------------------


class _Touch:
    """What a planted chunk unpickles to: a command that creates ``marker``."""

    def __init__(self, marker) -> None:
        self.marker = marker

    def __reduce__(self):
        return (__import__("os").system, (f"touch {self.marker}",))


def _store_with_pickled_labels(root, marker) -> None:
    """A complete store as dask-train's manifest says, in zarr's format 2, whose train labels
    are Python objects (dtype |O) behind numcodecs' pickle filter, their chunk a payload."""
    group = zarr.open_group(root, mode="w", zarr_format=2)
    group.attrs.update({"complete": True, "fingerprint": "planted", "classes": ["a", "b"]})
    for split in ("train", "val"):
        group.create_array(f"{split}/images", data=np.zeros((1, 3, 4, 4), np.float32))
        group.create_array(f"{split}/labels", data=np.zeros(1, np.int64))
    labels = root / "train" / "labels"
    meta = json.loads((labels / ".zarray").read_text())
    # zarr takes the first filter for the objects' codec (vlen-utf8); the pickle filter runs
    # before it, on the chunk's bytes.
    meta |= {"dtype": "|O", "filters": [{"id": "vlen-utf8"}, {"id": "pickle"}], "compressor": None}
    (labels / ".zarray").write_text(json.dumps(meta))
    (labels / "0").write_bytes(pickle.dumps(_Touch(marker)))


def test_a_store_whose_arrays_a_codec_would_unpickle_is_refused_unread(tmp_path, monkeypatch):
    import numcodecs.pickles

    # The pinned numcodecs refuses to unpickle on its own; older releases, or a process with
    # NUMCODECS_ALLOW_UNSAFE_PICKLE_DECODE=1 in its environment, do not: as here.
    assert Version(importlib.metadata.version("numcodecs")) >= Version("0.16.6")
    monkeypatch.setattr(numcodecs.pickles, "ALLOW_UNSAFE_PICKLE_DECODE", True)
    store, marker = tmp_path / "store", tmp_path / "payload-ran"
    _store_with_pickled_labels(store, marker)
    with contextlib.suppress(Exception):  # what the objects become does not matter
        zarr.open_group(store, mode="r")["train/labels"][:]
    assert marker.exists(), "the store's payload does not run even when zarr reads it"
    marker.unlink()

    with pytest.raises(data.StoreRefused) as refused:
        open_store(str(store))
    assert str(refused.value) == (
        f"data.store: {store}/train/labels holds StringDType() values, not numbers: refused unread"
    )
    assert not marker.exists()
    # A codec no store of ours uses is refused too, on an array of numbers: the list is of
    # what may be, not of what may not.
    labels = store / "train" / "labels"
    meta = json.loads((labels / ".zarray").read_text())
    scaled = {"id": "fixedscaleoffset", "offset": 0, "scale": 1, "dtype": "<i8"}
    (labels / ".zarray").write_text(json.dumps(meta | {"dtype": "<i8", "filters": [scaled]}))
    with pytest.raises(data.StoreRefused, match=r"labels is encoded with fixedscaleoffset, which"):
        open_store(str(store))
    assert not marker.exists()
