"""Autocast and loss scaling for one ``training.precision`` setting on one device."""

from contextlib import AbstractContextManager, nullcontext

import torch


class Precision:
    """fp32 does nothing; bf16 autocasts; fp16 autocasts and scales the loss (CUDA only)."""

    def __init__(self, precision: str, device: torch.device) -> None:
        if precision == "fp16" and device.type != "cuda":
            raise ValueError(
                "training.precision: fp16 needs a CUDA device (it uses a GradScaler); "
                "use 'bf16' on CPU"
            )
        self.dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
        self.device = device
        self.scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")

    def autocast(self) -> AbstractContextManager:
        if self.dtype is None:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss)

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        self.scaler.step(optimizer)
        self.scaler.update()
