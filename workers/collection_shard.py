"""A rank's share of Dask-collection data: read where it lies, served in seeded batches.

The client (``workflows/jobs/collections.py``) persisted the partitions and assigned every row of
a split to one rank, with every rank's sample count. Here a rank reads its rows: the
partitions its own worker holds straight from the worker's memory (the rank runs inside that
worker process, so nothing is copied over the network), the rest (rows moved for balance that
went missing, partitions Dask recomputed elsewhere after a worker loss) through Dask.

One epoch, exactly once across ranks: the rows of a rank are fixed for the run (that is what
keeps them local), their order is a fresh permutation per epoch drawn from (seed, epoch,
rank), and every rank takes the same number of steps, ``ceil(max share / batch_size)``. The
shares differ by one sample at most, so nothing is dropped or repeated; a rank's last batch
is the short one (and a rank one sample short of the others, with a share that is a whole
number of batches, makes its last two batches ``batch_size - 1`` and 1 rather than an empty
one). A resumed run starts an epoch at any step with the same batches it would have had.
"""

import functools
import math
from collections.abc import Hashable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from workers.data import StoreSplit
from workers.futures import wait_futures


@dataclass(frozen=True)
class Piece:
    """Rows of one partition a rank reads: ``rows`` rows from ``x_start`` of the value held
    under ``x_key`` and from ``y_start`` of ``y_key``."""

    x_key: Hashable
    y_key: Hashable
    x_start: int
    y_start: int
    rows: int


@dataclass(frozen=True)
class SplitPlan:
    """One split as the client planned it: what each rank reads, and how much moved."""

    name: str
    n: int
    n_partitions: int
    counts: tuple[int, ...]  # each rank's samples per epoch
    pieces: tuple[tuple[Piece, ...], ...]  # each rank's rows, in order
    x_frame: bool  # X was a dataframe: its partitions are converted to arrays on the rank
    sample_shape: tuple[int, ...]
    integral_target: bool
    target_range: tuple[float, float]
    moved_rows: int  # rows cut off where they lay and held on another rank's worker
    moved_bytes: int  # their size as Dask counts it (what its transfer accounting sees)
    dataset: str  # the name under which the client published the futures of these keys

    def steps(self, batch_size: int) -> int:
        """Steps per epoch, the same on every rank."""
        return math.ceil(max(self.counts) / batch_size)

    @property
    def num_classes(self) -> int | None:
        """For class labels (integers from 0): the largest label plus one."""
        if not self.integral_target:
            return None
        return int(self.target_range[1]) + 1


@dataclass(frozen=True)
class CollectionPlan:
    """Every split's plan, for ``world_size`` ranks (``workers[r]``: rank r's planned worker)."""

    splits: dict[str, SplitPlan]
    world_size: int
    workers: tuple[str, ...]

    def __getitem__(self, name: str) -> SplitPlan:
        if name not in self.splits:
            raise KeyError(
                f"no split {name!r} in the data given to launch(); it has {sorted(self.splits)}"
            )
        return self.splits[name]


def batch_sizes(count: int, *, steps: int, batch_size: int) -> list[int]:
    """How a rank's ``count`` samples fill ``steps`` batches of at most ``batch_size``."""
    sizes = [batch_size] * (steps - 1) + [count - (steps - 1) * batch_size]
    if sizes[-1] == 0 and steps > 1:
        sizes[-2:] = [batch_size - 1, 1]  # never an empty batch: DDP would average a NaN
    if not 0 < sizes[-1] <= batch_size:
        raise ValueError(f"{count} samples do not fill {steps} batches of {batch_size}")
    return sizes


def epoch_order(count: int, *, seed: int, epoch: int, rank: int, shuffle: bool) -> np.ndarray:
    """The order in which a rank visits its rows in ``epoch``."""
    if not shuffle:
        return np.arange(count)
    return np.random.default_rng([seed, epoch, rank]).permutation(count)


