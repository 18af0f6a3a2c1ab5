"""Small datasets written in their real on-disk formats, for tests and benchmarks."""

import pickle
from pathlib import Path

import numpy as np
from PIL import Image


def write_tiny_cifar10(root: Path, *, per_batch: int = 6, seed: int = 0) -> dict:
    """A CIFAR-10 in its real on-disk format: pickled dicts in cifar-10-batches-py (the official
    files are Python 2 pickles whose keys read back as str under encoding="latin1")."""
    rng = np.random.default_rng(seed)
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    batches = {}
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        data = rng.integers(0, 256, size=(per_batch, 3072), dtype=np.uint8)
        labels = [int(v) for v in rng.integers(0, 10, size=per_batch)]
        with open(folder / name, "wb") as f:
            pickle.dump({"batch_label": name, "data": data, "labels": labels}, f)
        batches[name] = (data, labels)
    with open(folder / "batches.meta", "wb") as f:
        pickle.dump({"label_names": [f"class{i}" for i in range(10)]}, f)
    return batches


def write_image_folder(
    root: Path, *, classes=("cat", "dog", "eel"), per_class: int = 5, seed: int = 0
) -> list[Path]:
    """A class-per-folder tree of PNG and JPEG files of assorted sizes."""
    rng = np.random.default_rng(seed)
    files = []
    for c, name in enumerate(classes):
        (root / name).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            h, w = rng.integers(20, 48, size=2)
            pixels = rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8)
            pixels[..., c % 3] //= 2  # a class signal
            path = root / name / (f"{i:03d}.png" if i % 2 else f"{i:03d}.jpg")
            Image.fromarray(pixels).save(path)
            files.append(path)
    return files
