"""What every data source is and shares: the :class:`Source` interface, what its records
become, the registry its modules join (:func:`register`) and the helpers they have in common.
``workers/sources/__init__.py`` finds a source by name."""

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from workers.spec.names import COLLECTION_SOURCES, SOURCES

if TYPE_CHECKING:
    import numpy as np

    from workers.spec.sections import DataConfig

# The sources that predict scores, asked in this order after a dataset store: the folder of
# images last, since any folder of images is one.
PREDICTION_INPUTS = ("cifar10", "imagefolder")
OnBad = Literal["fail", "skip"]
StoreKind = Literal["images", "text", "collections"]


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


@dataclass(frozen=True)
class Partition:
    """One ``predict`` task's share of an input: samples ``start:stop`` of the input order.
    ``kind`` is ``"store"`` (a dataset store) or the name of the source that listed it, which
    also reads it (:meth:`Source.prediction_images`)."""

    index: int
    start: int
    stop: int
    kind: str
    url: str  # the store, or the source's file or folder (a CIFAR-10 batch, an image folder)
    split: str | None = None  # what its rows are of, in sample ids: the store's split, a file
    rows: tuple[int, int] | None = None  # rows of that split or file; None: files one by one
    records: tuple[tuple[str, int], ...] = ()  # (url, input class or -1) of files read one by one
    ids: tuple[str, ...] = ()  # those files' paths below the input folder

    def __len__(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class InputRequest:
    """What the model and ``[predict]`` ask of an input, whatever its kind."""

    image_size: int  # the model's
    channels: int  # the model's first layer's
    split: str  # predict.split
    partition_size: int  # predict.partition_size
    storage_options: dict[str, Any] = field(default_factory=dict)

    def ranges(self, n: int) -> list[tuple[int, int]]:
        """The partitions' (start, stop) of ``n`` samples."""
        return [(lo, min(n, lo + self.partition_size)) for lo in range(0, n, self.partition_size)]


@dataclass(frozen=True)
class InputPlan:
    """An input of ``predict`` listed on the client: its partitions, and its classes when it
    has labels."""

    kind: str  # "store", or the source's name
    url: str
    partitions: list[Partition]
    classes: list[str] | None
    mean: list[float] | None = None  # a store's own statistics
    std: list[float] | None = None

    @property
    def count(self) -> int:
        return sum(len(p) for p in self.partitions)


class Source:
    """One data source: how its records are listed, checked and decoded (or read as Dask
    collections), and how an input of its kind is listed for ``predict``."""

    name: ClassVar[str]
    # What its records become: "images" (workflows/data/preprocess.py), "text"
    # (workflows/data/text_store.py, which tokenizes with the source's module) or "collections"
    # (read by collections(), never built into a store by preprocess).
    store: ClassVar[StoreKind] = "images"

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

    @classmethod
    def collections(cls, data: "DataConfig", *, seed: int) -> dict[str, tuple[Any, Any]]:
        """``{"train": (X, y), "val": (X_val, y_val)}`` as Dask collections (on the client),
        for a source of the "collections" kind."""
        raise SourceError(
            f"data.dataset: {cls.name!r} is not one of {COLLECTION_SOURCES}, the datasets read "
            "as Dask collections"
        )

    @classmethod
    def prediction_input(
        cls, fs: Any, path: str, url: str, request: InputRequest
    ) -> InputPlan | None:
        """``url`` (``path`` on the filesystem ``fs``) listed into partitions for ``predict``,
        or None when it is not an input of this source's kind; a SourceError naming the path
        when it is, but cannot be read. None by default: ``predict`` scores few sources."""
        return None

    @classmethod
    def prediction_images(
        cls, partition: Partition, how: Decoding
    ) -> tuple["np.ndarray", "np.ndarray"]:
        """One partition that :meth:`prediction_input` listed, as ``uint8`` images of
        ``how.image_size`` and their input classes (-1 where unknown), inside a ``predict``
        task."""
        raise NotImplementedError(f"{cls.name} inputs are not scored by predict")


REGISTERED: dict[str, type[Source]] = {}


def register(cls: type[Source]) -> type[Source]:
    """Class decorator: make ``cls`` the source called ``cls.name``."""
    if cls.name not in SOURCES:
        raise ValueError(f"source {cls.name!r}: add its name to SOURCES in workers/spec/names.py")
    REGISTERED[cls.name] = cls
    return cls


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


def look_at_root(
    root: str,
    storage_options: dict[str, Any],
    look: Callable[[Any, str], bool],
    *,
    field: str = "data.root",
) -> tuple[Any, str, bool]:
    """The filesystem and path of ``root`` (a path or an fsspec URL), and what ``look(fs,
    path)`` says of it; a SourceError naming ``field`` where the backend cannot tell (a bad
    URL, missing credentials)."""
    import fsspec

    try:
        fs, path = fsspec.core.url_to_fs(root, **storage_options)
        return fs, path, look(fs, path)
    except Exception as error:  # any backend's own error
        raise SourceError(
            f"{field}: cannot read {root}: {type(error).__name__}: {error}"
        ) from error


def check_files_exist(data: "DataConfig") -> None:
    """A SourceError naming ``data.root`` unless it (a path, a glob or an fsspec URL) names at
    least one file or folder: one look, before anything is read."""
    root = required_root(data)

    def names_something(fs: Any, path: str) -> bool:
        return bool(fs.glob(path)) if any(c in path for c in "*?[") else fs.exists(path)

    if not look_at_root(root, data.storage_options, names_something)[2]:
        raise SourceError(f"data.root: {root} does not exist")


def digest(*parts: object) -> str:
    return hashlib.sha256(repr(parts).encode()).hexdigest()


def file_stamp(info: dict[str, Any]) -> tuple[Any, ...]:
    """What tells a file changed: size and modification time locally; object stores add an
    ETag."""
    return info.get("size"), info.get("mtime"), info.get("ETag"), info.get("LastModified")