class RankRows:
    """This rank's rows of one split, as arrays: X float32, y int64 (integral labels) or
    float32."""

    def __init__(self, x_parts: list[np.ndarray], y_parts: list[np.ndarray]) -> None:
        self.x_parts, self.y_parts = x_parts, y_parts
        self.offsets = np.cumsum([0] + [len(p) for p in x_parts])
        self.sample_shape = x_parts[0].shape[1:] if x_parts else ()
        self.fetched_keys: list[Hashable] = []  # keys this rank did not hold itself

    def __len__(self) -> int:
        return int(self.offsets[-1])

    @classmethod
    def load(cls, split: SplitPlan, rank: int, *, timeout_s: float) -> "RankRows":
        """Read the rank's pieces: local values from the worker's memory, the rest via Dask."""
        pieces = split.pieces[rank]
        values, missing = _local_values({k for p in pieces for k in (p.x_key, p.y_key)})
        if missing:
            values.update(
                _fetched(missing, dataset=split.dataset, timeout_s=timeout_s, split=split.name)
            )
        rows = cls(
            [_features(values[p.x_key], p.x_start, p.rows, frame=split.x_frame) for p in pieces],
            [
                _targets(values[p.y_key], p.y_start, p.rows, integral=split.integral_target)
                for p in pieces
            ],
        )
        rows.fetched_keys = list(missing)
        if len(rows) != split.counts[rank]:
            raise RuntimeError(
                f"data[{split.name!r}]: rank {rank} read {len(rows)} rows, planned "
                f"{split.counts[rank]}"
            )
        return rows

    def take(self, index: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The rows at ``index`` (rank-local row numbers), in that order."""
        which = np.searchsorted(self.offsets, index, side="right") - 1
        x = np.empty((len(index), *self.sample_shape), dtype=np.float32)
        y_shape = self.y_parts[0].shape[1:]
        y = np.empty((len(index), *y_shape), dtype=self.y_parts[0].dtype)
        for part in np.unique(which):
            chosen = which == part
            rows = index[chosen] - self.offsets[part]
            x[chosen] = self.x_parts[part][rows]
            y[chosen] = self.y_parts[part][rows]
        return x, y


class Batches:
    """One epoch of a rank's batches: ``for x, y in batches``; ``len()`` is what is left.

    ``steps`` (the whole epoch) is the same on every rank; iteration begins at ``start_step``.
    """

    def __init__(
        self, shard: "RankShard", *, epoch: int, shuffle: bool = True, start_step: int = 0
    ) -> None:
        """``epoch`` of ``shard`` (the rank's rows, its place in the plan, its batch size and
        seed), its rows in a shuffled order unless ``shuffle`` is False."""
        batch_size, rank = shard.batch_size, shard.rank
        if batch_size < 1:
            raise ValueError(f"batch_size: {batch_size}; give at least 1")
        self.rows, self.steps = shard.rows, shard.split.steps(batch_size)
        if not 0 <= start_step <= self.steps:
            raise ValueError(f"start_step: {start_step} is outside the epoch's {self.steps} steps")
        self.sizes = batch_sizes(shard.split.counts[rank], steps=self.steps, batch_size=batch_size)
        self.order = epoch_order(
            len(self.rows), seed=shard.seed, epoch=epoch, rank=rank, shuffle=shuffle
        )
        self.start_step = start_step

    def __len__(self) -> int:
        return self.steps - self.start_step

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        start = sum(self.sizes[: self.start_step])
        for size in self.sizes[self.start_step :]:
            x, y = self.rows.take(self.order[start : start + size])
            start += size
            yield torch.from_numpy(x), torch.from_numpy(y)


class RankShard:
    """A rank's rows of one split with the built-in trainer's interface
    (``workers/data.py`` RankBatches): ``len()`` steps per epoch, ``epoch(e, start_batch=)``,
    ``job_rows(step)``, ``stride`` and ``steps_from(position)``."""

    def __init__(
        self, rows: RankRows, split: SplitPlan, *, rank: int, batch_size: int, seed: int
    ) -> None:
        self.rows, self.split, self.rank = rows, split, rank
        self.batch_size, self.seed = batch_size, seed

    def __len__(self) -> int:
        return self.split.steps(self.batch_size)

    stride = 1  # a step moves the epoch's position by one batch

    def steps_from(self, position: int) -> int:
        """Steps left in an epoch from batch ``position``."""
        return max(0, len(self) - position)

    def job_rows(self, batch: int) -> int:
        """Rows all ranks together train on in step ``batch`` of an epoch. The shares may
        differ by a few rows, so this is every rank's batch as the plan sizes it, not this
        rank's times the ranks."""
        return self._job_rows[batch]

    @functools.cached_property
    def _job_rows(self) -> list[int]:
        steps = len(self)
        sizes = [batch_sizes(c, steps=steps, batch_size=self.batch_size) for c in self.split.counts]
        return [sum(step) for step in zip(*sizes, strict=True)]

    def epoch(self, epoch: int, *, start_batch: int = 0) -> Batches:
        return Batches(self, epoch=epoch, start_step=start_batch)


class GlobalRows:
    """A rank's contiguous share of a split, addressed by global row numbers, the way the
    strategies' evaluation reads a store split (``split.images[begin:end]``): planned with
    ``contiguous`` shares, rank r holds rows [r * share, r * share + count)."""

    def __init__(self, rows: RankRows, split: SplitPlan, *, rank: int, targets: bool) -> None:
        self.rows, self.targets = rows, targets
        self.first = sum(split.counts[:rank])
        sample = rows.y_parts[0].shape[1:] if targets and rows.y_parts else split.sample_shape
        self.shape = (split.n, *sample)

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, rows: slice) -> np.ndarray:
        start, stop, _ = rows.indices(self.shape[0])
        if stop > start and not self.first <= start <= stop <= self.first + len(self.rows):
            raise IndexError(f"rows {start}:{stop} are not this rank's")
        index = np.arange(start - self.first, stop - self.first)
        x, y = self.rows.take(index)
        return y if self.targets else x


