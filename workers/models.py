"""Model registry. Models are plain ``nn.Module`` code: they never import torch.distributed, so
the same class trains in one process, under DDP, or split into stages."""

from collections.abc import Callable

import torch
from torch import nn

# Re-exported: the section's model lives in a torch-free module, for config checks.
from workers.config_models import ModelConfig as ModelConfig


class CifarCNN(nn.Sequential):
    """The seed article's CIFAR-10 network: two conv/pool blocks and two linear layers.

    A flat ``nn.Sequential`` with named children so that later strategies can cut it into stages
    at named points (``conv1`` … ``fc2``).
    """

    def __init__(self, num_classes: int = 10, in_channels: int = 3, image_size: int = 32) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, 16, kernel_size=3, padding=1)
        self.relu1 = nn.ReLU()
        self.pool1 = nn.MaxPool2d(2)
        self.conv2 = nn.Conv2d(16, 32, kernel_size=3, padding=1)
        self.relu2 = nn.ReLU()
        self.pool2 = nn.MaxPool2d(2)
        self.flatten = nn.Flatten()
        self.fc1 = nn.Linear(32 * (image_size // 4) ** 2, 64)
        self.relu3 = nn.ReLU()
        self.fc2 = nn.Linear(64, num_classes)


class ResidualBlock(nn.Module):
    """Two 3x3 convolutions with a skip connection (no batch norm: micro-batches of a pipeline
    would each see other statistics than the whole batch, and the numbers would drift)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, kernel_size=3, padding=1)
        self.conv2 = nn.Conv2d(channels, channels, kernel_size=3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x + self.conv2(torch.relu(self.conv1(x))))


class SmallResNet(nn.Sequential):
    """A small residual network whose layers cost very different amounts.

    Most of the work sits in the four full-resolution blocks at the front and little in the
    downsampled tail, so cutting it into stages with equal numbers of layers leaves the later
    stages idle: the case the stage planner exists for.
    """

    def __init__(self, num_classes: int = 10, in_channels: int = 3, image_size: int = 32) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(in_channels, 32, kernel_size=3, padding=1), nn.ReLU())
        self.block1 = ResidualBlock(32)
        self.block2 = ResidualBlock(32)
        self.block3 = ResidualBlock(32)
        self.block4 = ResidualBlock(32)
        self.down1 = nn.Sequential(nn.Conv2d(32, 64, 3, stride=2, padding=1), nn.ReLU())
        self.block5 = ResidualBlock(64)
        self.down2 = nn.Sequential(nn.Conv2d(64, 128, 3, stride=2, padding=1), nn.ReLU())
        self.block6 = ResidualBlock(128)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.flatten = nn.Flatten()
        self.fc = nn.Linear(128, num_classes)


MODELS: dict[str, Callable[..., nn.Module]] = {
    "cifar_cnn": CifarCNN,
    "small_resnet": SmallResNet,
}


def build_model(name: str, *, num_classes: int, seed: int, image_size: int = 32) -> nn.Module:
    """Build a registered model with parameters drawn from ``seed``.

    Seeding here (rather than relying on DDP's broadcast alone) makes the single-process
    reference and every rank start from the same numbers.
    """
    if name not in MODELS:
        raise ValueError(f"model.name: unknown model {name!r}; choose one of {sorted(MODELS)}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return MODELS[name](num_classes=num_classes, image_size=image_size)


def layer_names(name: str) -> list[str]:
    """The top-level modules of a registered model: where it can be cut into stages."""
    if name not in MODELS:
        raise ValueError(f"model.name: unknown model {name!r}; choose one of {sorted(MODELS)}")
    with torch.device("meta"):
        return [child for child, _ in MODELS[name]().named_children()]
