"""parquet: ``data.root`` (a path, a glob or an fsspec URL) read with
``dask.dataframe.read_parquet`` as Dask collections; ``data.features`` are the feature columns
(default: every column but ``data.target``), a seeded random ``data.val_fraction`` of the rows
is held out."""

from typing import TYPE_CHECKING, Any

from workers.sources.base import Source, SourceError, check_files_exist, register

if TYPE_CHECKING:
    from workers.spec.sections import DataConfig


@register
class Parquet(Source):
    name = "parquet"
    store = "collections"

    @classmethod
    def check_root(cls, data: "DataConfig") -> None:
        check_files_exist(data)

    @classmethod
    def collections(cls, data: "DataConfig", *, seed: int) -> dict[str, tuple[Any, Any]]:
        """The table's feature and target columns, split by a random split seeded with
        ``seed``."""
        import dask.dataframe as dd

        assert data.root is not None and data.target is not None  # DataConfig checks them
        try:
            frame = dd.read_parquet(data.root, storage_options=data.storage_options or None)
        except (OSError, ValueError) as error:
            raise SourceError(f"data.root: cannot read parquet at {data.root}: {error}") from None
        columns = list(frame.columns)
        wanted = [data.target, *(data.features or ())]
        unknown = [name for name in wanted if name not in columns]
        if unknown:
            field = "data.target" if unknown[0] == data.target else "data.features"
            raise SourceError(f"{field}: no column {unknown[0]!r} in {data.root}; it has {columns}")
        features = list(data.features or [c for c in columns if c != data.target])
        train, val = frame[[*features, data.target]].random_split(
            [1 - data.val_fraction, data.val_fraction], random_state=seed
        )
        return {
            "train": (train[features], train[data.target]),
            "val": (val[features], val[data.target]),
        }
