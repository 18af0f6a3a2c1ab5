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

import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any

import dask
import dask.array as da
import numpy as np
import zarr
from distributed import Client, wait

from workers.data import DataConfig
from workers.preprocessing import decode_partition, normalize_block, squared_pixels
from workers.sources import Listing, SourceError, digest, list_records

logger = logging.getLogger(__name__)

STORE_FORMAT = 1


@dataclass(frozen=True)
class StoreManifest:
    url: str
    fingerprint: str
    counts: dict[str, int]
    mean: list[float]
    std: list[float]
    classes: list[str]
    bad_records: list[tuple[str, str]]
    reused: bool
    seconds: float

    @property
    def num_classes(self) -> int:
        return len(self.classes)


def prepare_store(
    client: Client, config: DataConfig, *, seed: int, force: bool = False
) -> StoreManifest:
    """Build the dataset store for ``config`` on the cluster, or reuse a complete one."""
    started = time.perf_counter()
    if config.dataset == "cifar10" and config.download:
        _download_cifar10(config)
    listing = list_records(
        config.dataset,
        root=config.root,
        val_fraction=config.val_fraction,
        seed=seed,
        synthetic_samples=config.synthetic_samples,
        storage_options=config.storage_options,
    )
    fingerprint = _fingerprint(listing, config, seed)
    url = config.store_url
    existing = read_manifest(url, storage_options=config.storage_options)
    if existing is not None and existing.get("fingerprint") == fingerprint and not force:
        logger.info("reusing the complete store at %s", url)
        return _manifest(url, existing, reused=True, seconds=time.perf_counter() - started)
    if existing is None and _has_content(url, config.storage_options):
        logger.warning("rebuilding %s: it holds no complete store (an interrupted run?)", url)
    attrs = _build(client, config, listing, fingerprint, seed)
    return _manifest(url, attrs, reused=False, seconds=time.perf_counter() - started)


def read_manifest(url: str, *, storage_options: dict[str, Any] | None = None) -> dict | None:
    """The manifest of a complete store at ``url``, or None (absent, half-written, other format)."""
    try:
        group = zarr.open_group(url, mode="r", storage_options=storage_options or None)
    except (FileNotFoundError, zarr.errors.GroupNotFoundError, ValueError, KeyError):
        return None
    attrs = dict(group.attrs)
    if attrs.get("complete") is not True or attrs.get("format") != STORE_FORMAT:
        return None
    return attrs


