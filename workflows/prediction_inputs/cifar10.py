"""CIFAR-10's test batch: the file itself, or the CIFAR-10 folder (or the folder above it)
that holds it; decoded by the training source's reader (``workers/sources/cifar10.py``)."""

import pickle
from typing import Any

import numpy as np

from workers.inference import Partition
from workers.sources.cifar10 import CIFAR_FOLDER, CIFAR_TEST
from workflows.config import ConfigError
from workflows.prediction_inputs import InputPlan, InputRequest

(TEST_BATCH,) = CIFAR_TEST


def plan(fs: Any, path: str, url: str, request: InputRequest) -> InputPlan | None:
    batch = _test_batch(fs, path)
    if batch is None:
        return None
    batch_url = fs.unstrip_protocol(batch)
    parts = [
        Partition(i, lo, hi, "cifar10", batch_url, rows=(lo, hi))
        for i, (lo, hi) in enumerate(request.ranges(_count(fs, batch)))
    ]
    return InputPlan("cifar10", batch_url, parts, [f"class{i}" for i in range(10)])


def _test_batch(fs: Any, path: str) -> str | None:
    if fs.isfile(path):
        return path if path.rstrip("/").endswith(TEST_BATCH) else None
    for candidate in (f"{path}/{TEST_BATCH}", f"{path}/{CIFAR_FOLDER}/{TEST_BATCH}"):
        if fs.isfile(candidate):
            return candidate
    return None


def _count(fs: Any, batch: str) -> int:
    try:
        with fs.open(batch, "rb") as f:
            content = pickle.load(f, encoding="latin1")
        count = len(content["labels"])
        if len(content["data"]) != count or np.asarray(content["data"]).shape[1:] != (3072,):
            raise ValueError("images and labels do not match, or images are not 3x32x32")
    except (EOFError, OSError, ValueError, KeyError, TypeError, pickle.UnpicklingError) as error:
        raise ConfigError(
            f"--input: {fs.unstrip_protocol(batch)}: not a readable CIFAR-10 batch "
            f"({type(error).__name__}: {error})"
        ) from None
    return count
