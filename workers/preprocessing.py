"""The task functions of the preprocessing graph (see ``workflows/data/preprocess.py``).

numpy, PIL and zarr only: a preprocessing worker never pays for importing torch.
"""

from dataclasses import dataclass
from typing import Any

import numpy as np
import zarr

from workers.sources import Decoding, decode


def decode_partition(
    dataset: str, records: list[Any], how: Decoding, *, url: str, component: str
) -> dict[str, Any]:
    """Decode and resize one partition and write its images as ``component/images``.

    Writing here, rather than returning the pixels, keeps every partition's memory on its
    worker only while the task runs: the graph stays out-of-core whatever the dataset's size.
    """
    decoded = decode(dataset, records, how)
    options, size = how.storage_options or None, how.image_size
    chunks = (max(1, len(decoded.images)), 3, size, size)
    zarr.create_array(
        url,
        name=f"{component}/images",
        data=decoded.images,
        chunks=chunks,
        overwrite=True,
        storage_options=options,
    )
    sums = np.stack(
        [
            decoded.images.sum(axis=(0, 2, 3), dtype=np.uint64),
            np.square(decoded.images, dtype=np.uint32).sum(axis=(0, 2, 3), dtype=np.uint64),
        ]
    )
    return {
        "component": component,
        "count": len(decoded.labels),
        "labels": decoded.labels,
        "bad": decoded.bad,
        "pixels": len(decoded.labels) * size * size,
        "sums": sums,  # per channel: Σx and Σx² of the uint8 pixels, exact
    }


def combine_statistics(outcomes: list[dict[str, Any]]) -> tuple[np.ndarray, np.ndarray]:
    """Per-channel mean and std of the pixels scaled to [0, 1], from the partitions' sums."""
    pixels = sum(outcome["pixels"] for outcome in outcomes)
    if not pixels:
        return np.zeros(3), np.ones(3)
    s1, s2 = sum(outcome["sums"] for outcome in outcomes).astype(np.float64)
    mean = s1 / pixels / 255.0
    variance = np.maximum(s2 / pixels / 255.0**2 - mean**2, 0.0)
    return mean, np.maximum(np.sqrt(variance), 1e-6)


@dataclass(frozen=True)
class StoreArray:
    """One array of a store being built: the store's URL (``storage_options``: its
    filesystem's) and the array's path in it."""

    url: str
    path: str
    storage_options: dict[str, Any] | None = None


def normalize_chunk(
    target: StoreArray,
    blocks: list[tuple[str, int]],
    start: int,
    stop: int,
    *,
    mean: np.ndarray,
    std: np.ndarray,
) -> int:
    """Normalize samples ``start:stop`` of the concatenated raw blocks (``component/images``
    in the target's store) and write them to the same rows of ``target``; returns how many it
    wrote."""
    url, options = target.url, target.storage_options or None
    pieces, offset = [], 0
    for component, count in blocks:
        lo, hi = max(start, offset), min(stop, offset + count)
        if lo < hi:
            raw = zarr.open_array(url, path=f"{component}/images", storage_options=options)
            pieces.append(np.asarray(raw[lo - offset : hi - offset]))
        offset += count
    normalized = normalize_images(np.concatenate(pieces), mean, std)
    written = zarr.open_array(url, path=target.path, mode="r+", storage_options=options)
    written[start:stop] = normalized
    return stop - start


def normalize_images(raw: np.ndarray, mean: Any, std: Any) -> np.ndarray:
    """uint8 ``(n, 3, h, w)`` pixels → float32 normalized with per-channel ``mean`` and ``std``
    of the pixels scaled to [0, 1]. The one definition of normalization: the store is written
    with it and batch inference applies it to raw images, so both give the same floats."""
    mean, std = np.asarray(mean, dtype=np.float32), np.asarray(std, dtype=np.float32)
    normalized = raw.astype(np.float32)  # in place from here on
    normalized /= np.float32(255.0)
    normalized -= mean[:, None, None]
    normalized /= std[:, None, None]
    return normalized
