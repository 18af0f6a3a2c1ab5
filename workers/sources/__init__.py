"""The data sources, behind one registry: one module per source says everything about it.

``data.dataset`` names a source, and its module ``workers/sources/<name>.py`` registers a
:class:`Source` subclass under that name. What the source's records become is its ``store``:

- ``"images"`` (``digits``, ``synthetic``, ``cifar10``, ``imagefolder``): the records are listed
  on the client before any graph is built (bad paths, empty class folders and unreadable URLs
  fail there), and each partition of them is decoded inside a Dask task into the images' store
  (``workflows/data/preprocess.py``): ``uint8`` images of shape ``(n, 3, size, size)`` and
  ``int64`` labels.
- ``"text"`` (``text``): listed the same way, then tokenized into windows of tokens by the
  text store (``workflows/data/text_store.py``) with the source module's tokenizers.
- ``"collections"`` (``parquet``, ``zarr``): files a user already has, read as Dask collections
  and trained on the way of ``train(config, data=...)`` (``workflows/jobs/collections.py``):
  nothing is copied into a store by ``preprocess``.

Adding a source means adding its module and its name in ``SOURCES`` (``workers/spec/names.py``;
``data.dataset`` takes these names). An images source implements :meth:`Source.listing` and
:meth:`Source.decode`, and :meth:`Source.check_root` when its root can be missing; a text
source sets ``store = "text"`` and implements :meth:`Source.listing` (the text store reads its
module's tokenizers); a collections source sets ``store = "collections"``, implements
:meth:`Source.collections` and puts its name in ``COLLECTION_SOURCES`` too. A source whose
inputs ``predict`` scores implements :meth:`Source.prediction_input` (list an input into
partitions, on the client) and :meth:`Source.prediction_images` (read one, in a task), and puts
its name in ``PREDICTION_INPUTS``, in the order it is asked
(``workflows/prediction/prediction_input.py`` asks a dataset store first). A test checks that these
names and the modules agree.
This file imports nothing heavy: a config validates with the names alone, and no source module
is imported before a config names it.
"""

import importlib
from typing import TYPE_CHECKING, Any

from workers.sources.base import (
    PREDICTION_INPUTS,
    REGISTERED,
    Decoded,
    Decoding,
    InputPlan,
    InputRequest,
    Listing,
    Partition,
    Source,
    SourceError,
    StoreKind,
    digest,
    look_at_root,
)
from workers.spec.names import COLLECTION_SOURCES, SOURCES

if TYPE_CHECKING:
    from workers.spec.sections import DataConfig

__all__ = [
    "COLLECTION_SOURCES",
    "PREDICTION_INPUTS",
    "SOURCES",
    "Decoded",
    "Decoding",
    "InputPlan",
    "InputRequest",
    "Listing",
    "Partition",
    "Source",
    "SourceError",
    "StoreKind",
    "check_root",
    "decode",
    "digest",
    "get_source",
    "list_records",
    "look_at_root",
    "store_to_build",
]


def get_source(name: str) -> type[Source]:
    if name not in SOURCES:
        raise SourceError(f"data.dataset: unknown dataset {name!r}; choose one of {SOURCES}")
    if name not in REGISTERED:
        importlib.import_module(f"{__name__}.{name}")
    return REGISTERED[name]


def list_records(data: "DataConfig", *, seed: int) -> Listing:
    """Every record of ``data``'s source, split and in store order (runs on the client)."""
    return get_source(data.dataset).listing(data, seed=seed)


def check_root(data: "DataConfig") -> None:
    return get_source(data.dataset).check_root(data)


def store_to_build(dataset: str) -> StoreKind:
    """The store ``preprocess`` builds of ``dataset``: "images" or "text"; a SourceError for a
    source read as collections, which has none."""
    if dataset in COLLECTION_SOURCES:
        raise SourceError(
            f"data.dataset: {dataset} is read as Dask collections when training "
            "(data.collections says how); there is no store to preprocess"
        )
    return get_source(dataset).store


def decode(dataset: str, records: list[Any], how: Decoding) -> Decoded:
    """Decode and resize one partition of ``dataset``'s records (a Dask task)."""
    return get_source(dataset).decode(records, how)
