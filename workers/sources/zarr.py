"""zarr: two arrays of the group at ``data.root``, ``data.features[0]`` (samples) and
``data.target`` (labels), read with ``dask.array.from_zarr`` as Dask collections; the last
``data.val_fraction`` of the rows is held out."""

from typing import TYPE_CHECKING, Any

from workers.sources.base import Source, SourceError, check_files_exist, register

if TYPE_CHECKING:
    from workers.spec.sections import DataConfig


@register
class Zarr(Source):
    name = "zarr"
    store = "collections"

    @classmethod
    def check_root(cls, data: "DataConfig") -> None:
        check_files_exist(data)

    @classmethod
    def collections(cls, data: "DataConfig", *, seed: int) -> dict[str, tuple[Any, Any]]:
        """The arrays' train and validation rows (``seed`` is unused: arrays split by
        position)."""
        import dask.array as da

        assert data.root is not None and data.features and data.target is not None
        arrays = {}
        for field, name in (("data.features", data.features[0]), ("data.target", data.target)):
            try:
                arrays[field] = da.from_zarr(
                    data.root, component=name, storage_options=data.storage_options or None
                )
            except (OSError, KeyError, ValueError) as error:
                raise SourceError(
                    f"{field}: no zarr array {name!r} at {data.root} ({type(error).__name__})"
                ) from None
        x, y = arrays["data.features"], arrays["data.target"]
        if x.shape[0] != y.shape[0]:
            raise SourceError(
                f"data.target: {data.target!r} holds {y.shape[0]} rows but "
                f"{data.features[0]!r} {x.shape[0]}"
            )
        cut = x.shape[0] - max(1, round(x.shape[0] * data.val_fraction))
        return {"train": (x[:cut], y[:cut]), "val": (x[cut:], y[cut:])}
