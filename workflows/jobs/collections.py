"""Training data from Dask collections, planned on the client: check, persist, locate, assign.

``data={"train": (X, y), "val": (X_val, y_val)}`` with ``X`` a ``dask.array`` (n, ...) or a
``dask.dataframe`` (its columns are the features) and ``y`` a ``dask.array`` or dask ``Series``.

The rows of every split are assigned to ranks once per run, as xgboost.dask and lightgbm.dask
do: the partitions are persisted on the rank workers, the scheduler says who holds each
(``who_has``), and each rank keeps the partitions its own worker holds, up to its share. The
shares are equal to one sample (``n // world_size``, plus one for the first ``n % world_size``
ranks with the most local rows). Rows beyond a share are cut off on the worker that holds
them, and only those cuts move, to the ranks short of their share: the rows that move are
exactly the sum of the shortfalls, the least any assignment can move. The plan (keys, row
ranges, every rank's sample count) goes to the ranks; ``workers/collection_shard.py`` reads it.
"""

import contextlib
import logging
import math
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
from distributed import Client, Future, futures_of

from workers.collection_shard import CollectionPlan, Piece, SplitPlan
from workers.futures import wait_futures
from workers.spec.errors import ConfigError
from workers.spec.launch import LaunchConfig

logger = logging.getLogger(__name__)
SPLITS = ("train", "val")
# Shares: "balanced" (equal to one sample, locality first) for training and ctx.shard;
# "contiguous" (ceil(n / world) rows per rank in rank order) is what the built-in trainer's
# validation reads (workers/data.py eval_batches).
Shares = Literal["balanced", "contiguous"]


class DataError(ValueError):
    """A collection that cannot be trained on; the message names the split and what to do."""


@dataclass(frozen=True)
class _Placement:
    """Where a job's splits go, the same for each: rank r's worker ``workers[r]`` (fewer than
    the ranks: the rest have no locality), the ranks, the dataset their futures are published
    under, and the bound on each wait for partitions."""

    workers: list[str]
    world_size: int
    dataset: str
    timeout_s: float


@dataclass
class PreparedData:
    """The plan the ranks get, and the futures that keep its partitions on the cluster."""

    plan: CollectionPlan
    futures: list[Future] = field(default_factory=list, repr=False)
    client: Client | None = field(default=None, repr=False)
    dataset: str | None = None

    def release(self) -> None:
        """Let the cluster forget what this run persisted (the user's own persisted
        collections stay)."""
        if self.client is not None and self.dataset is not None:
            with contextlib.suppress(KeyError):
                self.client.unpublish_dataset(self.dataset)
        self.futures.clear()


def check_fixed_world(settings: LaunchConfig) -> None:
    """Collections are placed on the workers of a fixed set of ranks: an elastic range is a
    ``ConfigError`` naming ``launch.world_size``."""
    if settings.world_range is not None and settings.elastic:
        low, high = settings.world_range
        raise ConfigError(
            f"launch.world_size: {low}:{high} is a range, "
            "but Dask collections are placed on a fixed set of ranks; give an int, or write "
            "them to a store first (data.collections = 'store' for train())"
        )


@contextlib.contextmanager
def prepared_data(
    client: Client,
    data: Mapping[str, Any],
    world_size: int,
    *,
    workers: Sequence[str],
    shares: Mapping[str, Shares] | None = None,
    timeout_s: float = 600.0,
) -> Iterator[PreparedData]:
    """:func:`prepare_data` for a job of ``world_size`` ranks, released on exit: the size its
    request to the queue decided (``JobHold.world_size``; the job's world is fixed, see
    :func:`check_fixed_world`). ``workers`` are the job's, held from the scheduler's queue in
    rank order."""
    prepared = prepare_data(
        client,
        data,
        workers=list(workers[:world_size]),
        world_size=world_size,
        shares=shares,
        timeout_s=timeout_s,
    )
    try:
        yield prepared
    finally:
        prepared.release()


