"""Data parallelism across ranks with DistributedDataParallel."""

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def apply_ddp(model: nn.Module, *, device: torch.device) -> DistributedDataParallel:
    """Move ``model`` to this rank's device and wrap it so gradients are averaged across ranks.

    The process group must already be initialized. DDP broadcasts rank 0's parameters at
    construction, so every rank starts from the same numbers even if they were built differently.
    """
    model = model.to(device)
    if device.type == "cuda":
        return DistributedDataParallel(model, device_ids=[device.index])
    return DistributedDataParallel(model)
