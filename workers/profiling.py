"""Per-layer cost of a model on this worker's device: what the stage planner balances.

Each top-level layer is timed forward and backward on one micro-batch, and its parameter
and saved-activation bytes are counted, on the device a stage would run on.
"""

import statistics
import time
from dataclasses import dataclass

import torch
from torch import nn

from workers.models import build_model


@dataclass(frozen=True)
class LayerProfile:
    name: str
    seconds: float  # forward + backward of one micro-batch, median of several runs
    param_bytes: int
    activation_bytes: int  # kept for backward per micro-batch in flight
    output_bytes: int  # what crosses to the next stage when the model is cut after this layer


@dataclass(frozen=True)
class DeviceProfile:
    device: str
    memory_bytes: int  # what one stage may use on this device
    micro_batch: int
    layers: tuple[LayerProfile, ...]


def profile_model(
    model_name: str,
    *,
    num_classes: int,
    image_size: int,
    in_channels: int,
    micro_batch: int,
    repeats: int = 7,
) -> DeviceProfile:
    """Profile a registered model on this process's device (a Dask task on a rank worker)."""
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else (torch.device("cpu"))
    )
    model = build_model(model_name, num_classes=num_classes, seed=0, image_size=image_size)
    sample = torch.randn(micro_batch, in_channels, image_size, image_size)
    layers = profile_layers(model.to(device), sample=sample.to(device), repeats=repeats)
    return DeviceProfile(
        device=str(device),
        memory_bytes=_device_memory(device),
        micro_batch=micro_batch,
        layers=tuple(layers),
    )


def profile_layers(
    model: nn.Module, *, sample: torch.Tensor, repeats: int = 7
) -> list[LayerProfile]:
    """Time and measure each top-level child of ``model`` on ``sample``'s device."""
    profiles = []
    x = sample
    for name, layer in model.named_children():
        x = x.detach().requires_grad_(x.is_floating_point())
        times = []
        for attempt in range(repeats + 2):  # two warm-up runs: allocator and kernel choice
            layer.zero_grad(set_to_none=True)
            _synchronize(x.device)
            started = time.perf_counter()
            with _SavedBytes() as saved:
                out = layer(x)
            out.backward(torch.ones_like(out))
            _synchronize(x.device)
            if attempt >= 2:
                times.append(time.perf_counter() - started)
            x.grad = None
        profiles.append(
            LayerProfile(
                name=name,
                seconds=statistics.median(times),
                param_bytes=sum(p.numel() * p.element_size() for p in layer.parameters()),
                activation_bytes=saved.bytes,
                output_bytes=out.numel() * out.element_size(),
            )
        )
        layer.zero_grad(set_to_none=True)
        x = out
    return profiles


class _SavedBytes(torch.autograd.graph.saved_tensors_hooks):
    """Counts the bytes autograd keeps for backward (each storage once)."""

    def __init__(self) -> None:
        self.bytes = 0
        seen: set[int] = set()

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                self.bytes += storage.nbytes()
            return tensor

        super().__init__(pack, lambda tensor: tensor)

    def __enter__(self) -> "_SavedBytes":
        super().__enter__()
        return self


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _device_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    try:
        from distributed import get_worker

        limit = get_worker().memory_manager.memory_limit
    except ValueError:  # not inside a Dask worker
        limit = None
    if limit:
        return int(limit)
    import psutil

    return psutil.virtual_memory().total
