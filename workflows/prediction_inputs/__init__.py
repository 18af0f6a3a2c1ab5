"""What ``predict`` scores, listed on the client: one module per kind of input.

A dataset store (``store.py``), CIFAR-10's test batch (``cifar10.py``) or a folder of images,
with class folders or without (``imagefolder.py``). Each module's ``plan`` says whether the
input is its kind (None if not) and, if it is, lists it into partitions; they are asked in the
order of ``INPUT_KINDS``, the folder of images last. Adding a kind is adding its module and its
name there.
"""

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import fsspec

from workers.inference import Partition
from workflows.config import ConfigError

INPUT_KINDS = ("store", "cifar10", "imagefolder")


@dataclass(frozen=True)
class InputRequest:
    """What the model and ``[predict]`` ask of an input, whatever its kind."""

    image_size: int  # the model's
    channels: int  # the model's first layer's
    split: str  # predict.split
    partition_size: int  # predict.partition_size
    storage_options: dict[str, Any] = field(default_factory=dict)

    def ranges(self, n: int) -> list[tuple[int, int]]:
        """The partitions' (start, stop) of ``n`` samples."""
        return [(lo, min(n, lo + self.partition_size)) for lo in range(0, n, self.partition_size)]


@dataclass(frozen=True)
class InputPlan:
    """The input listed on the client: its partitions, and its classes when it has labels."""

    kind: Literal["store", "cifar10", "imagefolder"]
    url: str
    partitions: list[Partition]
    classes: list[str] | None
    mean: list[float] | None = None  # a store's own statistics
    std: list[float] | None = None

    @property
    def count(self) -> int:
        return sum(len(p) for p in self.partitions)


Planner = Callable[[Any, str, str, InputRequest], InputPlan | None]


def plan_input(source: str | Path, request: InputRequest) -> InputPlan:
    """List ``source`` (a path or URL) into partitions, as the first kind that claims it."""
    url = str(source)
    if "://" not in url:
        url = str(Path(url).expanduser().resolve())
    try:
        fs, path = fsspec.core.url_to_fs(url, **request.storage_options)
        exists = fs.exists(path)
    except Exception as error:  # any backend's own error for a bad URL or credentials
        raise ConfigError(f"--input: cannot read {url}: {type(error).__name__}: {error}") from None
    if not exists:
        raise ConfigError(f"--input: {url} does not exist")
    for kind in INPUT_KINDS:
        planner: Planner = importlib.import_module(f"{__name__}.{kind}").plan
        plan = planner(fs, path, url, request)
        if plan is not None:
            return plan
    raise ConfigError(
        f"--input: {url} is neither a dataset store, a CIFAR-10 test batch nor a folder of images"
    )
