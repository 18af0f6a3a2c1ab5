"""Checkpoints of the whole training state with ``torch.distributed.checkpoint`` (DCP).

A checkpoint is a directory ``step-<n>`` under the run's checkpoint folder:

  step-000000120/
    .metadata, __<rank>_0.distcp   DCP's files: every rank writes its own part (a pipeline
                                    stage, an FSDP shard; replicated tensors once)
    manifest.json                  progress, history and the SHA-256 of every file, written last

Every rank writes into ``.step-<n>.partial``; once all have finished, rank 0 writes the
manifest and renames the folder, so a checkpoint is visible only when complete. A damaged one
(missing manifest, a file whose hash differs) is skipped. DCP's ``.metadata`` is a pickle,
which ``torch.distributed.checkpoint`` would load with plain ``pickle.load``: here it is read
with an unpickler that admits only DCP's own metadata classes, so a planted payload never runs.
"""

import hashlib
import io
import json
import logging
import os
import pickle
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

# Re-exported: the section's model lives in a torch-free module, for config checks.
from workers.config_models import CheckpointConfig as CheckpointConfig

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"
PREFIX = "step-"


class CheckpointDamaged(ValueError):
    """A checkpoint that must not be loaded: incomplete, altered, or carrying foreign code."""


@dataclass
class Progress:
    """Where training stands: enough to continue exactly where it stopped."""

    epoch: int = 0  # the epoch in progress (0-based)
    batch: int = 0  # the next batch of that epoch
    step: int = 0  # optimizer steps taken
    sums: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])  # loss, correct, count
    history: list[dict[str, float]] = field(default_factory=list)


def _state(
    modules: list[nn.Module], optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler
) -> dict[str, Any]:
    model_state, optimizer_state = get_state_dict(_whole(modules), optimizer)
    # Only the optimizer's tensors (momentum buffers): its hyperparameters come from the config
    # and the LR schedule, and DCP writes non-tensor entries from rank 0 alone, which would
    # lose the other pipeline stages' parameter groups.
    state = {"model": model_state, "optim": {"state": optimizer_state["state"]}}
    if scaler.is_enabled():
        state["scaler"] = {k: torch.tensor(v) for k, v in scaler.state_dict().items()}
    return state


def save_checkpoint(
    directory: str | Path,
    *,
    modules: list[nn.Module],
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    progress: Progress,
    keep: int,
    commit: bool = True,
) -> Path | None:
    """Write this rank's part of a checkpoint; every rank of the default group must call it.

    Returns the committed folder on rank 0. ``commit=False`` stops after writing, the state a
    crash between write and commit leaves behind.
    """
    rank = dist.get_rank()
    root = Path(directory)
    name = f"{PREFIX}{progress.step:09d}"
    partial = root / f".{name}.partial"
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    dist.barrier()
    state = _state(modules, optimizer, scaler)
    state["progress"] = torch.tensor([progress.epoch, progress.batch, progress.step])
    # Each rank's own running sums of the epoch in progress, and its RNG.
    state[f"sums.rank{rank}"] = torch.tensor(progress.sums, dtype=torch.float64)
    state[f"rng.rank{rank}"] = torch.get_rng_state()
    dcp.save(state, checkpoint_id=partial)
    dist.barrier()  # every rank's files are on disk
    final = None
    if rank == 0 and commit:
        manifest = {
            "step": progress.step,
            "epoch": progress.epoch,
            "batch": progress.batch,
            "world_size": dist.get_world_size(),
            "history": progress.history,
            "written_at": time.time(),
            "files": {p.name: _sha256(p) for p in sorted(partial.iterdir()) if p.name != MANIFEST},
        }
        _write_durably(partial / MANIFEST, json.dumps(manifest, indent=1).encode())
        final = root / name
        shutil.rmtree(final, ignore_errors=True)  # a stale one from before a restart
        os.rename(partial, final)
        for old in list_checkpoints(root)[keep:]:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


def list_checkpoints(directory: str | Path) -> list[Path]:
    """Committed checkpoints, newest first (partial ones start with a dot and are not listed)."""
    root = Path(directory)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX)]
    return sorted(found, key=lambda p: p.name, reverse=True)


def verify_checkpoint(path: str | Path) -> dict[str, Any]:
    """The manifest of an intact checkpoint; raises :class:`CheckpointDamaged` otherwise."""
    path = Path(path)
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        files = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise CheckpointDamaged(f"{path}: no readable {MANIFEST} ({error})") from None
    present = {p.name for p in path.iterdir() if p.name != MANIFEST}
    if present != set(files):
        raise CheckpointDamaged(
            f"{path}: files {sorted(present ^ set(files))} differ from the manifest"
        )
    for name, digest in files.items():
        if _sha256(path / name) != digest:
            raise CheckpointDamaged(f"{path / name}: checksum differs from the manifest")
    _read_metadata(path)  # refuses foreign pickles before DCP would load them
    return manifest


