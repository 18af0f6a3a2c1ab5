"""Data parallelism across ranks with DistributedDataParallel."""

import torch
from pydantic import BaseModel
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from workers.layout import Layout
from workers.precision import Precision
from workers.strategies.base import WholeModel, register


def apply_ddp(model: nn.Module, *, device: torch.device) -> DistributedDataParallel:
    """Move ``model`` to this rank's device and wrap it so gradients are averaged across ranks.

    The process group must already be initialized. DDP broadcasts rank 0's parameters at
    construction, so every rank starts from the same numbers even if they were built differently.
    """
    model = model.to(device)
    if device.type == "cuda":
        return DistributedDataParallel(model, device_ids=[device.index])
    return DistributedDataParallel(model)


@register
class DDP(WholeModel):
    """Every rank trains the whole model on its share of the batch; DDP averages gradients."""

    name = "ddp"

    @classmethod
    def prepare(
        cls,
        model: nn.Module,
        *,
        layout: Layout,
        rank: int,
        device: torch.device,
        settings: BaseModel | None = None,
        precision: Precision,
        sample: torch.Tensor | None = None,
    ) -> "DDP":
        return cls(apply_ddp(model, device=device), layout=layout, rank=rank, device=device)
