"""Parquet files and zarr arrays a user already has, as Dask collections for ``train``.

``data.dataset = "parquet"`` reads ``data.root`` (a path, a glob or an fsspec URL) with
``dask.dataframe.read_parquet``: ``data.features`` are the feature columns (default: every
column but ``data.target``). ``data.dataset = "zarr"`` reads two arrays of the group at
``data.root``, ``data.features[0]`` (samples) and ``data.target`` (labels), with
``dask.array.from_zarr``. A ``data.val_fraction`` of the rows is held out for validation:
a seeded random split of a dataframe, the last rows of arrays. The collections then take
the path of ``train(config, data=...)`` (``workflows/collections.py``): nothing is copied
into a store, each rank reads the partitions its worker loaded.
"""

from typing import Any

from workers.config_models import USER_DATASETS, DataConfig
from workflows.collections import DataError

__all__ = ["USER_DATASETS", "read_user_dataset"]


def read_user_dataset(config: DataConfig, *, seed: int) -> dict[str, tuple[Any, Any]]:
    """``{"train": (X, y), "val": (X_val, y_val)}`` for a parquet or zarr dataset."""
    if config.dataset == "parquet":
        return _parquet(config, seed=seed)
    if config.dataset == "zarr":
        return _zarr(config)
    raise ValueError(f"data.dataset: {config.dataset!r} is not one of {USER_DATASETS}")


def _parquet(config: DataConfig, *, seed: int) -> dict[str, tuple[Any, Any]]:
    import dask.dataframe as dd

    assert config.root is not None and config.target is not None  # DataConfig checks them
    try:
        frame = dd.read_parquet(config.root, storage_options=config.storage_options or None)
    except (OSError, ValueError) as error:
        raise DataError(f"data.root: cannot read parquet at {config.root}: {error}") from None
    columns = list(frame.columns)
    wanted = [config.target, *(config.features or ())]
    unknown = [name for name in wanted if name not in columns]
    if unknown:
        field = "data.target" if unknown[0] == config.target else "data.features"
        raise DataError(f"{field}: no column {unknown[0]!r} in {config.root}; it has {columns}")
    features = list(config.features or [c for c in columns if c != config.target])
    train, val = frame[[*features, config.target]].random_split(
        [1 - config.val_fraction, config.val_fraction], random_state=seed
    )
    return {
        "train": (train[features], train[config.target]),
        "val": (val[features], val[config.target]),
    }


def _zarr(config: DataConfig) -> dict[str, tuple[Any, Any]]:
    import dask.array as da

    assert config.root is not None and config.features and config.target is not None
    arrays = {}
    for field, name in (("data.features", config.features[0]), ("data.target", config.target)):
        try:
            arrays[field] = da.from_zarr(
                config.root, component=name, storage_options=config.storage_options or None
            )
        except (OSError, KeyError, ValueError) as error:
            raise DataError(
                f"{field}: no zarr array {name!r} at {config.root} ({type(error).__name__})"
            ) from None
    x, y = arrays["data.features"], arrays["data.target"]
    if x.shape[0] != y.shape[0]:
        raise DataError(
            f"data.target: {config.target!r} holds {y.shape[0]} rows but "
            f"{config.features[0]!r} {x.shape[0]}"
        )
    cut = x.shape[0] - max(1, round(x.shape[0] * config.val_fraction))
    return {"train": (x[:cut], y[:cut]), "val": (x[cut:], y[cut:])}