def _build(
    client: Client, config: DataConfig, listing: Listing, fingerprint: str, seed: int
) -> dict[str, Any]:
    url, options = config.store_url, config.storage_options or None
    tag = fingerprint[:8]
    zarr.open_group(url, mode="w", storage_options=options)  # wipes whatever was there

    # Decode and resize: one task per partition, each writing its own raw uint8 block.
    tasks, parts = [], {}
    for split, records in (("train", listing.train), ("val", listing.val)):
        size = listing.partition_size
        parts[split] = [f"raw/{split}/{i:05d}" for i in range(-(-len(records) // size))]
        for i, component in enumerate(parts[split]):
            tasks.append(
                dask.delayed(decode_partition, pure=False)(
                    config.dataset,
                    records[i * size : (i + 1) * size],
                    url=url,
                    component=component,
                    image_size=config.image_size,
                    seed=seed,
                    on_bad=config.on_bad,
                    storage_options=config.storage_options,
                    dask_key_name=f"decode-{split}-{i:05d}-{tag}",
                )
            )
    components = [c for split_parts in parts.values() for c in split_parts]
    outcomes = dict(zip(components, _gather_settled(client, tasks), strict=True))
    bad = [tuple(record) for outcome in outcomes.values() for record in outcome["bad"]]
    raw = {}
    for split, components in parts.items():
        blocks = [
            da.from_zarr(url, component=f"{c}/images", storage_options=options)
            for c in components
            if outcomes[c]["count"]
        ]
        if not blocks:
            raise SourceError(f"data.root: no readable {split} images ({len(bad)} bad records)")
        raw[split] = da.concatenate(blocks)

    # Statistics: a Dask reduction over the training split. Pixels are integers, so the sums
    # of x and x² are exact in uint64 and mean/std come out exact, with uint8/uint32 blocks
    # only (a float64 copy of each block would triple the workers' memory).
    train = raw["train"]
    s1, s2 = client.compute(
        [
            train.sum(axis=(0, 2, 3), dtype=np.uint64),
            train.map_blocks(squared_pixels, dtype=np.uint32).sum(axis=(0, 2, 3), dtype=np.uint64),
        ],
        sync=True,
    )
    n = train.shape[0] * train.shape[2] * train.shape[3]
    mean = s1.astype(np.float64) / n / 255.0
    std = np.sqrt(np.maximum(s2.astype(np.float64) / n / 255.0**2 - mean**2, 0.0))
    std = np.maximum(std, 1e-6)

    # Normalize and write, chunked along samples for the ranks' reads: one task per chunk,
    # named normalize-…, that writes its own region (chunks never overlap, so no locks).
    counts = {}
    for split, images in raw.items():
        chunks = (config.chunk_size, 3, config.image_size, config.image_size)
        zarr.create_array(
            url,
            name=f"{split}/images",
            shape=images.shape,
            chunks=chunks,
            dtype=np.float32,
            overwrite=True,
            storage_options=options,
        )
        written = images.rechunk(chunks).map_blocks(
            normalize_block,
            mean,
            std,
            url=url,
            path=f"{split}/images",
            storage_options=config.storage_options,
            dtype=np.int64,
            chunks=(1,),
            drop_axis=[1, 2, 3],
            name=f"normalize-{split}-{tag}",
        )
        if int(client.compute(written, sync=True).sum()) != images.shape[0]:
            raise RuntimeError(f"normalize-{split}: not every image was written")
        labels = np.concatenate(
            [
                np.asarray(
                    zarr.open_array(url, path=f"{c}/labels", mode="r", storage_options=options)[:]
                )
                for c in parts[split]
                if outcomes[c]["count"]
            ]
        )
        zarr.create_array(
            url, name=f"{split}/labels", data=labels, overwrite=True, storage_options=options
        )
        counts[split] = len(labels)

    group = zarr.open_group(url, mode="a", storage_options=options)
    del group["raw"]
    attrs = {
        "format": STORE_FORMAT,
        "fingerprint": fingerprint,
        "dataset": config.dataset,
        "image_size": config.image_size,
        "counts": counts,
        "mean": [float(v) for v in mean],
        "std": [float(v) for v in std],
        "classes": listing.classes,
        "bad_records": [list(record) for record in bad],
    }
    group.attrs.update(attrs)
    group.attrs["complete"] = True  # last: only now is the store visible as finished
    if bad:
        logger.warning("skipped %d bad records, e.g. %s: %s", len(bad), *bad[0])
    return {**attrs, "complete": True}


def _gather_settled(client: Client, tasks: list[Any]) -> list[Any]:
    """Results of all tasks; on the first failure, wait until the others have finished too, so
    that none of them still writes into the store when the caller (or a rebuild) moves on."""
    futures = client.compute(tasks)
    try:
        return client.gather(futures)
    except BaseException:
        # Partitions are small, so letting the running ones finish is quick; cancelling would
        # not stop a task already writing.
        with contextlib.suppress(Exception):
            wait(futures, timeout=120)
        client.cancel(futures)
        raise


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


def _manifest(url: str, attrs: dict[str, Any], *, reused: bool, seconds: float) -> StoreManifest:
    return StoreManifest(
        url=url,
        fingerprint=attrs["fingerprint"],
        counts=dict(attrs["counts"]),
        mean=list(attrs["mean"]),
        std=list(attrs["std"]),
        classes=list(attrs["classes"]),
        bad_records=[tuple(r) for r in attrs["bad_records"]],
        reused=reused,
        seconds=seconds,
    )


def _has_content(url: str, storage_options: dict[str, Any] | None) -> bool:
    import fsspec

    fs, path = fsspec.core.url_to_fs(url, **(storage_options or {}))
    return fs.exists(path)


def _download_cifar10(config: DataConfig) -> None:
    from torchvision.datasets import CIFAR10

    assert config.root is not None
    CIFAR10(config.root, train=True, download=True)
