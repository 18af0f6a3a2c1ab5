"""Datasets and per-rank batch loading.

Every source yields the same thing: normalized ``float32`` images of shape ``(N, 3, 32, 32)`` and
``int64`` labels, split into train and validation. Normalization statistics are computed from the
training split, never hard-coded, so a new source needs no magic numbers.
"""

import functools
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler

IMAGE_SIZE = 32


class DataConfig(BaseModel):
    """Where the images come from and how ranks read them."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    dataset: Literal["digits", "cifar10", "synthetic"] = "digits"
    root: Path | None = Field(
        default=None, description="cifar10: folder holding cifar-10-batches-py (or to download to)"
    )
    download: bool = Field(default=False, description="cifar10: fetch the archive if missing")
    verify_checksums: bool = Field(
        default=True, description="cifar10: compare the batch files with the official MD5 sums"
    )
    val_fraction: float = Field(default=0.2, gt=0.0, lt=1.0, description="digits, synthetic")
    synthetic_samples: int = Field(default=4096, ge=16, description="synthetic: training samples")
    loader_workers: int = Field(
        default=0, ge=0, le=16, description="DataLoader worker processes per rank"
    )
    drop_last: bool = Field(default=False, description="drop each rank's last partial batch")

    @model_validator(mode="after")
    def _cifar_needs_root(self) -> "DataConfig":
        if self.dataset == "cifar10" and self.root is None:
            raise ValueError("data.root: the cifar10 dataset needs a root folder")
        return self


@dataclass(frozen=True)
class ImageSplits:
    train_x: torch.Tensor
    train_y: torch.Tensor
    val_x: torch.Tensor
    val_y: torch.Tensor
    num_classes: int


class DatasetError(ValueError):
    """A dataset could not be read; the message names the file or folder."""


@functools.lru_cache(maxsize=2)
def load_dataset(config: DataConfig, *, seed: int) -> ImageSplits:
    """Load ``config.dataset`` and return normalized train/validation tensors.

    Kept per process (the last two datasets), so the next job on a warm cluster starts at
    once; callers index the tensors and never write to them.
    """
    if config.dataset == "digits":
        x, y = _digits()
        (train_x, train_y), (val_x, val_y) = _split(x, y, config.val_fraction, seed)
    elif config.dataset == "cifar10":
        assert config.root is not None  # checked by DataConfig
        train_x, train_y = _cifar10(config, train=True)
        val_x, val_y = _cifar10(config, train=False)
    else:
        x, y = _synthetic(config.synthetic_samples, seed)
        (train_x, train_y), (val_x, val_y) = _split(x, y, config.val_fraction, seed)
    mean = train_x.mean(dim=(0, 2, 3), keepdim=True)
    std = train_x.std(dim=(0, 2, 3), keepdim=True).clamp_min(1e-6)
    return ImageSplits(
        train_x=((train_x - mean) / std).contiguous(),
        train_y=train_y,
        val_x=((val_x - mean) / std).contiguous(),
        val_y=val_y,
        num_classes=10,
    )


def _digits() -> tuple[torch.Tensor, torch.Tensor]:
    # scikit-learn ships these 1,797 8x8 scans, so tests and the demo need no download.
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = torch.from_numpy(digits.images.astype(np.float32) / 16.0).unsqueeze(1)
    images = F.interpolate(images, size=(IMAGE_SIZE, IMAGE_SIZE), mode="bilinear")
    return images.expand(-1, 3, -1, -1).contiguous(), torch.from_numpy(digits.target).long()


def source_problem(config: DataConfig) -> str | None:
    """Why the dataset's files are not where config says, or None. Returned rather than raised
    so that a preflight check on a worker does not log a traceback there."""
    if config.dataset == "cifar10" and not config.download:
        from torchvision.datasets import CIFAR10

        assert config.root is not None
        folder = Path(config.root).expanduser() / CIFAR10.base_folder
        if not folder.is_dir():
            return (
                f"data.root: {folder} does not exist; point data.root at the folder holding "
                "cifar-10-batches-py, or set data.download = true"
            )
        names = [name for name, _ in CIFAR10.train_list + CIFAR10.test_list]
        missing = [name for name in names if not (folder / name).is_file()]
        if missing:
            return f"data.root: {folder} lacks {', '.join(missing)}"
    return None


def _cifar10(config: DataConfig, *, train: bool) -> tuple[torch.Tensor, torch.Tensor]:
    from torchvision.datasets import CIFAR10

    dataset_class = CIFAR10
    if not config.verify_checksums:
        # The official MD5 sums only fit the official files. Without them torchvision checks
        # that each file exists; a damaged one still fails below, when it is unpickled.
        class _UncheckedCIFAR10(CIFAR10):
            train_list = [[name, None] for name, _ in CIFAR10.train_list]
            test_list = [[name, None] for name, _ in CIFAR10.test_list]
            meta = {**CIFAR10.meta, "md5": None}

        dataset_class = _UncheckedCIFAR10

    if problem := source_problem(config):
        raise DatasetError(problem)
    assert config.root is not None
    root = Path(config.root).expanduser()
    try:
        dataset = dataset_class(str(root), train=train, download=config.download)
    except RuntimeError as error:  # torchvision's integrity check failed
        raise DatasetError(
            f"data.root: {root / CIFAR10.base_folder}: {error} (files that are not the official "
            "ones need data.verify_checksums = false)"
        ) from error
    except (EOFError, OSError, ValueError, KeyError, pickle.UnpicklingError) as error:
        raise DatasetError(
            f"data.root: could not read the CIFAR-10 batches under {root / CIFAR10.base_folder}:"
            f" {error!r}"
        ) from error
    images = torch.from_numpy(dataset.data).permute(0, 3, 1, 2).float().div_(255.0)
    return images.contiguous(), torch.tensor(dataset.targets, dtype=torch.long)


def _synthetic(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A learnable image set of any size: each class is a fixed random pattern plus noise."""
    generator = torch.Generator().manual_seed(seed + 7919)
    templates = torch.randn(10, 3, IMAGE_SIZE, IMAGE_SIZE, generator=generator)
    labels = torch.randint(0, 10, (n,), generator=generator)
    noise = torch.randn(n, 3, IMAGE_SIZE, IMAGE_SIZE, generator=generator)
    return templates[labels] + 1.5 * noise, labels


