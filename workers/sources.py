"""Raw image sources behind one interface: list records on the client, decode them in tasks.

``list_records`` runs on the client before any graph is built (bad paths, empty class folders and
unreadable URLs fail there); ``decode`` runs inside Dask tasks and turns a partition of records
into ``uint8`` images of shape ``(n, 3, size, size)`` and ``int64`` labels. Nothing here imports
torch: preprocessing workers stay small enough for tight memory limits.
"""

import functools
import gzip
import hashlib
import importlib.util
import io
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import fsspec
import numpy as np
from PIL import Image, UnidentifiedImageError

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".webp")
CIFAR_FOLDER = "cifar-10-batches-py"
CIFAR_TRAIN = tuple(f"data_batch_{i}" for i in range(1, 6))
CIFAR_TEST = ("test_batch",)


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
    images: np.ndarray  # (n, 3, size, size) uint8
    labels: np.ndarray  # (n,) int64
    bad: list[tuple[str, str]]  # (record, why) of records skipped under on_bad="skip"


OnBad = Literal["fail", "skip"]


def list_records(
    dataset: str,
    *,
    root: str | None,
    val_fraction: float,
    seed: int,
    synthetic_samples: int,
    storage_options: dict[str, Any] | None = None,
) -> Listing:
    if dataset == "digits":
        n = _digits_count()
        train, val = _split(list(range(n)), val_fraction, seed)
        return Listing(train, val, [str(i) for i in range(10)], digest("digits", n), 512)
    if dataset == "synthetic":
        train, val = _split(list(range(synthetic_samples)), val_fraction, seed)
        return Listing(
            train, val, [str(i) for i in range(10)], digest("synthetic", synthetic_samples), 2048
        )
    if dataset == "cifar10":
        return _list_cifar10(_required_root(dataset, root), storage_options or {})
    if dataset == "imagefolder":
        root = _required_root(dataset, root)
        return _list_imagefolder(root, val_fraction, seed, storage_options or {})
    raise SourceError(f"data.dataset: unknown dataset {dataset!r}")


def _required_root(dataset: str, root: str | None) -> str:
    if root is None:
        raise SourceError(f"data.root: the {dataset} dataset needs a root")
    return root


def check_root(dataset: str, *, root: str | None, storage_options: dict[str, Any] | None) -> None:
    """Fail as ``list_records`` would on a missing root, at the cost of one look at it: what a
    command checks before it starts a cluster (the whole listing comes later, once)."""
    if dataset == "cifar10":
        _cifar10_folder(_required_root(dataset, root), storage_options or {})
    elif dataset == "imagefolder":
        _imagefolder_root(_required_root(dataset, root), storage_options or {})


def decode(
    dataset: str,
    records: list[Any],
    *,
    image_size: int,
    seed: int,
    on_bad: OnBad,
    storage_options: dict[str, Any] | None = None,
) -> Decoded:
    """Decode and resize one partition of records (a Dask task)."""
    if dataset == "digits":
        return _decode_digits(records, image_size)
    if dataset == "synthetic":
        return _decode_synthetic(records, image_size, seed)
    if dataset == "cifar10":
        return _decode_cifar10(records, image_size, on_bad, storage_options or {})
    return _decode_imagefolder(records, image_size, on_bad, storage_options or {})


# -- shared pieces ----------------------------------------------------------------------------


