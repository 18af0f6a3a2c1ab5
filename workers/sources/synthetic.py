"""synthetic: learnable class patterns plus noise, any number of samples at any size, made
from the seed (nothing to download: benchmarks and tests of scale)."""

from typing import TYPE_CHECKING, Any

import numpy as np

from workers.sources.base import Decoded, Decoding, Listing, Source, digest, register, split_records
from workers.sources.images import stack

if TYPE_CHECKING:
    from workers.spec.sections import DataConfig


@register
class Synthetic(Source):
    name = "synthetic"

    @classmethod
    def listing(cls, data: "DataConfig", *, seed: int) -> Listing:
        n = data.synthetic_samples
        train, val = split_records(list(range(n)), data.val_fraction, seed)
        return Listing(train, val, [str(i) for i in range(10)], digest("synthetic", n), 2048)

    @classmethod
    def decode(cls, records: list[Any], how: Decoding) -> Decoded:
        size, seed = how.image_size, how.seed
        templates = np.random.default_rng(seed + 7919).normal(size=(10, 3, size, size))
        images, labels = [], []
        for index in records:
            rng = np.random.default_rng((seed, index))
            label = int(rng.integers(10))
            sample = templates[label] + 1.5 * rng.normal(size=(3, size, size))
            images.append(np.clip(sample * 40 + 128, 0, 255).astype(np.uint8))
            labels.append(label)
        return Decoded(*stack(images, labels, size), bad=[])
