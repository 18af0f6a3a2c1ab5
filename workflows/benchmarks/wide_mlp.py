"""The FSDP benchmark's model, in a module of its own: the workers import it by its path, and
importing the benchmark's module would bring the client's code into them (and their memory)."""

from torch import nn


def wide_mlp(in_features: int, num_classes: int, width: int = 4096, layers: int = 6) -> nn.Module:
    """``layers`` linear layers of ``width`` x ``width`` between an input and an output layer:
    parameters dominate, activations are small."""
    blocks: list[nn.Module] = [nn.Flatten(), nn.Linear(in_features, width), nn.ReLU()]
    for _ in range(layers - 1):
        blocks += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*blocks, nn.Linear(width, num_classes))