def latest_good_checkpoint(directory: str | Path) -> tuple[Path, dict[str, Any]] | None:
    """The newest intact checkpoint, warning about each damaged one passed over."""
    for path in list_checkpoints(directory):
        try:
            return path, verify_checkpoint(path)
        except CheckpointDamaged as error:
            logger.warning("skipping damaged checkpoint: %s", error)
    return None


def load_checkpoint(
    path: str | Path,
    *,
    modules: list[nn.Module],
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
) -> Progress:
    """Load a verified checkpoint into this rank's modules and optimizer (collective).

    The world size may differ from the one that wrote it: DCP reshards. The RNG state is
    restored where this rank's was saved.
    """
    path = Path(path)
    manifest = json.loads((path / MANIFEST).read_text())
    metadata = _read_metadata(path)
    rank = dist.get_rank()
    state = _state(modules, optimizer, scaler)
    state["progress"] = torch.zeros(3, dtype=torch.int64)
    # Another world size has other ranks: a rank with no saved sums or RNG starts them afresh.
    sums_key, rng_key = f"sums.rank{rank}", f"rng.rank{rank}"
    if sums_key in metadata.state_dict_metadata:
        state[sums_key] = torch.zeros(3, dtype=torch.float64)
    if rng_key in metadata.state_dict_metadata:
        state[rng_key] = torch.get_rng_state()
    dcp.load(state, storage_reader=_SafeReader(path))
    _, current = get_state_dict(_whole(modules), optimizer)
    set_state_dict(
        _whole(modules),
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict={
            "state": state["optim"]["state"],
            "param_groups": current["param_groups"],
        },
    )
    if "scaler" in state:
        scaler.load_state_dict({k: v.item() for k, v in state["scaler"].items()})
    if rng_key in state:
        torch.set_rng_state(state[rng_key])
    epoch, batch, step = state["progress"].tolist()
    return Progress(
        epoch=epoch,
        batch=batch,
        step=step,
        sums=state[sums_key].tolist() if sums_key in state else [0.0, 0.0, 0.0],
        history=manifest["history"],
    )


def _whole(modules: list[nn.Module]) -> nn.Module:
    """One module holding this rank's layers under the full model's names.

    A DDP wrapper's ``module.`` prefix and the split into stages both vanish, so a checkpoint's
    keys are the same whatever strategy and world size wrote it.
    """
    plain = [m.module if hasattr(m, "module") else m for m in modules]
    if len(plain) == 1:
        return plain[0]
    holder = nn.Module()
    for module in plain:
        for name, child in module.named_children():
            holder.add_module(name, child)
    return holder


# -- reading DCP's metadata without running foreign code ------------------------------------


class _MetadataUnpickler(pickle.Unpickler):
    """Admits the classes DCP's metadata is made of, nothing that could run code."""

    _MODULES = ("torch.distributed.checkpoint.",)
    _NAMES = {
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("pathlib", "PosixPath"),
        ("pathlib", "Path"),
        ("collections", "OrderedDict"),
    }

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self._NAMES:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module.startswith(self._MODULES):
            found = super().find_class(module, name)
            if isinstance(found, type):  # a dataclass or enum, not a function to call
                return found
        raise CheckpointDamaged(f"checkpoint metadata refers to {module}.{name}, refused")


def _read_metadata(path: Path) -> Any:
    try:
        data = (path / ".metadata").read_bytes()
    except OSError as error:
        raise CheckpointDamaged(f"{path}: no DCP metadata ({error})") from None
    try:
        return _MetadataUnpickler(io.BytesIO(data)).load()
    except CheckpointDamaged as error:
        raise CheckpointDamaged(f"{path / '.metadata'}: {error}") from None
    except Exception as error:
        raise CheckpointDamaged(f"{path / '.metadata'}: unreadable ({error})") from None


class _SafeReader(dcp.FileSystemReader):
    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        metadata = _read_metadata(Path(self.path))
        if getattr(metadata, "storage_meta", None) is None:
            from torch.distributed.checkpoint.metadata import StorageMeta

            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _write_durably(path: Path, data: bytes) -> None:
    with path.open("wb") as file:
        file.write(data)
        file.flush()
        os.fsync(file.fileno())
