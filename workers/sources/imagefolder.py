"""imagefolder: a class-per-folder tree of images under ``data.root``, local or any fsspec URL;
``train/`` and ``val/`` subfolders when the split is given, else a seeded split.

``predict`` scores any folder of images: class folders (or ``train/`` and ``val/`` of them,
``predict.split`` chosen) give labels; a plain folder of images is scored without."""

import io
from typing import TYPE_CHECKING, Any

import fsspec
import numpy as np
from PIL import Image, UnidentifiedImageError

from workers.sources.base import (
    Decoded,
    Decoding,
    InputPlan,
    InputRequest,
    Listing,
    Partition,
    Source,
    SourceError,
    digest,
    file_stamp,
    look_at_root,
    register,
    required_root,
    split_records,
)
from workers.sources.images import IMAGE_SUFFIXES, resize, stack

if TYPE_CHECKING:
    from workers.spec.sections import DataConfig


def imagefolder_root(root: str, storage_options: dict[str, Any]) -> tuple[Any, str]:
    """The filesystem and path of ``root``; a SourceError naming it if it cannot be read."""
    fs, base, exists = look_at_root(root, storage_options, lambda fs, path: fs.isdir(path))
    if not exists:
        raise SourceError(f"data.root: {root} is not a readable folder")
    return fs, base


def scan_classes(
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
        items.extend((fs.unstrip_protocol(path), name, file_stamp(found[path])) for path in files)
    return items, classes


@register
class ImageFolder(Source):
    name = "imagefolder"

    @classmethod
    def check_root(cls, data: "DataConfig") -> None:
        imagefolder_root(required_root(data), data.storage_options)

    @classmethod
    def listing(cls, data: "DataConfig", *, seed: int) -> Listing:
        root = required_root(data)
        fs, base = imagefolder_root(root, data.storage_options)
        splits = {n: f"{base}/{n}" for n in ("train", "val") if fs.isdir(f"{base}/{n}")}
        if set(splits) == {"train", "val"}:
            train_items, classes = scan_classes(fs, splits["train"], root + "/train")
            val_items, val_classes = scan_classes(fs, splits["val"], root + "/val")
            unknown = sorted(set(val_classes) - set(classes))
            if unknown:
                raise SourceError(
                    f"data.root: {root}/val has classes that {root}/train lacks: "
                    f"{', '.join(unknown)}"
                )
            index = {name: i for i, name in enumerate(classes)}
            train = [(url, index[c]) for url, c, _ in train_items]
            val = [(url, index[c]) for url, c, _ in val_items]
            stamps = train_items + val_items
        else:
            stamps, classes = scan_classes(fs, base, root)
            index = {name: i for i, name in enumerate(classes)}
            records = [(url, index[c]) for url, c, _ in stamps]
            train_i, val_i = split_records(list(range(len(records))), data.val_fraction, seed)
            train, val = [records[i] for i in train_i], [records[i] for i in val_i]
        return Listing(train, val, classes, digest("imagefolder", stamps), 256)

    @classmethod
    def decode(cls, records: list[Any], how: Decoding) -> Decoded:
        images: list[np.ndarray] = []
        labels: list[int] = []
        bad: list[tuple[str, str]] = []
        for url, label in records:
            try:
                with fsspec.open(url, "rb", **how.storage_options) as f:
                    payload = f.read()
                with Image.open(io.BytesIO(payload)) as image:
                    images.append(resize(image.convert("RGB"), how.image_size))
            except (OSError, UnidentifiedImageError, ValueError) as error:
                why = f"{type(error).__name__}: {error}"
                if how.on_bad == "fail":
                    raise SourceError(f"{url}: not a readable image ({why})") from error
                bad.append((url, why))
                continue
            labels.append(label)
        return Decoded(*stack(images, labels, how.image_size), bad=bad)

    @classmethod
    def prediction_input(
        cls, fs: Any, path: str, url: str, request: InputRequest
    ) -> InputPlan | None:
        if not fs.isdir(path):
            return None
        base, shown = path, url
        if fs.isdir(f"{path}/train") and fs.isdir(f"{path}/val"):
            base, shown = f"{path}/{request.split}", f"{url}/{request.split}"
        classes: list[str] | None
        try:
            items, classes = scan_classes(fs, base, shown)
            index = {name: i for i, name in enumerate(classes)}
            records = [(file, index[name]) for file, name, _ in items]
        except SourceError as error:
            if "has no class folders" not in str(error):
                raise SourceError(str(error).replace("data.root:", "--input:")) from None
            # A plain folder of images: scored without labels.
            found = sorted(p for p in fs.find(base) if p.lower().endswith(IMAGE_SUFFIXES))
            if not found:
                raise SourceError(
                    f"--input: {url} holds no images ({', '.join(IMAGE_SUFFIXES)}), no dataset "
                    "store and no CIFAR-10 test batch"
                ) from None
            records, classes = [(fs.unstrip_protocol(p), -1) for p in found], None
        prefix = fs.unstrip_protocol(base).rstrip("/") + "/"
        ids = [file.removeprefix(prefix) for file, _ in records]
        parts = [
            Partition(
                i,
                lo,
                hi,
                "imagefolder",
                shown,
                records=tuple(records[lo:hi]),
                ids=tuple(ids[lo:hi]),
            )
            for i, (lo, hi) in enumerate(request.ranges(len(records)))
        ]
        return InputPlan("imagefolder", shown, parts, classes)

    @classmethod
    def prediction_images(
        cls, partition: Partition, how: Decoding
    ) -> tuple[np.ndarray, np.ndarray]:
        decoded = cls.decode(list(partition.records), how)
        return decoded.images, decoded.labels
