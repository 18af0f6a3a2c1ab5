"""What the image sources share when they decode: every image resized to one square size, in
the store's layout (``uint8``, channels first)."""

import numpy as np
from PIL import Image

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".webp")


def resize(image: Image.Image, size: int) -> np.ndarray:
    if image.size != (size, size):
        image = image.resize((size, size), Image.Resampling.BILINEAR)
    return np.asarray(image, dtype=np.uint8).transpose(2, 0, 1)


def stack(images: list[np.ndarray], labels: list[int], size: int) -> tuple[np.ndarray, np.ndarray]:
    if not images:
        return np.zeros((0, 3, size, size), np.uint8), np.zeros(0, np.int64)
    return np.stack(images), np.asarray(labels, dtype=np.int64)
