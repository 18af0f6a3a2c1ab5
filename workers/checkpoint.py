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
with an unpickler that admits only DCP's own metadata classes, so a planted payload never runs;
and items that are not tensors, which DCP would unpickle freely, are refused.

The hashes catch accidental damage only: whoever can write the folder can rewrite them. With
``checkpoint.signing_key_file`` the manifest also carries an HMAC-SHA256 of its content, and a
checkpoint without the right one is refused.
"""

import collections
import dataclasses
import functools
import hashlib
import hmac
import io
import json
import logging
import os
import pathlib
import pickle
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from workers.compat.cpython_private import PurePythonUnpickler

# torch.distributed.checkpoint is imported where it is used: it costs ~0.7 s, and the client
# imports this module to find the checkpoint a run continues from, which needs none of it.
# Re-exported: the section's model lives in a torch-free module, for config checks.
from workers.config_models import CheckpointConfig as CheckpointConfig

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"
SIGNATURE = "signature"
PREFIX = "step-"


class CheckpointDamaged(ValueError):
    """A checkpoint that must not be loaded: incomplete, altered, or carrying foreign code."""


@dataclass
class Progress:
    """Where training stands: enough to continue exactly where it stopped."""

    epoch: int = 0  # the epoch in progress (0-based)
    batch: int = 0  # the next batch of that epoch
    step: int = 0  # optimizer steps taken
    # Loss, the task's metric sums, samples (workers/strategies/base.py EpochSums); []: none.
    sums: list[float] = field(default_factory=list)
    history: list[dict[str, float]] = field(default_factory=list)


def _state(
    modules: list[nn.Module], optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler
) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

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
    signing_key_file: str | None = None,
) -> Path | None:
    """Write this rank's part of the built-in trainer's checkpoint; every rank of the default
    group must call it.

    Returns the committed folder on rank 0. ``commit=False`` stops after writing, the state a
    crash between write and commit leaves behind.
    """
    rank = dist.get_rank()
    state = _state(modules, optimizer, scaler)
    state["progress"] = torch.tensor([progress.epoch, progress.batch, progress.step])
    # Each rank's own running sums of the epoch in progress, and its RNG.
    state[f"sums.rank{rank}"] = torch.tensor(progress.sums, dtype=torch.float64)
    state[f"rng.rank{rank}"] = torch.get_rng_state()
    fields = {"epoch": progress.epoch, "batch": progress.batch, "history": progress.history}
    return write_checkpoint(
        directory,
        state,
        step=progress.step,
        keep=keep,
        fields=fields,
        commit=commit,
        signing_key_file=signing_key_file,
    )


def write_checkpoint(
    directory: str | Path,
    tensors: dict[str, Any],
    *,
    step: int,
    keep: int,
    fields: dict[str, Any],
    commit: bool = True,
    signing_key_file: str | None = None,
) -> Path | None:
    """The one way a checkpoint is written (collective): each rank's ``tensors`` through DCP
    into ``.step-<n>.partial``, then rank 0 adds the manifest (``fields`` plus the hash of
    every file, signed with the key in ``signing_key_file`` if given) and renames the folder,
    so it is visible only when complete."""
    rank = dist.get_rank()
    root = Path(directory)
    name = f"{PREFIX}{step:09d}"
    partial = root / f".{name}.partial"
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    dist.barrier()
    import torch.distributed.checkpoint as dcp

    dcp.save(tensors, checkpoint_id=partial)
    dist.barrier()  # every rank's files are on disk
    final = None
    if rank == 0 and commit:
        manifest = {
            "step": step,
            **fields,
            "world_size": dist.get_world_size(),
            "written_at": time.time(),
            "files": {p.name: _sha256(p) for p in sorted(partial.iterdir()) if p.name != MANIFEST},
        }
        if signing_key_file is not None:
            manifest[SIGNATURE] = _signature(manifest, _read_key(signing_key_file))
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


def verify_checkpoint(path: str | Path, signing_key_file: str | None = None) -> dict[str, Any]:
    """The manifest of an intact checkpoint (signed with the key in ``signing_key_file``, when
    given); raises :class:`CheckpointDamaged` otherwise."""
    path = Path(path)
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        files = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise CheckpointDamaged(f"{path}: no readable {MANIFEST} ({error})") from None
    if not isinstance(manifest, dict) or not isinstance(files, dict):
        raise CheckpointDamaged(f"{path}: {MANIFEST} is malformed")
    if signing_key_file is not None:
        signature = manifest.get(SIGNATURE)
        if not isinstance(signature, str):
            raise CheckpointDamaged(
                f"{path}: {MANIFEST} is not signed, and checkpoint.signing_key_file is set"
            )
        expected = _signature(manifest, _read_key(signing_key_file))
        if not hmac.compare_digest(signature, expected):
            raise CheckpointDamaged(
                f"{path}: {MANIFEST}'s signature does not match the key in "
                "checkpoint.signing_key_file"
            )
    present = {p.name for p in path.iterdir() if p.name != MANIFEST}
    if present != set(files):
        raise CheckpointDamaged(
            f"{path}: files {sorted(present ^ set(files))} differ from the manifest"
        )
    for name, digest in files.items():
        if _sha256(path / name) != digest:
            raise CheckpointDamaged(f"{path / name}: checksum differs from the manifest")
    read_metadata(path)  # refuses foreign pickles before DCP would load them
    return manifest


def latest_good_checkpoint(
    directory: str | Path, signing_key_file: str | None = None
) -> tuple[Path, dict[str, Any]] | None:
    """The newest intact checkpoint, warning about each damaged one passed over."""
    for path in list_checkpoints(directory):
        try:
            return path, verify_checkpoint(path, signing_key_file)
        except CheckpointDamaged as error:
            logger.warning("skipping damaged checkpoint: %s", error)
    return None


def load_checkpoint(
    path: str | Path,
    *,
    modules: list[nn.Module],
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    signing_key_file: str | None = None,
) -> Progress:
    """Load a verified checkpoint into this rank's modules and optimizer (collective).

    The world size may differ from the one that wrote it: DCP reshards. The RNG state is
    restored where this rank's was saved.
    """
    path = Path(path)
    # Verified again where it is loaded: the folder may have changed since the client looked.
    manifest = verify_checkpoint(path, signing_key_file)
    metadata = read_metadata(path)
    rank = dist.get_rank()
    state = _state(modules, optimizer, scaler)
    state["progress"] = torch.zeros(3, dtype=torch.int64)
    # Another world size has other ranks: a rank with no saved sums or RNG starts them afresh.
    sums_key, rng_key = f"sums.rank{rank}", f"rng.rank{rank}"
    if sums_key in metadata.state_dict_metadata:
        saved = metadata.state_dict_metadata[sums_key]
        state[sums_key] = torch.zeros(saved.size, dtype=torch.float64)  # the task's length
    if rng_key in metadata.state_dict_metadata:
        state[rng_key] = torch.get_rng_state()
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    dcp.load(state, storage_reader=safe_reader(path), planner=tensors_only_planner())
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
        sums=state[sums_key].tolist() if sums_key in state else [],
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
#
# torch's own restricted unpickler (torch.load(weights_only=True)) reads only the pickle
# protocol torch.save writes (2): DCP writes .metadata with protocol 4+, whose STACK_GLOBAL,
# MEMOIZE and FRAME it refuses. So this one is built on Python's pure-Python unpickler
# (workers.compat.cpython_private), which runs each opcode through a table we can narrow:
# every global is an exact (module, name) pair from the list below (a dotted name, which
# protocol 4 resolves as an attribute chain, is never one), and only the listed classes may be
# called, created or have state set. Opcodes that name objects another way (INST, OBJ,
# NEWOBJ_EX, EXT1/2/4 via copyreg, persistent ids, buffers) are refused.


def _metadata_classes() -> dict[tuple[str, str], Any]:
    from torch.distributed.checkpoint import metadata

    from workers.compat.torch_private import DCP_PRIVATE_CLASSES

    return {
        (metadata.__name__, name): getattr(metadata, name)
        for name in (
            "Metadata",
            "TensorStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "MetadataIndex",
            "StorageMeta",
        )
    } | DCP_PRIVATE_CLASSES


class _MetadataUnpickler(PurePythonUnpickler):
    """Admits what DCP's metadata of a tensors-only checkpoint is made of, nothing else.

    BytesStorageMetadata is left out on purpose: DCP loads a bytes item with
    ``torch.load(weights_only=False)``, and this project only ever saves tensors.
    """

    dispatch = dict(PurePythonUnpickler.dispatch)  # type: ignore[attr-defined]

    def _refuse(self) -> None:
        raise CheckpointDamaged("checkpoint metadata uses a pickle opcode it never needs, refused")

    for _opcode in (
        pickle.INST,
        pickle.OBJ,
        pickle.NEWOBJ_EX,
        pickle.EXT1,
        pickle.EXT2,
        pickle.EXT4,
        pickle.PERSID,
        pickle.BINPERSID,
        pickle.NEXT_BUFFER,
        pickle.READONLY_BUFFER,
    ):
        dispatch[_opcode[0]] = _refuse
    del _opcode

    def __init__(self, file: io.BytesIO) -> None:
        from workers.compat.torch_private import GET_LAYOUT, GET_LAYOUT_NAME, MEM_FORMAT_ENCODING

        super().__init__(file)
        self._classes = _metadata_classes()
        self._plain_classes = set(self._classes.values())
        self._globals = {
            **self._classes,
            ("torch", "Size"): torch.Size,
            GET_LAYOUT_NAME: GET_LAYOUT,
            ("pathlib", "PosixPath"): pathlib.PosixPath,
            ("pathlib", "Path"): pathlib.Path,
            # Where Python 3.13 defines them, and so pickles them from (3.11: the same pairs).
            (pathlib.PosixPath.__module__, "PosixPath"): pathlib.PosixPath,
            (pathlib.Path.__module__, "Path"): pathlib.Path,
            ("collections", "OrderedDict"): collections.OrderedDict,
        }
        # What REDUCE may call: constructors of plain values, and torch's layout lookup.
        self._callables = {
            torch.Size,
            GET_LAYOUT,
            pathlib.PosixPath,
            pathlib.Path,
            collections.OrderedDict,
            MEM_FORMAT_ENCODING,
        }

    def find_class(self, module: str, name: str) -> Any:
        found = self._globals.get((module, name))
        if found is not None:
            return found
        if module == "torch" and name.isidentifier():
            dtype = vars(torch).get(name)  # a module attribute, never a chain
            if isinstance(dtype, torch.dtype):
                return dtype
        raise CheckpointDamaged(f"checkpoint metadata refers to {module}.{name}, refused")

    def load_reduce(self) -> None:
        if self.stack[-2] not in self._callables:
            raise CheckpointDamaged(f"checkpoint metadata calls {self.stack[-2]!r}, refused")
        super().load_reduce()

    def load_newobj(self) -> None:
        if self.stack[-2] not in self._plain_classes:
            raise CheckpointDamaged(f"checkpoint metadata creates {self.stack[-2]!r}, refused")
        super().load_newobj()

    def load_build(self) -> None:
        state, inst = self.stack[-1], self.stack[-2]
        # type(), not isinstance: a class object itself (whose attributes BUILD would set) or
        # a subclass never passes.
        if type(inst) not in self._plain_classes:
            raise CheckpointDamaged(f"checkpoint metadata sets the state of {inst!r}, refused")
        if "__setstate__" in vars(type(inst)):
            if not isinstance(state, tuple):  # TensorProperties: a tuple of plain values
                raise CheckpointDamaged("checkpoint metadata: malformed TensorProperties")
        else:
            fields = {f.name for f in dataclasses.fields(inst)}
            if not isinstance(state, dict) or not set(state) <= fields:
                raise CheckpointDamaged(
                    f"checkpoint metadata: malformed {type(inst).__name__} state"
                )
        super().load_build()

    dispatch[pickle.REDUCE[0]] = load_reduce
    dispatch[pickle.NEWOBJ[0]] = load_newobj
    dispatch[pickle.BUILD[0]] = load_build


def read_metadata(path: Path) -> Any:
    from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

    try:
        data = (path / ".metadata").read_bytes()
    except OSError as error:
        raise CheckpointDamaged(f"{path}: no DCP metadata ({error})") from None
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except CheckpointDamaged as error:
        raise CheckpointDamaged(f"{path / '.metadata'}: {error}") from None
    except Exception as error:
        raise CheckpointDamaged(f"{path / '.metadata'}: unreadable ({error})") from None
    if type(metadata) is not Metadata or not isinstance(metadata.state_dict_metadata, dict):
        raise CheckpointDamaged(f"{path / '.metadata'}: not DCP metadata")
    for key, item in metadata.state_dict_metadata.items():
        if type(item) is not TensorStorageMetadata:
            raise CheckpointDamaged(f"{path / '.metadata'}: {key!r} is not a tensor, refused")
    return metadata


@functools.cache
def _dcp_classes() -> tuple[type, type]:
    """DCP's file reader and load planner, made safe; defined on first use (see the imports)."""
    import torch.distributed.checkpoint as dcp

    class SafeReader(dcp.FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            metadata = read_metadata(Path(self.path))
            if getattr(metadata, "storage_meta", None) is None:
                from torch.distributed.checkpoint.metadata import StorageMeta

                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    class TensorsOnlyPlanner(dcp.DefaultLoadPlanner):
        """DCP's planner, less its bytes path, which unpickles with ``weights_only=False``."""

        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            raise CheckpointDamaged(
                f"checkpoint item {read_item.dest_index.fqn!r} is not a tensor; refused unread"
            )

    return SafeReader, TensorsOnlyPlanner


def safe_reader(path: str | Path) -> Any:
    """A DCP storage reader of ``path`` whose metadata goes through :func:`read_metadata`."""
    return _dcp_classes()[0](path)


def tensors_only_planner() -> Any:
    """A DCP load planner that refuses any item that is not a tensor, unread."""
    return _dcp_classes()[1]()


def _read_key(signing_key_file: str) -> bytes:
    try:
        key = Path(signing_key_file).read_bytes().strip()
    except OSError as error:
        raise ValueError(
            f"checkpoint.signing_key_file: {signing_key_file}: cannot read it "
            f"({error.strerror or error})"
        ) from None
    if not key:
        raise ValueError(f"checkpoint.signing_key_file: {signing_key_file}: the file is empty")
    return key


def _signature(manifest: dict[str, Any], key: bytes) -> str:
    """HMAC-SHA256 over the manifest's canonical JSON, its signature left out."""
    content = {k: v for k, v in manifest.items() if k != SIGNATURE}
    canonical = json.dumps(content, sort_keys=True, separators=(",", ":"), allow_nan=True)
    return "hmac-sha256:" + hmac.new(key, canonical.encode(), hashlib.sha256).hexdigest()


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
