"""The raw sources of a training store, behind one registry: one module per source.

A source lists its records on the client, before any graph is built (bad paths, empty class
folders and unreadable URLs fail there), and decodes a partition of them inside a Dask task.
The images' store (``workflows/preprocess.py``) holds ``uint8`` images of shape
``(n, 3, size, size)`` and ``int64`` labels; the text store (``workflows/text_store.py``)
windows of tokens.

Adding a source means adding its module ``workers/sources/<name>.py``, which registers a
:class:`Source` under its name, and the name in ``SOURCES`` below (``data.dataset`` takes
these names; a test checks they agree). This file imports nothing heavy: a config validates
with the names alone, and no source module is imported before a config names it.
"""

import hashlib
import importlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal

if TYPE_CHECKING:
    import numpy as np

    from workers.config_models import DataConfig

SOURCES = ("digits", "synthetic", "cifar10", "imagefolder", "text")
OnBad = Literal["fail", "skip"]


class SourceError(ValueError):
    """The source cannot be read; the message names the file, folder or URL."""


@dataclass(frozen=True)
class Listing:
    """Every record of a source, split, in the order the store will hold them."""

    train: list[Any]
    val: list[Any]
    classes: list[str]
    fingerprint: str  # changes whenever an input file or a record changes
    partition_size: int = 1024


@dataclass
class Decoded:
    images: "np.ndarray"  # (n, 3, size, size) uint8
    labels: "np.ndarray"  # (n,) int64
    bad: list[tuple[str, str]]  # (record, why) of records skipped under on_bad="skip"


@dataclass(frozen=True)
class Decoding:
    """How a partition's records become images: one for every task of a store."""

    image_size: int
    seed: int = 0
    on_bad: OnBad = "fail"  # "skip": leave a bad record out, and list it in Decoded.bad
    storage_options: dict[str, Any] = field(default_factory=dict)


class Source:
    """One raw source: how its records are listed, checked and decoded."""

    name: ClassVar[str]
    # Which store its records become: "images" (workflows/preprocess.py) or "text"
    # (workflows/text_store.py, which tokenizes with the source's module).
    store: ClassVar[Literal["images", "text"]] = "images"

    @classmethod
    def listing(cls, data: "DataConfig", *, seed: int) -> Listing:
        """Every record, split into train and val (on the client)."""
        raise NotImplementedError

    @classmethod
    def check_root(cls, data: "DataConfig") -> None:
        """Fail as :meth:`listing` would on a missing root, at the cost of one look at it: what a
        command checks before it starts a cluster. Nothing to check by default."""

    @classmethod
    def decode(cls, records: list[Any], how: Decoding) -> Decoded:
        """Decode and resize one partition of records (a Dask task of the images' store)."""
        raise NotImplementedError(f"{cls.name} records are not decoded into images")


_REGISTRY: dict[str, type[Source]] = {}


def register(cls: type[Source]) -> type[Source]:
    """Class decorator: make ``cls`` the source called ``cls.name``."""
    if cls.name not in SOURCES:
        raise ValueError(f"source {cls.name!r}: add its name to SOURCES in workers/sources")
    _REGISTRY[cls.name] = cls
    return cls


def get_source(name: str) -> type[Source]:
    if name not in SOURCES:
        raise SourceError(f"data.dataset: unknown dataset {name!r}; choose one of {SOURCES}")
    if name not in _REGISTRY:
        importlib.import_module(f"{__name__}.{name}")
    return _REGISTRY[name]


def list_records(data: "DataConfig", *, seed: int) -> Listing:
    """Every record of ``data``'s source, split and in store order (runs on the client)."""
    return get_source(data.dataset).listing(data, seed=seed)


def check_root(data: "DataConfig") -> None:
    return get_source(data.dataset).check_root(data)


def decode(dataset: str, records: list[Any], how: Decoding) -> Decoded:
    """Decode and resize one partition of ``dataset``'s records (a Dask task)."""
    return get_source(dataset).decode(records, how)


# -- what the sources share -------------------------------------------------------------------


def split_records(
    indices: list[int], val_fraction: float, seed: int
) -> tuple[list[int], list[int]]:
    """A seeded split of ``indices`` into train and val (at least one val record)."""
    import numpy as np

    order = np.random.default_rng(seed).permutation(len(indices))
    n_val = max(1, round(len(indices) * val_fraction))
    return sorted(indices[i] for i in order[n_val:]), sorted(indices[i] for i in order[:n_val])


def required_root(data: "DataConfig") -> str:
    if data.root is None:
        raise SourceError(f"data.root: the {data.dataset} dataset needs a root")
    return data.root


def digest(*parts: object) -> str:
    return hashlib.sha256(repr(parts).encode()).hexdigest()


def file_stamp(info: dict[str, Any]) -> tuple[Any, ...]:
    """What tells a file changed: size and modification time locally; object stores add an
    ETag."""
    return info.get("size"), info.get("mtime"), info.get("ETag"), info.get("LastModified")
