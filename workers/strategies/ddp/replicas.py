"""Data parallelism across ranks with DistributedDataParallel."""

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from workers.strategies.base import RankPlacement, WholeModel, register


def apply_ddp(
    model: nn.Module, *, device: torch.device, sync: bool = True
) -> DistributedDataParallel:
    """Move ``model`` to this rank's device and wrap it so gradients are averaged across ranks.

    The process group must already be initialized. With ``sync``, DDP broadcasts rank 0's
    parameters at construction, so every rank starts from the same numbers even if they were
    built differently; without, the caller makes them equal (a live replica's state, received
    next, overwrites them: the broadcast would send the parameters twice).
    """
    model = model.to(device)
    if device.type == "cuda":
        return DistributedDataParallel(model, device_ids=[device.index], init_sync=sync)
    return DistributedDataParallel(model, init_sync=sync)


@register
class DDP(WholeModel):
    """Every rank trains the whole model on its share of the batch; DDP averages gradients."""

    name = "ddp"

    @classmethod
    def prepare(cls, model: nn.Module, placement: RankPlacement) -> "DDP":
        device = placement.device
        wrapped = apply_ddp(model, device=device, sync=not placement.state_arrives)
        return cls(wrapped, layout=placement.layout, rank=placement.rank, device=device)