def _split(indices: list[int], val_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    order = np.random.default_rng(seed).permutation(len(indices))
    n_val = max(1, round(len(indices) * val_fraction))
    return sorted(indices[i] for i in order[n_val:]), sorted(indices[i] for i in order[:n_val])


def digest(*parts: object) -> str:
    return hashlib.sha256(repr(parts).encode()).hexdigest()


def _resize(image: Image.Image, size: int) -> np.ndarray:
    if image.size != (size, size):
        image = image.resize((size, size), Image.Resampling.BILINEAR)
    return np.asarray(image, dtype=np.uint8).transpose(2, 0, 1)


def _stack(images: list[np.ndarray], labels: list[int], size: int) -> tuple[np.ndarray, np.ndarray]:
    if not images:
        return np.zeros((0, 3, size, size), np.uint8), np.zeros(0, np.int64)
    return np.stack(images), np.asarray(labels, dtype=np.int64)


# -- digits: scikit-learn's bundled 8x8 scans ------------------------------------------------


# The file load_digits reads: one scan a line.
DIGITS_FILE = ("datasets", "data", "digits.csv.gz")


@functools.cache
def _digits_count() -> int:
    """How many scans scikit-learn ships, from its file and without importing scikit-learn:
    the client lists the dataset on every run to check its store, and the import (SciPy with
    it) is most of a second or two of each CLI run; the workers decode with load_digits."""
    spec = importlib.util.find_spec("sklearn")  # finds the package, runs none of it
    if spec is None or spec.origin is None:
        raise SourceError("data.dataset: digits needs scikit-learn (pip install scikit-learn)")
    with gzip.open(Path(spec.origin).parent.joinpath(*DIGITS_FILE), "rt") as scans:
        return sum(1 for _ in scans)


@functools.cache
def _digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    digits = load_digits()
    return (digits.images * (255 / 16)).round().astype(np.uint8), digits.target.astype(np.int64)


def _decode_digits(records: list[int], size: int) -> Decoded:
    pixels, targets = _digits_arrays()
    images = [_resize(Image.fromarray(pixels[i]).convert("RGB"), size) for i in records]
    return Decoded(*_stack(images, [int(targets[i]) for i in records], size), bad=[])


# -- synthetic: learnable class patterns plus noise, any size -------------------------------


def _decode_synthetic(records: list[int], size: int, seed: int) -> Decoded:
    templates = np.random.default_rng(seed + 7919).normal(size=(10, 3, size, size))
    images, labels = [], []
    for index in records:
        rng = np.random.default_rng((seed, index))
        label = int(rng.integers(10))
        sample = templates[label] + 1.5 * rng.normal(size=(3, size, size))
        images.append(np.clip(sample * 40 + 128, 0, 255).astype(np.uint8))
        labels.append(label)
    return Decoded(*_stack(images, labels, size), bad=[])


# -- cifar10: the torchvision on-disk format (pickled batches) ------------------------------


def _cifar10_folder(root: str, storage_options: dict[str, Any]) -> tuple[Any, str]:
    fs, base = fsspec.core.url_to_fs(root.rstrip("/") + "/" + CIFAR_FOLDER, **storage_options)
    if not fs.isdir(base):
        raise SourceError(
            f"data.root: {root}/{CIFAR_FOLDER} does not exist; point data.root at the folder "
            "holding cifar-10-batches-py"
        )
    return fs, base


def _list_cifar10(root: str, storage_options: dict[str, Any]) -> Listing:
    fs, base = _cifar10_folder(root, storage_options)
    missing = [name for name in CIFAR_TRAIN + CIFAR_TEST if not fs.isfile(f"{base}/{name}")]
    if missing:
        raise SourceError(f"data.root: {root}/{CIFAR_FOLDER} lacks {', '.join(missing)}")
    files = {name: fs.unstrip_protocol(f"{base}/{name}") for name in CIFAR_TRAIN + CIFAR_TEST}
    stamps = [_stamp(fs.info(f"{base}/{name}")) for name in CIFAR_TRAIN + CIFAR_TEST]
    fingerprint = digest("cifar10", list(zip(files.values(), stamps, strict=True)))
    # One record per batch file: a partition reads its file once. Sample counts are read
    # from each file at decode time.
    return Listing(
        train=[files[name] for name in CIFAR_TRAIN],
        val=[files[name] for name in CIFAR_TEST],
        classes=[f"class{i}" for i in range(10)],
        fingerprint=fingerprint,
        partition_size=1,
    )


def _decode_cifar10(
    records: list[str], size: int, on_bad: OnBad, storage_options: dict[str, Any]
) -> Decoded:
    images: list[np.ndarray] = []
    labels: list[int] = []
    bad: list[tuple[str, str]] = []
    for url in records:
        try:
            with fsspec.open(url, "rb", **storage_options) as f:
                batch = pickle.load(f, encoding="latin1")
            data = np.asarray(batch["data"], dtype=np.uint8).reshape(-1, 3, 32, 32)
            batch_labels = [int(v) for v in batch["labels"]]
            if len(batch_labels) != len(data):
                raise ValueError(f"{len(data)} images but {len(batch_labels)} labels")
        except (EOFError, OSError, ValueError, KeyError, pickle.UnpicklingError) as error:
            why = f"{type(error).__name__}: {error}"
            if on_bad == "fail":
                raise SourceError(f"{url}: not a readable CIFAR-10 batch ({why})") from error
            bad.append((url, why))
            continue
        for image in data:
            if size != 32:
                image = _resize(Image.fromarray(image.transpose(1, 2, 0)), size)
            images.append(image)
        labels.extend(batch_labels)
    return Decoded(*_stack(images, labels, size), bad=bad)


# -- imagefolder: a class-per-folder tree of images, local or any fsspec URL ------------------


def _imagefolder_root(root: str, storage_options: dict[str, Any]) -> tuple[Any, str]:
    try:
        fs, base = fsspec.core.url_to_fs(root, **storage_options)
        exists = fs.isdir(base)
    except Exception as error:  # any backend's own error for a bad URL or credentials
        raise SourceError(
            f"data.root: cannot read {root}: {type(error).__name__}: {error}"
        ) from error
    if not exists:
        raise SourceError(f"data.root: {root} is not a readable folder")
    return fs, base


def _list_imagefolder(
    root: str, val_fraction: float, seed: int, storage_options: dict[str, Any]
) -> Listing:
    fs, base = _imagefolder_root(root, storage_options)
    splits = {name: f"{base}/{name}" for name in ("train", "val") if fs.isdir(f"{base}/{name}")}
    if set(splits) == {"train", "val"}:
        train_items, classes = _scan_classes(fs, splits["train"], root + "/train")
        val_items, val_classes = _scan_classes(fs, splits["val"], root + "/val")
        unknown = sorted(set(val_classes) - set(classes))
        if unknown:
            raise SourceError(
                f"data.root: {root}/val has classes that {root}/train lacks: {', '.join(unknown)}"
            )
        index = {name: i for i, name in enumerate(classes)}
        train = [(url, index[c]) for url, c, _ in train_items]
        val = [(url, index[c]) for url, c, _ in val_items]
        stamps = train_items + val_items
    else:
        stamps, classes = _scan_classes(fs, base, root)
        index = {name: i for i, name in enumerate(classes)}
        records = [(url, index[c]) for url, c, _ in stamps]
        train_i, val_i = _split(list(range(len(records))), val_fraction, seed)
        train, val = [records[i] for i in train_i], [records[i] for i in val_i]
    return Listing(train, val, classes, digest("imagefolder", stamps), 256)


def _scan_classes(
    fs: Any, base: str, shown: str
) -> tuple[list[tuple[str, str, tuple[Any, ...]]], list[str]]:
    """(url, class, stamp) of every image under base/<class>/, in sorted order; one listing
    call per class folder brings the stamps along (no stat per file)."""
    classes = sorted(
        entry["name"].rstrip("/").rsplit("/", 1)[-1]
        for entry in fs.ls(base, detail=True)
        if entry["type"] == "directory"
    )
    if not classes:
        raise SourceError(f"data.root: {shown} has no class folders")
    items: list[tuple[str, str, tuple[Any, ...]]] = []
    for name in classes:
        found = fs.find(f"{base}/{name}", detail=True)
        files = sorted(path for path in found if path.lower().endswith(IMAGE_SUFFIXES))
        if not files:
            raise SourceError(f"data.root: class folder {shown}/{name} holds no images")
        items.extend((fs.unstrip_protocol(path), name, _stamp(found[path])) for path in files)
    return items, classes


def _stamp(info: dict[str, Any]) -> tuple[Any, ...]:
    # Size and modification time locally; object stores add an ETag.
    return info.get("size"), info.get("mtime"), info.get("ETag"), info.get("LastModified")


def _decode_imagefolder(
    records: list[tuple[str, int]], size: int, on_bad: OnBad, storage_options: dict[str, Any]
) -> Decoded:
    images: list[np.ndarray] = []
    labels: list[int] = []
    bad: list[tuple[str, str]] = []
    for url, label in records:
        try:
            with fsspec.open(url, "rb", **storage_options) as f:
                payload = f.read()
            with Image.open(io.BytesIO(payload)) as image:
                images.append(_resize(image.convert("RGB"), size))
        except (OSError, UnidentifiedImageError, ValueError) as error:
            why = f"{type(error).__name__}: {error}"
            if on_bad == "fail":
                raise SourceError(f"{url}: not a readable image ({why})") from error
            bad.append((url, why))
            continue
        labels.append(label)
    return Decoded(*_stack(images, labels, size), bad=bad)
