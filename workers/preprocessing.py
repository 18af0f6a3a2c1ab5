"""The task functions of the preprocessing graph (see ``workflows/preprocess.py``).

numpy, PIL and zarr only: a preprocessing worker never pays for importing torch.
"""

from typing import Any

import numpy as np
import zarr

from workers.sources import OnBad, decode


def decode_partition(
    dataset: str,
    records: list[Any],
    *,
    url: str,
    component: str,
    image_size: int,
    seed: int,
    on_bad: OnBad,
    storage_options: dict[str, Any] | None,
) -> dict[str, Any]:
    """Decode and resize one partition and write it as ``component/{images,labels}``.

    Writing here, rather than returning the pixels, keeps every partition's memory on its
    worker only while the task runs: the graph stays out-of-core whatever the dataset's size.
    """
    decoded = decode(
        dataset,
        records,
        image_size=image_size,
        seed=seed,
        on_bad=on_bad,
        storage_options=storage_options,
    )
    options = storage_options or None
    chunks = (max(1, len(decoded.images)), 3, image_size, image_size)
    zarr.create_array(
        url,
        name=f"{component}/images",
        data=decoded.images,
        chunks=chunks,
        overwrite=True,
        storage_options=options,
    )
    zarr.create_array(
        url,
        name=f"{component}/labels",
        data=decoded.labels,
        overwrite=True,
        storage_options=options,
    )
    return {"count": len(decoded.labels), "bad": decoded.bad}


def normalize_block(
    block: np.ndarray,
    mean: np.ndarray,
    std: np.ndarray,
    *,
    url: str,
    path: str,
    storage_options: dict[str, Any] | None,
    block_info: dict | None = None,
) -> np.ndarray:
    """uint8 pixels → float32 with zero mean and unit variance per channel, written to its own
    region of ``url/path``; returns how many images it wrote."""
    assert block_info is not None
    start, stop = block_info[0]["array-location"][0]
    normalized = block.astype(np.float32)  # in place from here: one float copy per block
    normalized /= np.float32(255.0)
    normalized -= mean.astype(np.float32)[:, None, None]
    normalized /= std.astype(np.float32)[:, None, None]
    target = zarr.open_array(url, path=path, mode="r+", storage_options=storage_options or None)
    target[start:stop] = normalized
    return np.array([stop - start])


def squared_pixels(block: np.ndarray) -> np.ndarray:
    """x² of uint8 pixels, exact in uint32 (for the variance's sum of squares)."""
    return np.square(block, dtype=np.uint32)
