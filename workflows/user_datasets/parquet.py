"""``data.dataset = "parquet"``: ``data.root`` (a path, a glob or an fsspec URL) read with
``dask.dataframe.read_parquet``; ``data.features`` are the feature columns (default: every
column but ``data.target``), a seeded random ``data.val_fraction`` of the rows is held out."""

from typing import Any

from workers.config_models import DataConfig
from workflows.collections import DataError


def read(config: DataConfig, *, seed: int) -> dict[str, tuple[Any, Any]]:
    """The table's feature and target columns, split by a random split seeded with ``seed``."""
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
