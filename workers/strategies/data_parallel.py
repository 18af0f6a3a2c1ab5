"""The seed article's first example: ``nn.DataParallel`` over the GPUs one worker sees."""

import torch
from torch import nn


def apply_data_parallel(model: nn.Module, *, device: torch.device) -> nn.Module:
    """Replicate ``model`` over every visible GPU inside this one process.

    On a CPU-only worker there is nothing to replicate over: the model simply runs.
    """
    model = model.to(device)
    if device.type == "cuda" and torch.cuda.device_count() > 1:
        return nn.DataParallel(model)
    return model