@contextlib.contextmanager
def trainer_data(
    client: Client,
    data: Mapping[str, Any],
    strategy: str,
    world_size: int,
    *,
    workers: Sequence[str],
    classification: bool = True,
) -> Iterator[PreparedData]:
    """The built-in trainer's data (``train(config, data=...)``): a "train" and a "val" split,
    of class labels where the task is ``classification``; validation in the contiguous shares
    its evaluation reads. ``world_size`` and ``workers``: the job's, as for
    :func:`prepared_data`."""
    check_trainer_data(data, strategy)
    shares: dict[str, Shares] = {"val": "contiguous"}
    with prepared_data(client, data, world_size, shares=shares, workers=workers) as prepared:
        if classification:
            for split in prepared.plan.splits.values():
                where, low = f"data[{split.name!r}]", split.target_range[0]
                require_class_labels(where, integral=split.integral_target, low=low)
        yield prepared


def check_trainer_data(data: Any, strategy: str) -> None:
    """What the built-in trainer needs of ``train(config, data=...)``, whether the collections
    are persisted or written into a store: a flat strategy, and both splits."""
    from workers.spec.plans import get_plan

    if get_plan(strategy).staged:
        raise DataError(
            f"training.strategy: {strategy} exchanges fixed-shape batches, which exactly-once "
            "epochs of Dask collections do not have; use 'ddp' with train(data=...)"
        )
    missing = [name for name in SPLITS if name not in (data or {})]
    if isinstance(data, Mapping) and missing and not [n for n in data if n not in SPLITS]:
        raise DataError(
            f"data: the built-in trainer validates every epoch; give a {missing[0]!r} split "
            "too: data={'train': (X, y), 'val': (X_val, y_val)}"
        )


def require_no_nan(where: str, nan_rows: int) -> None:
    if nan_rows:
        raise DataError(f"{where}: y has {nan_rows} rows with NaN; drop or fill them first")


def require_class_labels(where: str, *, integral: bool, low: float) -> None:
    """A classification loss reads the target as class indices 0 .. C-1."""
    if not integral or low < 0:
        raise DataError(
            f"{where}: y must hold class labels (integers from 0) for training.loss = "
            "cross_entropy; for a numeric target set training.loss = 'mse' or 'l1'"
        )


def prepare_data(
    client: Client,
    data: Mapping[str, Any],
    *,
    workers: Sequence[str],
    world_size: int,
    shares: Mapping[str, Shares] | None = None,
    timeout_s: float = 600.0,
) -> PreparedData:
    """Check, persist and assign every split; ``workers[r]`` is rank r's worker (fewer
    addresses than ranks: the rest have no locality). Raises :class:`DataError` in one line
    before anything launches."""
    checked = checked_splits(data)
    rank_workers = list(workers[:world_size])
    futures: list[Future] = []
    splits = {}
    dataset = f"dask-train-data-{uuid.uuid4().hex}"
    placement = _Placement(rank_workers, world_size, dataset, timeout_s)
    for name, (x, y) in checked.items():
        mode = (shares or {}).get(name, "balanced")
        split, held = _plan_split(client, name, x, y, placement, mode=mode)
        splits[name] = split
        futures += held
    plan = CollectionPlan(splits=splits, world_size=world_size, workers=tuple(rank_workers))
    # Ranks missing a value (held elsewhere, recomputed after a worker loss) get its future
    # from here; published, the keys also outlive a client that disconnects mid-run.
    client.publish_dataset(futures, name=dataset)
    for split in splits.values():
        logger.info(
            "data[%r]: %d samples in %d partitions over %d ranks; %d rows (%d bytes) moved "
            "for balance",
            split.name,
            split.n,
            split.n_partitions,
            world_size,
            split.moved_rows,
            split.moved_bytes,
        )
    return PreparedData(plan=plan, futures=futures, client=client, dataset=dataset)


# -- checks ------------------------------------------------------------------------------------


