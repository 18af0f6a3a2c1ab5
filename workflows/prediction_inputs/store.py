"""A dataset store (``dask-train preprocess``'s): its ``predict.split``, already normalized
with the store's own statistics (re-normalized to the model's if they differ)."""

from typing import Any

import zarr

from workers.inference import Partition
from workflows.config import ConfigError
from workflows.prediction_inputs import InputPlan, InputRequest
from workflows.stores import read_manifest


def plan(fs: Any, path: str, url: str, request: InputRequest) -> InputPlan | None:
    if not fs.isfile(f"{path}/zarr.json"):
        return None
    options = request.storage_options
    manifest = read_manifest(url, storage_options=options)
    if manifest is None:
        raise ConfigError(
            f"--input: {url} holds no complete dataset store (interrupted preprocessing?); "
            "run dask-train preprocess again"
        )
    group = zarr.open_group(url, mode="r", storage_options=options or None)
    split = request.split
    if f"{split}/images" not in group:
        raise ConfigError(f"predict.split: the store {url} has no {split!r} split")
    images = group[f"{split}/images"]
    shape = tuple(images.shape[1:])
    channels, size = request.channels, request.image_size
    if len(shape) != 3 or shape[0] != channels:
        raise ConfigError(
            f"--input: {url} holds images of shape {shape}: {shape[0] if shape else 0} channels, "
            f"but the model takes {channels} (its first convolution)"
        )
    if shape != (channels, size, size):
        raise ConfigError(
            f"--input: {url} holds {shape[1]}x{shape[2]} images, but the model was trained on "
            f"{size}x{size} (data.image_size = {size}); preprocess the input at that size"
        )
    parts = [
        Partition(i, lo, hi, "store", url, split=split, rows=(lo, hi))
        for i, (lo, hi) in enumerate(request.ranges(int(images.shape[0])))
    ]
    return InputPlan(
        "store", url, parts, list(manifest["classes"]), manifest["mean"], manifest["std"]
    )