def _split(
    x: torch.Tensor, y: torch.Tensor, val_fraction: float, seed: int
) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    n_val = max(1, round(len(x) * val_fraction))
    val, train = order[:n_val], order[n_val:]
    return (x[train], y[train]), (x[val], y[val])


class _IndexedBatches(torch.utils.data.Dataset):
    """Indexing with a whole list of indices returns a whole batch: one gather instead of
    ``batch_size`` per-sample lookups and a collate."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        index = torch.as_tensor(indices)
        return self.x[index], self.y[index]


def rank_train_loader(
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    rank: int,
    world_size: int,
    batch_size: int,
    seed: int,
    drop_last: bool,
    num_workers: int,
) -> tuple[DataLoader, DistributedSampler]:
    """This rank's shuffled shard in batches of ``batch_size``; call ``sampler.set_epoch``."""
    sampler = DistributedSampler(
        range(len(x)), num_replicas=world_size, rank=rank, shuffle=True, seed=seed
    )
    loader = DataLoader(
        _IndexedBatches(x, y),
        sampler=BatchSampler(sampler, batch_size=batch_size, drop_last=drop_last),
        batch_size=None,
        num_workers=num_workers,
        persistent_workers=num_workers > 0,
    )
    return loader, sampler


def rank_eval_batches(
    x: torch.Tensor, y: torch.Tensor, *, rank: int, world_size: int, batch_size: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's strided share of the validation set, unpadded, so that sums across ranks
    count every sample exactly once."""
    index = torch.arange(rank, len(x), world_size)
    return [(x[chunk], y[chunk]) for chunk in index.split(batch_size)]