def checked_splits(data: Any) -> dict[str, tuple[Any, Any]]:
    """Every split's (X, y), checked as far as that needs no data (:func:`_checked`)."""
    if not isinstance(data, Mapping) or not data:
        raise DataError(
            "data: give a dict of splits, e.g. data={'train': (X, y), 'val': (X_val, y_val)}"
        )
    unknown = [name for name in data if name not in SPLITS]
    if unknown:
        raise DataError(f"data: unknown split {unknown[0]!r}; the splits are {list(SPLITS)}")
    return {name: _checked(name, pair) for name, pair in data.items()}


def _checked(name: str, pair: Any) -> tuple[Any, Any]:
    """(X, y) as collections partitioned alike along rows, with known row counts where the
    collection type keeps them; everything that needs no data checked here."""
    import dask.array as da
    import dask.dataframe as dd

    where = f"data[{name!r}]"
    if not isinstance(pair, tuple | list) or len(pair) != 2:
        raise DataError(f"{where}: give a pair (X, y), got {type(pair).__name__}")
    x, y = pair
    if not isinstance(x, da.Array | dd.DataFrame):
        raise DataError(
            f"{where}: X must be a dask.array or a dask.dataframe, got {type(x).__name__}"
        )
    if not isinstance(y, da.Array | dd.Series):
        raise DataError(f"{where}: y must be a dask.array or a dask Series, got {type(y).__name__}")
    if isinstance(x, da.Array):
        if x.ndim < 1:
            raise DataError(f"{where}: X is a scalar; give an array of samples (n, ...)")
        _require_numeric(where, "X", x.dtype)
        _require_known_chunks(where, "X", x)
        if any(len(c) > 1 for c in x.chunks[1:]):
            # One partition is one block of whole samples.
            x = x.rechunk({axis: -1 for axis in range(1, x.ndim)})
    else:
        for column, dtype in x.dtypes.items():
            _require_numeric(where, f"X column {column!r}", dtype)
        if len(x.columns) == 0:
            raise DataError(f"{where}: X has no columns")
    if isinstance(y, da.Array):
        if y.ndim not in (1, 2):
            raise DataError(f"{where}: y must be (n,) or (n, k), got shape {y.shape}")
        _require_numeric(where, "y", y.dtype)
        _require_known_chunks(where, "y", y)
        if y.ndim == 2 and len(y.chunks[1]) > 1:
            y = y.rechunk({1: -1})
    else:
        _require_numeric(where, "y", y.dtype)
    if isinstance(x, da.Array) and isinstance(y, da.Array) and x.shape[0] != y.shape[0]:
        raise DataError(f"{where}: X has {x.shape[0]} rows but y has {y.shape[0]}")
    return x, y


def _require_numeric(where: str, what: str, dtype: Any) -> None:
    kind = getattr(dtype, "kind", "O")  # numpy and pandas dtypes alike
    if kind not in "biuf":
        raise DataError(
            f"{where}: {what} is of type {dtype}, not numeric; convert it (e.g. "
            "categories to codes) or leave it out"
        )


def _require_known_chunks(where: str, what: str, array: Any) -> None:
    if any(math.isnan(c) for c in array.chunks[0]):
        raise DataError(
            f"{where}: {what} has unknown chunk sizes (boolean indexing or a dataframe "
            f"conversion leaves them so); call {what} = {what}.compute_chunk_sizes() first"
        )


# -- persisting and facts ---------------------------------------------------------------------


def _partition_rows(part: Any) -> int:
    return len(part)


def target_facts(part: Any) -> tuple[int, int, bool, float, float]:
    """(rows, rows with a NaN, integral, min, max) of a partition of y."""
    values = np.asarray(part)
    missing = np.isnan(values) if values.dtype.kind == "f" else np.zeros(values.shape, bool)
    nan_rows = int(missing.reshape(len(values), -1).any(axis=1).sum()) if len(values) else 0
    known = values[~missing]
    low = float(known.min()) if known.size else math.inf
    high = float(known.max()) if known.size else -math.inf
    return len(values), nan_rows, values.dtype.kind in "biu", low, high


