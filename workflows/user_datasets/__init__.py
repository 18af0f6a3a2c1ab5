"""Parquet files and zarr arrays a user already has, as Dask collections for ``train``.

``data.dataset = "parquet"`` reads ``data.root`` (a path, a glob or an fsspec URL) with
``dask.dataframe.read_parquet``: ``data.features`` are the feature columns (default: every
column but ``data.target``). ``data.dataset = "zarr"`` reads two arrays of the group at
``data.root``, ``data.features[0]`` (samples) and ``data.target`` (labels), with
``dask.array.from_zarr``. A ``data.val_fraction`` of the rows is held out for validation:
a seeded random split of a dataframe, the last rows of arrays. The collections then take
the path of ``train(config, data=...)`` (``workflows/collections.py``): nothing is copied
into a store, each rank reads the partitions its worker loaded.

Each dataset is one module here, named as ``data.dataset`` names it, with ``read(config, *,
seed)``; adding one means adding its module and its name to ``USER_DATASETS``
(``workers/config_models.py``, which validates configs without importing this package).
"""

import importlib
from typing import Any

from workers.config_models import USER_DATASETS, DataConfig

__all__ = ["USER_DATASETS", "read_user_dataset"]


def read_user_dataset(config: DataConfig, *, seed: int) -> dict[str, tuple[Any, Any]]:
    """``{"train": (X, y), "val": (X_val, y_val)}`` for a parquet or zarr dataset."""
    if config.dataset not in USER_DATASETS:
        raise ValueError(f"data.dataset: {config.dataset!r} is not one of {USER_DATASETS}")
    reader = importlib.import_module(f"{__name__}.{config.dataset}")
    return reader.read(config, seed=seed)