def _local_values(keys: set[Hashable]) -> tuple[dict[Hashable, Any], list[Hashable]]:
    """The values this worker holds, straight from its memory, and the keys it lacks."""
    from distributed import get_worker

    data = get_worker().data
    values, missing = {}, []
    for key in keys:
        try:
            values[key] = data[key]
        except KeyError:
            missing.append(key)
    return values, missing


def _fetched(
    keys: list[Hashable], *, dataset: str, timeout_s: float, split: str
) -> dict[Hashable, Any]:
    """Values held elsewhere, or lost with a worker and recomputed by Dask (the rank task has
    left its worker's thread pool, so a recomputation can run there too)."""
    from distributed import get_client

    client = get_client(timeout=timeout_s)
    # The client published the run's futures: taken from there, the scheduler knows that
    # this worker's client wants them (a Future made from a bare key would wait forever).
    published = {f.key: f for f in client.get_dataset(dataset)}
    futures = [published[key] for key in keys]
    try:
        wait_futures(futures, timeout_s=timeout_s)
    except TimeoutError:
        raise TimeoutError(
            f"data[{split!r}]: {len(keys)} partitions were not available within {timeout_s:g} s"
        ) from None
    return dict(zip(keys, client.gather(futures), strict=True))


def _features(part: Any, start: int, rows: int, *, frame: bool) -> np.ndarray:
    if frame:
        return part.iloc[start : start + rows].to_numpy(dtype=np.float32)
    values = np.asarray(part[start : start + rows])
    # A float32 partition is used in place (a view of the worker's own array).
    return values if values.dtype == np.float32 else values.astype(np.float32)


def _targets(part: Any, start: int, rows: int, *, integral: bool) -> np.ndarray:
    values = (
        part.iloc[start : start + rows] if hasattr(part, "iloc") else part[start : start + rows]
    )
    values = np.asarray(values)
    return values.astype(np.int64 if integral else np.float32, copy=False)


def trainer_splits(
    plan: CollectionPlan, *, rank: int, batch_size: int, seed: int, timeout_s: float = 600.0
) -> tuple[RankShard, StoreSplit]:
    """The built-in trainer's training batches and validation split of this rank, as the
    store gives them (``workers/data.py``); validation was planned in contiguous shares."""
    train = RankShard(
        RankRows.load(plan["train"], rank, timeout_s=timeout_s),
        plan["train"],
        rank=rank,
        batch_size=batch_size,
        seed=seed,
    )
    val_plan = plan["val"]
    rows = RankRows.load(val_plan, rank, timeout_s=timeout_s)
    images = GlobalRows(rows, val_plan, rank=rank, targets=False)
    labels = GlobalRows(rows, val_plan, rank=rank, targets=True)
    return train, StoreSplit(images, labels, chunk_size=max(1, len(rows)))  # type: ignore[arg-type]


def collections_model_inputs(plan: CollectionPlan) -> tuple[int, tuple[int, ...]]:
    """(classes, sample shape) from the data: labels 0 .. C-1 over both splits (0 for a
    regression target), and the shape of one sample of ``X``."""
    classes = max(split.num_classes or 0 for split in plan.splits.values())
    return classes, tuple(plan["train"].sample_shape)