def _rows(part: Any, start: int, stop: int) -> Any:
    """Rows [start, stop) of a partition, run where the partition lies: only the cut moves."""
    return part.iloc[start:stop] if hasattr(part, "iloc") else part[start:stop]


def _held(part: Any) -> Any:
    """Runs on the rank's worker: Dask fetches the cut there as this task's dependency."""
    return part


def _ordered_futures(collection: Any) -> list[Future]:
    """The persisted collection's futures in partition order (a dataframe's own keys are not
    its futures' keys under dask-expr, so they come from ``futures_of``)."""
    found = futures_of(collection)
    return sorted(found, key=lambda f: tuple(f.key[1:]) if isinstance(f.key, tuple) else ())


def _persisted(
    client: Client, collection: Any, workers: list[str], timeout_s: float, where: str
) -> list[Future]:
    persisted = client.persist(collection, workers=workers or None, allow_other_workers=True)
    futures = _ordered_futures(persisted)
    wait_for_partitions(futures, timeout_s, where)
    return futures


def wait_for_partitions(futures: list[Future], timeout_s: float, where: str) -> None:
    """Every future done within ``timeout_s``; a partition that failed to compute is a
    DataError naming ``where`` (the split) and the error."""
    try:
        wait_futures(futures, timeout_s=timeout_s)
    except TimeoutError:
        raise TimeoutError(
            f"{where}: the partitions were not ready within {timeout_s:g} s"
        ) from None
    failed = next((f for f in futures if f.status == "error"), None)
    if failed is not None:
        error = failed.exception()
        raise DataError(f"{where}: computing a partition failed: {type(error).__name__}: {error}")


def _plan_split(
    client: Client, name: str, x: Any, y: Any, placement: _Placement, *, mode: Shares
) -> tuple[SplitPlan, list[Future]]:
    """One split's plan: its X and y persisted on the job's workers, partitioned alike, each
    rank's share of rows assigned where they lie (``mode``), and the rows that change hands
    cut and held on their new rank. Also the futures the plan reads, to keep."""
    import dask.array as da

    workers, world_size, timeout_s = placement.workers, placement.world_size, placement.timeout_s
    where = f"data[{name!r}]"
    x_futures, x_rows, y_futures, facts = _persisted_alike(
        client, x, y, workers, timeout_s=timeout_s, where=where
    )
    n = sum(x_rows)
    require_no_nan(where, sum(f[1] for f in facts))
    if n < world_size:
        raise DataError(f"{where}: {n} samples cannot give each of {world_size} ranks one")
    integral = all(f[2] for f in facts)
    low, high = min(f[3] for f in facts), max(f[4] for f in facts)

    holders = _holder_ranks(client, x_futures, workers)
    targets = (
        contiguous_shares(n, world_size)
        if mode == "contiguous"
        else balanced_shares(n, world_size, _local_rows(x_rows, holders, world_size))
    )
    assignment = assign_rows(x_rows, holders, targets)
    held_by = {"x": holders, "y": _holder_ranks(client, y_futures, workers)}
    pieces, cuts, moved, moved_rows = _cut_and_move(
        client, assignment, {"x": x_futures, "y": y_futures}, held_by, workers
    )
    wait_for_partitions(moved, timeout_s, where)
    # Pinned so that no idle worker steals them, which would copy whole partitions; once they
    # ran, any worker may recompute them (after a worker loss, the pinned one may be gone).
    lifted = {future.key: None for future in [*cuts, *moved]}
    if lifted:
        client.sync(client.scheduler.set_restrictions, worker=lifted)
    moved_bytes = sum(_where_held(client, _nbytes, moved, timeout_s, where))
    split = SplitPlan(
        name=name,
        n=n,
        n_partitions=len(x_rows),
        counts=tuple(targets),
        pieces=tuple(tuple(p) for p in pieces),
        x_frame=not isinstance(x, da.Array),
        sample_shape=tuple(x.shape[1:]) if isinstance(x, da.Array) else (len(x.columns),),
        integral_target=integral,
        target_range=(low, high),
        moved_rows=moved_rows,
        dataset=placement.dataset,
        moved_bytes=moved_bytes,
    )
    return split, [*x_futures, *y_futures, *moved]


