"""Models that are not an ``nn.Sequential``, for the traced pipeline cuts: the rank functions
of the tests and the benchmark build them on the workers by these names."""

import torch
import torchvision
from torch import nn


class ResidualNet(nn.Module):
    """A small residual network written as a forward, without batch statistics: a pipeline of
    micro-batches computes exactly what one process computes on the whole batch."""

    def __init__(self, num_classes: int = 10, in_channels: int = 3, width: int = 16) -> None:
        super().__init__()
        self.stem = nn.Conv2d(in_channels, width, kernel_size=3, padding=1)
        self.blocks = nn.ModuleList(
            nn.Sequential(
                nn.Conv2d(width, width, kernel_size=3, padding=1),
                nn.ReLU(),
                nn.Conv2d(width, width, kernel_size=3, padding=1),
            )
            for _ in range(3)
        )
        self.head = nn.Linear(width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.stem(x))
        for block in self.blocks:
            x = torch.relu(x + block(x))
        return self.head(x.mean(dim=(2, 3)))


class NormDropoutNet(nn.Module):
    """A residual network with BatchNorm and Dropout: it computes differently in training and
    in eval mode, and training moves its running statistics."""

    def __init__(self, num_classes: int = 10, in_channels: int = 3, width: int = 8) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, width, kernel_size=3, padding=1),
            nn.BatchNorm2d(width),
            nn.ReLU(),
        )
        self.blocks = nn.ModuleList(
            nn.Sequential(
                nn.Conv2d(width, width, kernel_size=3, padding=1),
                nn.BatchNorm2d(width),
                nn.ReLU(),
                nn.Dropout(0.25),
            )
            for _ in range(2)
        )
        self.head = nn.Sequential(nn.Dropout(0.25), nn.Linear(width, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x.mean(dim=(2, 3)))


def resnet18_group_norm(num_classes: int = 10) -> nn.Module:
    """torchvision's resnet18 with GroupNorm, which keeps no batch statistics."""
    return torchvision.models.resnet18(
        weights=None, num_classes=num_classes, norm_layer=lambda channels: nn.GroupNorm(1, channels)
    )


class DataDependent(nn.Module):
    """Branches on the values of its input: ``torch.export`` cannot trace that."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, kernel_size=3, padding=1)
        self.fc = nn.Linear(8, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv(x)
        if x.sum() > 0:
            x = -x
        return self.fc(x.mean(dim=(2, 3)))


class SharedLayer(nn.Module):
    """Calls one layer twice: a stage cannot begin at it."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 3, kernel_size=3, padding=1)
        self.act = nn.ReLU()
        self.fc = nn.Linear(3, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.act(self.conv(x))
        x = self.act(self.conv(x))
        return self.fc(x.mean(dim=(2, 3)))


MODELS = {
    "residual_net": ResidualNet,
    "norm_dropout_net": NormDropoutNet,
    "resnet18_group_norm": resnet18_group_norm,
    "data_dependent": DataDependent,
    "shared_layer": SharedLayer,
}


def build(name: str, *, seed: int, num_classes: int = 10) -> nn.Module:
    """The model called ``name``, with parameters drawn from ``seed``."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return MODELS[name](num_classes=num_classes)
