"""Dask collections written into the zarr store as Dask tasks: training data larger than memory.

With ``data.collections = "store"``, ``train(config, data=...)`` (and ``data.dataset =
"parquet"`` or ``"zarr"``) does not persist the collections on the workers: it writes them,
chunk by chunk on the cluster, into a store that the ranks then read as they read the
preprocessed image store (``workers/data.py``): every sample once per epoch, shuffled by chunks
and windows of chunks, each rank holding only the few chunks it is reading. No process ever
holds a whole split, so the data may be larger than the cluster's memory. The store keeps every
array's dtype and shape::

    store/
      train/features  (n, ...) in X's dtype (a dataframe: its columns' common type)
      train/targets   (n,) or (n, k) in y's dtype
      val/features, val/targets
      attrs: the manifest (fingerprint, counts, classes, sample shape, dtypes)

The ranks read features as float32 and targets as int64 (integers) or float32, as they read
persisted collections. ``complete = true`` is written last, so a half-written store is never
taken for a finished one; a complete store of the same collections (the same Dask token: the
same graph, e.g. ``read_parquet`` of the same unchanged files) is reused.
"""

import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import dask
import zarr
from dask.base import tokenize
from distributed import Client

from workers.spec.sections import DataConfig
from workflows.data.stores import (
    STORE_FORMAT,
    StoreManifest,
    gather_settled,
    manifest_of,
    reusable_store,
)
from workflows.jobs.collections import (
    DataError,
    checked_splits,
    require_class_labels,
    require_no_nan,
    target_facts,
    wait_for_partitions,
)

logger = logging.getLogger(__name__)
# The arrays of each split; workers/data.py open_store reads these names from the manifest.
ARRAYS = {"features": "features", "targets": "targets"}


def write_array_store(
    client: Client,
    data: Mapping[str, Any],
    config: DataConfig,
    *,
    classification: bool,
    force: bool = False,
    timeout_s: float = 600.0,
) -> StoreManifest:
    """Write ``data={"train": (X, y), "val": (X_val, y_val)}`` into ``config.store`` (default:
    ``data/stores/collections-<fingerprint>``) as Dask tasks, or reuse the complete store of the
    same collections. The targets are checked first (NaN, class labels where the task is
    ``classification``): bad data fails in one line before anything is written.
    ``timeout_s`` bounds the one pass that reads before writing (row counts, target facts)."""
    started = time.perf_counter()
    splits = checked_splits(data)
    collections = [(name, *splits[name]) for name in sorted(splits)]
    fingerprint = tokenize(STORE_FORMAT, "arrays", config.chunk_size, collections)
    url = config.store_url if config.store else _default_url(fingerprint)
    options = config.storage_options or None
    reusable = reusable_store(url, options, fingerprint, force=force)
    if reusable is not None:
        return manifest_of(url, reusable, reused=True, seconds=time.perf_counter() - started)
    arrays, num_classes = {}, 0
    for name, (x, y) in splits.items():
        x, y, facts = _read_once(client, f"data[{name!r}]", x, y, timeout_s)
        num_classes = max(num_classes, _checked_targets(f"data[{name!r}]", facts, classification))
        arrays[name] = _whole_samples(x, config.chunk_size), _whole_samples(y, config.chunk_size)
    attrs = _write(client, url, options, arrays, fingerprint=fingerprint, num_classes=num_classes)
    logger.info("wrote %s into %s", {n: int(x.shape[0]) for n, (x, _) in arrays.items()}, url)
    return manifest_of(url, attrs, reused=False, seconds=time.perf_counter() - started)


def _default_url(fingerprint: str) -> str:
    # One store per set of collections: other data never overwrites it, the same data reuses it.
    return str(Path(f"data/stores/collections-{fingerprint[:16]}").resolve())