def _persisted_alike(
    client: Client, x: Any, y: Any, workers: list[str], *, timeout_s: float, where: str
) -> tuple[list[Future], list[int], list[Future], list[Any]]:
    """X and y persisted on ``workers`` in partitions of the same rows, so that a rank reads
    both alike: X's futures and rows per partition, y's futures and its facts per partition
    (:func:`target_facts`)."""
    import dask.array as da

    x_futures = _persisted(client, x, workers, timeout_s, where)
    x_rows = _where_held(client, _partition_rows, x_futures, timeout_s, where)
    n = sum(x_rows)
    if isinstance(y, da.Array):
        if y.shape[0] != n:
            raise DataError(f"{where}: X has {n} rows but y has {y.shape[0]}")
        if list(y.chunks[0]) != x_rows:
            y = y.rechunk({0: tuple(x_rows)})
    y_futures = _persisted(client, y, workers, timeout_s, where)
    facts = _where_held(client, target_facts, y_futures, timeout_s, where)
    y_rows = [f[0] for f in facts]
    if sum(y_rows) != n:
        raise DataError(f"{where}: X has {n} rows but y has {sum(y_rows)}")
    if y_rows != x_rows:
        # A Series partitioned otherwise: as an array with known chunks, cut like X.
        y_array = y.to_dask_array(lengths=y_rows).rechunk({0: tuple(x_rows)})
        y_futures = _persisted(client, y_array, workers, timeout_s, where)
        facts = _where_held(client, target_facts, y_futures, timeout_s, where)
    return x_futures, x_rows, y_futures, facts


def _cut_and_move(
    client: Client,
    assignment: list[list[tuple[int, int, int]]],
    futures: dict[str, list[Future]],
    held_by: dict[str, list[set[int]]],
    workers: list[str],
) -> tuple[list[list[Piece]], list[Future], list[Future], int]:
    """Each rank's pieces of rows (``assignment``: partition, start, stop), read where they
    lie when a worker of the rank holds the partition, else cut where it lies and held on the
    rank's worker. Also the cuts, the held copies and the rows of X that moved."""
    pieces: list[list[Piece]] = []
    cuts: list[Future] = []
    moved: list[Future] = []
    moved_rows = 0
    for rank, ranges in enumerate(assignment):
        rank_pieces = []
        for p, start, stop in ranges:
            keys = {}
            for side in ("x", "y"):
                partition, holders = futures[side][p], held_by[side][p]
                if rank in holders or rank >= len(workers):
                    keys[side] = (partition.key, start, stop)
                    continue
                cut = client.submit(
                    _rows,
                    partition,
                    start,
                    stop,
                    key=f"dask-train-cut-{uuid.uuid4().hex}",
                    # Strictly where the partition lies (see _where_held), until it ran.
                    workers=[workers[r] for r in holders] or None,
                    allow_other_workers=False,
                )
                cuts.append(cut)
                staged = client.submit(
                    _held,
                    cut,
                    key=f"dask-train-moved-{uuid.uuid4().hex}",
                    workers=[workers[rank]],
                    allow_other_workers=False,
                )
                moved.append(staged)
                keys[side] = (staged.key, 0, stop - start)
                moved_rows += (stop - start) if side == "x" else 0
            (x_key, x_start, x_stop), (y_key, y_start, _) = keys["x"], keys["y"]
            rank_pieces.append(Piece(x_key, y_key, x_start, y_start, x_stop - x_start))
        pieces.append(rank_pieces)
    return pieces, cuts, moved, moved_rows


