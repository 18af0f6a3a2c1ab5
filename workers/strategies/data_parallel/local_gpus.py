"""The seed article's first example: ``nn.DataParallel`` over the GPUs one worker owns."""

import torch
from torch import nn

from workers.devices import declared_gpus, owned_device_indices
from workers.strategies.base import RankPlacement, WholeModel, register


def apply_data_parallel(model: nn.Module, *, device: torch.device) -> nn.Module:
    """Replicate ``model`` over the GPUs this worker owns (see ``workers/devices.py``: a
    dask-cuda worker owns one, a stock worker as many as its ``GPU`` resource says), starting at
    ``device``.

    On a CPU-only worker, or one that owns a single GPU, there is nothing to replicate over:
    the model simply runs.
    """
    model = model.to(device)
    if device.type != "cuda":
        return model
    owned = owned_device_indices(device.index or 0, torch.cuda.device_count(), declared_gpus())
    if len(owned) > 1:
        return nn.DataParallel(model, device_ids=owned, output_device=device)
    return model


@register
class DataParallel(WholeModel):
    """One rank; the GPUs it owns split each batch."""

    name = "data_parallel"

    @classmethod
    def prepare(cls, model: nn.Module, placement: RankPlacement) -> "DataParallel":
        device = placement.device
        wrapped = apply_data_parallel(model, device=device)
        return cls(wrapped, layout=placement.layout, rank=placement.rank, device=device)
