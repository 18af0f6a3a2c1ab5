"""cifar10: CIFAR-10 in torchvision's on-disk format (pickled batches), under ``data.root``,
local or any fsspec URL. One record a batch file: a partition reads its file once.

``predict`` scores its test batch: the file itself, or the CIFAR-10 folder (or the folder
above it) that holds it."""

import functools
import json
import pickle
from typing import TYPE_CHECKING, Any

import fsspec
import numpy as np
from PIL import Image

from workers.sources import (
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
    register,
    required_root,
)
from workers.sources.images import resize, stack

if TYPE_CHECKING:
    from workers.config_models import DataConfig

CIFAR_FOLDER = "cifar-10-batches-py"
CIFAR_TRAIN = tuple(f"data_batch_{i}" for i in range(1, 6))
CIFAR_TEST = ("test_batch",)
(TEST_BATCH,) = CIFAR_TEST


def cifar10_folder(root: str, storage_options: dict[str, Any]) -> tuple[Any, str]:
    """The filesystem and path of ``root``'s batch folder; a SourceError naming it if absent."""
    fs, base = fsspec.core.url_to_fs(root.rstrip("/") + "/" + CIFAR_FOLDER, **storage_options)
    if not fs.isdir(base):
        raise SourceError(
            f"data.root: {root}/{CIFAR_FOLDER} does not exist; point data.root at the folder "
            "holding cifar-10-batches-py"
        )
    return fs, base


@register
class Cifar10(Source):
    name = "cifar10"

    @classmethod
    def check_root(cls, data: "DataConfig") -> None:
        cifar10_folder(required_root(data), data.storage_options)

    @classmethod
    def listing(cls, data: "DataConfig", *, seed: int) -> Listing:
        root = required_root(data)
        fs, base = cifar10_folder(root, data.storage_options)
        names = CIFAR_TRAIN + CIFAR_TEST
        missing = [name for name in names if not fs.isfile(f"{base}/{name}")]
        if missing:
            raise SourceError(f"data.root: {root}/{CIFAR_FOLDER} lacks {', '.join(missing)}")
        files = {name: fs.unstrip_protocol(f"{base}/{name}") for name in names}
        stamps = [file_stamp(fs.info(f"{base}/{name}")) for name in names]
        fingerprint = digest("cifar10", list(zip(files.values(), stamps, strict=True)))
        # Sample counts are read from each file at decode time.
        return Listing(
            train=[files[name] for name in CIFAR_TRAIN],
            val=[files[name] for name in CIFAR_TEST],
            classes=[f"class{i}" for i in range(10)],
            fingerprint=fingerprint,
            partition_size=1,
        )

    @classmethod
    def decode(cls, records: list[Any], how: Decoding) -> Decoded:
        images: list[np.ndarray] = []
        labels: list[int] = []
        bad: list[tuple[str, str]] = []
        for url in records:
            try:
                with fsspec.open(url, "rb", **how.storage_options) as f:
                    batch = pickle.load(f, encoding="latin1")
                data = np.asarray(batch["data"], dtype=np.uint8).reshape(-1, 3, 32, 32)
                batch_labels = [int(v) for v in batch["labels"]]
                if len(batch_labels) != len(data):
                    raise ValueError(f"{len(data)} images but {len(batch_labels)} labels")
            except (EOFError, OSError, ValueError, KeyError, pickle.UnpicklingError) as error:
                why = f"{type(error).__name__}: {error}"
                if how.on_bad == "fail":
                    raise SourceError(f"{url}: not a readable CIFAR-10 batch ({why})") from error
                bad.append((url, why))
                continue
            for image in data:
                if how.image_size != 32:
                    image = resize(Image.fromarray(image.transpose(1, 2, 0)), how.image_size)
                images.append(image)
            labels.extend(batch_labels)
        return Decoded(*stack(images, labels, how.image_size), bad=bad)

    @classmethod
    def prediction_input(
        cls, fs: Any, path: str, url: str, request: InputRequest
    ) -> InputPlan | None:
        batch = _test_batch(fs, path)
        if batch is None:
            return None
        batch_url = fs.unstrip_protocol(batch)
        parts = [
            Partition(i, lo, hi, "cifar10", batch_url, split=TEST_BATCH, rows=(lo, hi))
            for i, (lo, hi) in enumerate(request.ranges(_batch_size(fs, batch)))
        ]
        return InputPlan("cifar10", batch_url, parts, [f"class{i}" for i in range(10)])

    @classmethod
    def prediction_images(
        cls, partition: Partition, how: Decoding
    ) -> tuple[np.ndarray, np.ndarray]:
        assert partition.rows is not None
        images, labels = _decoded_batch(
            partition.url, how.image_size, json.dumps(how.storage_options, sort_keys=True)
        )
        lo, hi = partition.rows
        return images[lo:hi], labels[lo:hi]


@functools.lru_cache(maxsize=2)
def _decoded_batch(url: str, image_size: int, options: str) -> tuple[np.ndarray, np.ndarray]:
    # One pickled batch holds 10,000 images: its partitions on this worker decode it once.
    decoded = Cifar10.decode([url], Decoding(image_size, storage_options=json.loads(options)))
    return decoded.images, decoded.labels


def _test_batch(fs: Any, path: str) -> str | None:
    if fs.isfile(path):
        return path if path.rstrip("/").endswith(TEST_BATCH) else None
    for candidate in (f"{path}/{TEST_BATCH}", f"{path}/{CIFAR_FOLDER}/{TEST_BATCH}"):
        if fs.isfile(candidate):
            return candidate
    return None


def _batch_size(fs: Any, batch: str) -> int:
    """How many images the batch file holds, checked against its labels."""
    try:
        with fs.open(batch, "rb") as f:
            content = pickle.load(f, encoding="latin1")
        count = len(content["labels"])
        if len(content["data"]) != count or np.asarray(content["data"]).shape[1:] != (3072,):
            raise ValueError("images and labels do not match, or images are not 3x32x32")
    except (EOFError, OSError, ValueError, KeyError, TypeError, pickle.UnpicklingError) as error:
        raise SourceError(
            f"--input: {fs.unstrip_protocol(batch)}: not a readable CIFAR-10 batch "
            f"({type(error).__name__}: {error})"
        ) from None
    return count