def _read_once(
    client: Client, where: str, x: Any, y: Any, timeout_s: float
) -> tuple[Any, Any, list[tuple[int, int, bool, float, float]]]:
    """X and y as dask arrays of known lengths, and the facts of y's partitions
    (``target_facts``), from one pass over the data: a dataframe does not know its partitions'
    lengths, and y's lengths come with its facts, so each column is read once here (dask-expr
    reads X's and y's columns of one Parquet dataset in tasks of their own). The write then
    reads them a second time, chunk by chunk."""
    import dask.dataframe as dd

    def is_frame(c: Any) -> bool:
        return isinstance(c, dd.DataFrame | dd.Series)

    # Optimized first: dask-expr fuses small partitions (of Parquet files, say) when it
    # optimizes, so only the optimized collection has the partitions whose lengths count.
    x, y = (c.optimize() if is_frame(c) else c for c in (x, y))
    if is_frame(y):
        y_blocks = y.to_delayed()
    else:  # blocks of whole rows
        y_blocks = y.rechunk({axis: -1 for axis in range(1, y.ndim)}).to_delayed().ravel()
    y_facts = [dask.delayed(target_facts)(block) for block in y_blocks]
    # Delayed, as y's facts are: dask warns when one compute mixes expressions and graphs.
    x_lengths = [dask.delayed(len)(part) for part in x.to_delayed()] if is_frame(x) else []
    futures = client.compute([*y_facts, *x_lengths])
    wait_for_partitions(futures, timeout_s, where)
    computed = client.gather(futures)
    facts = computed[: len(y_facts)]
    if is_frame(x):
        x = x.to_dask_array(lengths=tuple(int(n) for n in computed[len(y_facts) :]))
    if is_frame(y):
        y = y.to_dask_array(lengths=tuple(f[0] for f in facts))
    if x.shape[0] != y.shape[0]:
        raise DataError(f"{where}: X has {x.shape[0]} rows but y has {y.shape[0]}")
    if x.shape[0] == 0:
        raise DataError(f"{where}: X has no rows")
    return x, y, facts


def _whole_samples(array: Any, chunk_rows: int) -> Any:
    """``array`` cut into chunks of ``chunk_rows`` whole samples, the store's chunks: each write
    task then fills its own zarr chunks, and no two tasks share one."""
    return array.rechunk({0: chunk_rows, **{axis: -1 for axis in range(1, array.ndim)}})


def _checked_targets(
    where: str, facts: list[tuple[int, int, bool, float, float]], classification: bool
) -> int:
    """The number of classes (0 for regression), once y has passed the checks that persisted
    collections pass (``workflows/jobs/collections.py``)."""
    require_no_nan(where, sum(f[1] for f in facts))
    if not classification:
        return 0
    low, high = min(f[3] for f in facts), max(f[4] for f in facts)
    require_class_labels(where, integral=all(f[2] for f in facts), low=low)
    return int(high) + 1


def _write(
    client: Client,
    url: str,
    options: dict[str, Any] | None,
    arrays: dict[str, tuple[Any, Any]],
    *,
    fingerprint: str,
    num_classes: int,
) -> dict[str, Any]:
    import dask.array as da

    group = zarr.open_group(url, mode="w", storage_options=options)  # wipes the old store
    group.attrs.update({"format": STORE_FORMAT, "complete": False})  # ours, not finished
    sources, targets = [], []
    for name, pair in arrays.items():
        for array_name, array in zip(ARRAYS.values(), pair, strict=True):
            targets.append(
                zarr.create_array(
                    url,
                    name=f"{name}/{array_name}",
                    shape=array.shape,
                    dtype=array.dtype,
                    chunks=(array.chunks[0][0], *array.shape[1:]),
                    # As in the image store: the ranks read chunks on the cores that train.
                    compressors=None,
                    overwrite=True,
                    storage_options=options,
                )
            )
            sources.append(array)
    # One task per chunk, on the workers; lock=False: no two tasks write the same zarr chunk.
    written = da.store(sources, targets, lock=False, compute=False)
    gather_settled(client, [client.compute(written)])
    x_train, y_train = arrays["train"]
    attrs = {
        "format": STORE_FORMAT,
        "kind": "arrays",
        "arrays": ARRAYS,
        "fingerprint": fingerprint,
        "dataset": "collections",
        "counts": {name: int(x.shape[0]) for name, (x, _) in arrays.items()},
        "mean": [],
        "std": [],
        "classes": [str(label) for label in range(num_classes)],
        "bad_records": [],
        "sample_shape": [int(d) for d in x_train.shape[1:]],
        "dtypes": {"features": str(x_train.dtype), "targets": str(y_train.dtype)},
    }
    group.attrs.update(attrs)
    group.attrs["complete"] = True  # last: only now is the store visible as finished
    return {**attrs, "complete": True}
