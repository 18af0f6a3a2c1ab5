"""``data.dataset = "zarr"``: two arrays of the group at ``data.root``,
``data.features[0]`` (samples) and ``data.target`` (labels), read with
``dask.array.from_zarr``; the last ``data.val_fraction`` of the rows is held out."""

from typing import Any

from workers.config_models import DataConfig
from workflows.collections import DataError


def read(config: DataConfig, *, seed: int) -> dict[str, tuple[Any, Any]]:
    """The arrays' train and validation rows (``seed`` is unused: arrays split by position)."""
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
