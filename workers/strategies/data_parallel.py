"""The seed article's first example: ``nn.DataParallel`` over the GPUs one worker sees."""

from typing import TYPE_CHECKING

import torch
from torch import nn

from workers.layout import Layout
from workers.strategies.base import WholeModel, register

if TYPE_CHECKING:
    from workers.strategies.pipeline import PipelineConfig


def apply_data_parallel(model: nn.Module, *, device: torch.device) -> nn.Module:
    """Replicate ``model`` over every visible GPU inside this one process.

    On a CPU-only worker there is nothing to replicate over: the model simply runs.
    """
    model = model.to(device)
    if device.type == "cuda" and torch.cuda.device_count() > 1:
        return nn.DataParallel(model)
    return model


@register
class DataParallel(WholeModel):
    """One rank; the GPUs it sees split each batch."""

    name = "data_parallel"

    @classmethod
    def prepare(
        cls,
        model: nn.Module,
        *,
        layout: Layout,
        rank: int,
        device: torch.device,
        pipeline: "PipelineConfig | None" = None,
    ) -> "DataParallel":
        return cls(
            apply_data_parallel(model, device=device), layout=layout, rank=rank, device=device
        )
