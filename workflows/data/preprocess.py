"""Preprocessing as Dask tasks: list → decode → resize → statistics → normalize → write.

The result is a zarr store that every training rank reads its own shard from::

    store/
      train/images  float32 (n, 3, size, size), normalized; chunked along samples
      train/labels  int64 (n,)
      val/images, val/labels
      attrs: the manifest (parameters, fingerprint, mean, std, counts, bad records)

The manifest is written last and carries ``complete = true``: a store left half-written by an
interrupted run is never taken for a finished one. Running again with the same inputs and
parameters reuses the store; any changed input file or parameter rebuilds it.
"""

import logging
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import zarr
from distributed import Client, Future

from workers.data import DataConfig
from workers.preprocessing import (
    StoreArray,
    combine_statistics,
    decode_partition,
    normalize_chunk,
)
from workers.sources import Decoding, Listing, SourceError, digest, list_records, store_to_build
from workflows.data.stores import (
    STORE_FORMAT,
    StoreManifest,
    gather_settled,
    manifest_of,
    reusable_store,
)

logger = logging.getLogger(__name__)


def prepare_store(
    client: Client, config: DataConfig, *, seed: int, force: bool = False
) -> StoreManifest:
    """Build the dataset store for ``config`` on the cluster, or reuse a complete one."""
    if store_to_build(config.dataset) == "text":
        from workflows.data.text_store import prepare_text_store

        return prepare_text_store(client, config, seed=seed, force=force)
    started = time.perf_counter()
    if config.dataset == "cifar10" and config.download:
        _download_cifar10(config)
    listing = list_records(config, seed=seed)
    fingerprint = _fingerprint(listing, config, seed)
    url = config.store_url
    reusable = reusable_store(url, config.storage_options, fingerprint, force=force)
    if reusable is not None:
        return manifest_of(url, reusable, reused=True, seconds=time.perf_counter() - started)
    attrs = _build(client, config, listing, fingerprint, seed)
    return manifest_of(url, attrs, reused=False, seconds=time.perf_counter() - started)


def _build(
    client: Client, config: DataConfig, listing: Listing, fingerprint: str, seed: int
) -> dict[str, Any]:
    """Build the store of ``listing`` in two graphs, decode then normalize, and mark it
    complete last; its attributes returned."""
    url, options = config.store_url, config.storage_options or None
    tag = fingerprint[:8]
    group = zarr.open_group(url, mode="w", storage_options=options)  # wipes the old store
    group.attrs.update({"format": STORE_FORMAT, "complete": False})  # ours, not finished
    decoded = _decode(client, config, listing, seed, tag=tag)
    bad = [tuple(r) for split in decoded.outcomes.values() for o in split for r in o["bad"]]
    counts = _normalize(client, config, decoded, bad=len(bad), tag=tag)

    group = zarr.open_group(url, mode="a", storage_options=options)
    del group["raw"]
    attrs = {
        "format": STORE_FORMAT,
        "fingerprint": fingerprint,
        "dataset": config.dataset,
        "image_size": config.image_size,
        "counts": counts,
        "mean": [float(v) for v in decoded.mean],
        "std": [float(v) for v in decoded.std],
        "classes": listing.classes,
        "bad_records": [list(record) for record in bad],
    }
    group.attrs.update(attrs)
    group.attrs["complete"] = True  # last: only now is the store visible as finished
    if bad:
        logger.warning("skipped %d bad records, e.g. %s: %s", len(bad), *bad[0])
    return {**attrs, "complete": True}


@dataclass(frozen=True)
class _Decoded:
    """What the decode graph gives the normalize graph: each split's outcomes, one a raw
    block (its component, count, labels and bad records), and the training images' per-channel
    mean and std."""

    outcomes: dict[str, list[dict[str, Any]]]
    mean: Any
    std: Any


def _decode(
    client: Client, config: DataConfig, listing: Listing, seed: int, *, tag: str
) -> _Decoded:
    """Decode and resize: one task per partition, each writing its own raw uint8 block and
    returning its count, labels, bad records and per-channel sums of x and x². Each split's
    outcomes, and the training images' mean and std."""
    url = config.store_url
    decoded: dict[str, list[Future]] = {}
    size = listing.partition_size
    how = Decoding(config.image_size, seed, config.on_bad, config.storage_options)
    for split, records in (("train", listing.train), ("val", listing.val)):
        decoded[split] = [
            client.submit(
                decode_partition,
                config.dataset,
                records[start : start + size],
                how,
                url=url,
                component=f"raw/{split}/{start // size:06d}",
                key=f"decode-{split}-{start // size:06d}-{tag}",
                pure=False,
            )
            for start in range(0, len(records), size)
        ]
    # Statistics: a Dask reduction of the training partitions' sums. Pixels are integers, so
    # the sums are exact in uint64; mean and std are then one float64 division away.
    statistics = client.submit(
        combine_statistics, decoded["train"], key=f"statistics-train-{tag}", pure=False
    )
    results = gather_settled(client, [*decoded["train"], *decoded["val"], statistics])
    n_train = len(decoded["train"])
    mean, std = results[-1]
    return _Decoded({"train": results[:n_train], "val": results[n_train:-1]}, mean, std)


def _normalize(
    client: Client, config: DataConfig, decoded: _Decoded, *, bad: int, tag: str
) -> dict[str, int]:
    """Normalize and write: one task per store chunk, reading the raw blocks it overlaps and
    writing its own region (chunks never overlap, so no locks are needed). The samples of
    each split."""
    url, options = config.store_url, config.storage_options or None
    counts = {}
    writes = []
    for split, parts in decoded.outcomes.items():
        blocks = [(o["component"], o["count"]) for o in parts if o["count"]]
        total = sum(count for _, count in blocks)
        if not total:
            raise SourceError(f"data.root: no readable {split} images ({bad} bad records)")
        shape = (total, 3, config.image_size, config.image_size)
        zarr.create_array(
            url,
            name=f"{split}/images",
            shape=shape,
            dtype=np.float32,
            overwrite=True,
            chunks=(config.chunk_size, *shape[1:]),
            # Normalized floats barely compress, and every rank decompresses its chunks on the
            # cores that train: store them as they are.
            compressors=None,
            storage_options=options,
        )
        for index, start in enumerate(range(0, total, config.chunk_size)):
            writes.append(
                client.submit(
                    normalize_chunk,
                    StoreArray(url, f"{split}/images", config.storage_options),
                    blocks,
                    start,
                    min(total, start + config.chunk_size),
                    mean=decoded.mean,
                    std=decoded.std,
                    key=f"normalize-{split}-{index:06d}-{tag}",
                    pure=False,
                )
            )
        labels = np.concatenate([o["labels"] for o in parts])
        zarr.create_array(
            url, name=f"{split}/labels", data=labels, overwrite=True, storage_options=options
        )
        counts[split] = len(labels)
    gather_settled(client, writes)
    return counts


def _fingerprint(listing: Listing, config: DataConfig, seed: int) -> str:
    params = (
        STORE_FORMAT,
        config.dataset,
        config.image_size,
        config.val_fraction,
        config.synthetic_samples,
        config.on_bad,
        config.chunk_size,
        seed,
    )
    return digest(listing.fingerprint, params, listing.train, listing.val)


def _download_cifar10(config: DataConfig) -> None:
    from torchvision.datasets import CIFAR10

    assert config.root is not None
    CIFAR10(config.root, train=True, download=True)