def _where_held(
    client: Client, fn: Callable[[Any], Any], futures: list[Future], timeout_s: float, where: str
) -> list[Any]:
    """``fn`` of each value, computed on a worker that holds it.

    Pinned there strictly: a task that may run elsewhere can be stolen by an idle worker, which
    copies the whole partition to run it; of the two replicas the active memory manager then
    drops one, perhaps the one the plan counts on being local.
    """
    holders = client.who_has(futures)
    done = [
        client.submit(
            fn,
            future,
            workers=list(holders.get(future.key, ())) or None,
            allow_other_workers=False,
            pure=False,
        )
        for future in futures
    ]
    wait_for_partitions(done, timeout_s, where)
    return client.gather(done)


def _nbytes(part: Any) -> int:
    from dask.sizeof import sizeof

    return int(sizeof(part))


def _holder_ranks(client: Client, futures: list[Future], workers: list[str]) -> list[set[int]]:
    """For each partition, the ranks whose worker holds it (none: another worker does)."""
    rank_of = {address: rank for rank, address in enumerate(workers)}
    who_has = client.who_has(futures)
    return [{rank_of[w] for w in who_has.get(f.key, ()) if w in rank_of} for f in futures]


# -- assignment (pure functions, tested without a cluster) ------------------------------------


def _local_rows(lengths: Sequence[int], holders: Sequence[set[int]], world_size: int) -> list[int]:
    local = [0] * world_size
    for length, held in zip(lengths, holders, strict=True):
        for rank in held:
            local[rank] += length
    return local


def balanced_shares(n: int, world_size: int, local_rows: Sequence[int]) -> list[int]:
    """Every rank's sample count: ``n // world_size``, and one more for the ``n % world_size``
    ranks holding the most rows already (the spare samples stay where they lie)."""
    base, extra = divmod(n, world_size)
    richest = sorted(range(world_size), key=lambda r: (-local_rows[r], r))[:extra]
    return [base + (rank in richest) for rank in range(world_size)]


def contiguous_shares(n: int, world_size: int) -> list[int]:
    """``ceil(n / world_size)`` rows per rank in rank order, the last ranks' shares shorter."""
    share = -(-n // world_size)
    return [max(0, min(n, (r + 1) * share) - r * share) for r in range(world_size)]


def assign_rows(
    lengths: Sequence[int], holders: Sequence[set[int]], targets: Sequence[int]
) -> list[list[tuple[int, int, int]]]:
    """Each rank's rows as (partition, start, stop) ranges, ``targets[r]`` rows for rank r.

    A partition held by several ranks goes to the one with the fewest local rows so far. Each
    rank keeps its own partitions, in order, up to its target; the rest (and partitions no rank
    holds) fill the ranks still short, in rank order. Rows that change hands: the sum of the
    shortfalls, the fewest possible.
    """
    world = len(targets)
    owner: list[int | None] = [None] * len(lengths)
    owned = [0] * world
    for p in sorted(range(len(lengths)), key=lambda p: (-lengths[p], p)):
        if holders[p]:
            rank = min(holders[p], key=lambda r: (owned[r], r))
            owner[p], owned[rank] = rank, owned[rank] + lengths[p]
    ranges: list[list[tuple[int, int, int]]] = [[] for _ in range(world)]
    filled = [0] * world
    pool: list[tuple[int, int, int]] = []
    for p, length in enumerate(lengths):
        rank = owner[p]
        if rank is None:
            pool.append((p, 0, length))
            continue
        keep = min(length, targets[rank] - filled[rank])
        if keep:
            ranges[rank].append((p, 0, keep))
            filled[rank] += keep
        if keep < length:
            pool.append((p, keep, length))
    for rank in range(world):
        while filled[rank] < targets[rank]:
            p, start, stop = pool.pop(0)
            take = min(stop - start, targets[rank] - filled[rank])
            ranges[rank].append((p, start, start + take))
            filled[rank] += take
            if start + take < stop:
                pool.insert(0, (p, start + take, stop))
    assert not pool, "targets must add up to the rows"
    return ranges
