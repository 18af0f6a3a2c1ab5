"""digits: scikit-learn's bundled 8x8 scans of handwritten digits, 1,797 of them."""

import functools
import gzip
import importlib.util
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from PIL import Image

from workers.sources.base import (
    Decoded,
    Decoding,
    Listing,
    Source,
    SourceError,
    digest,
    register,
    split_records,
)
from workers.sources.images import resize, stack

if TYPE_CHECKING:
    from workers.spec.sections import DataConfig

# The file load_digits reads: one scan a line.
DIGITS_FILE = ("datasets", "data", "digits.csv.gz")


@functools.cache
def digits_count() -> int:
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


@register
class Digits(Source):
    name = "digits"

    @classmethod
    def listing(cls, data: "DataConfig", *, seed: int) -> Listing:
        n = digits_count()
        train, val = split_records(list(range(n)), data.val_fraction, seed)
        return Listing(train, val, [str(i) for i in range(10)], digest("digits", n), 512)

    @classmethod
    def decode(cls, records: list[Any], how: Decoding) -> Decoded:
        pixels, targets = _digits_arrays()
        size = how.image_size
        images = [resize(Image.fromarray(pixels[i]).convert("RGB"), size) for i in records]
        labels = [int(targets[i]) for i in records]
        return Decoded(*stack(images, labels, size), bad=[])
