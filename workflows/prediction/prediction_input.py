"""What ``predict`` scores, listed into partitions on the client.

An input is recognised by what it holds: a dataset store (``dask-train preprocess``'s, read
here: it is no raw source), else the first source in ``PREDICTION_INPUTS`` whose
``prediction_input`` claims it (``workers/sources/``: CIFAR-10's test batch, then a folder of
images). The sources raise SourceError naming the path; it reaches the caller as a ConfigError
with the same message, as every other refusal of ``--input`` does.
"""

from pathlib import Path
from typing import Any

import zarr

from workers.sources import (
    PREDICTION_INPUTS,
    InputPlan,
    InputRequest,
    Partition,
    SourceError,
    get_source,
    look_at_root,
)
from workers.spec.errors import ConfigError
from workflows.data.stores import read_manifest
from workflows.runs.run_storage import checked_url


def plan_input(source: str | Path, request: InputRequest) -> InputPlan:
    """List ``source`` (a path or URL) into partitions, as the first kind that claims it."""
    url = checked_url("--input", str(source))
    if "://" not in url:
        url = str(Path(url).expanduser().resolve())
    try:
        fs, path, found = look_at_root(
            url, request.storage_options, lambda fs, path: fs.exists(path), field="--input"
        )
    except SourceError as error:
        raise ConfigError(str(error)) from None
    if not found:
        raise ConfigError(f"--input: {url} does not exist")
    plan = store_input(fs, path, url, request)
    if plan is not None:
        return plan
    for name in PREDICTION_INPUTS:
        try:
            plan = get_source(name).prediction_input(fs, path, url, request)
        except SourceError as error:
            raise ConfigError(str(error)) from None
        if plan is not None:
            return plan
    raise ConfigError(
        f"--input: {url} is neither a dataset store, a CIFAR-10 test batch nor a folder of images"
    )


def store_input(fs: Any, path: str, url: str, request: InputRequest) -> InputPlan | None:
    """A dataset store's ``predict.split``, already normalized with the store's own statistics
    (re-normalized to the model's if they differ); None if ``url`` is no store."""
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
