"""Autocast and loss scaling for one ``training.precision`` setting on one device."""

import logging
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

# The CPU features (/proc/cpuinfo's flags) that compute in bfloat16: x86's AVX512-BF16 and AMX,
# Arm's BF16. Without them bfloat16 is emulated: the digits demo took 73.9 s in bf16 against
# 9.2 s in fp32 (issue 60's CPU cluster). On this repository's AVX512-BF16 machine a step of the
# demo's CNN took as long in both (32-42 ms, one thread), so only a CPU without them is warned.
NATIVE_BF16 = frozenset({"avx512_bf16", "amx_bf16", "bf16"})
_warned: set[str] = set()  # what this process has warned about: once each


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


def warn_if_slow(precision: str, device: torch.device) -> None:
    """Say once in this process (rank 0 asks) when ``precision`` is slow on ``device``."""
    slow = slow_precision(precision, device)
    if slow is not None and slow not in _warned:
        _warned.add(slow)
        logger.warning(slow)


def slow_precision(precision: str, device: torch.device, cpuinfo: str | None = None) -> str | None:
    """Why ``precision`` runs slowly on ``device``, or None: bf16 on a CPU without bfloat16
    instructions. ``cpuinfo``: the text of /proc/cpuinfo (read here when None); where there is
    none (not Linux), nothing is known and nothing is said."""
    if precision != "bf16" or device.type != "cpu":
        return None
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return None
    features = {
        flag
        for line in cpuinfo.splitlines()
        if line.split(":")[0].strip() in ("flags", "Features")
        for flag in line.partition(":")[2].split()
    }
    if not features or features & NATIVE_BF16:
        return None
    return (
        "training.precision = 'bf16' on a CPU without bfloat16 instructions (AVX512-BF16, AMX "
        "or Arm's BF16): they are emulated, and a step takes several times as long as in fp32 "
        "(8x on the digits demo); set training.precision = 'fp32' here"
    )
