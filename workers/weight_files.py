"""A whole model's state dict in a file (``model.weights``), mapped rather than read.

A ``torch.save`` file (``.pt``, ``.pth``, the ``model.pt`` of a run) is opened with
``torch.load(mmap=True)``, a ``.safetensors`` file by its header and a memory map of its data:
either way each tensor is a view of the file's pages, and a rank that copies out its shard
reads only the pages of that shard (workers/in_place_init.py). Every rank opens the same file;
none loads it whole.

A folder is a ``torch.distributed.checkpoint`` (DCP) checkpoint: a run's checkpoint (its
model's tensors, under ``model.``), or ``dcp.save(model.state_dict(), ...)``'s. Its metadata
gives the shapes; each rank then loads its own part of every tensor with DCP, which reshards
(:func:`workers.checkpoint.load_model_tensors`). Such a checkpoint may also lie at an fsspec
URL (a run's checkpoint in a bucket): DCP reads each rank's part from there. A file at a URL is
refused: a ``.pt`` is a zip that ``torch.load`` reads whole, and a mapped file needs a disk.
"""

import json
import mmap
import struct
from pathlib import Path

import torch

from workers.checkpoint import CheckpointDamaged, StorageOptions, local_path, read_metadata
from workers.model_sources import ModelError

# safetensors' dtype names (https://github.com/huggingface/safetensors, the format's spec).
SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


class WeightsError(ModelError):
    """A weights file that cannot give the model its values (names the file and the key)."""


# What a file of the whole state dict is called: refused at a URL, where it cannot be mapped.
WHOLE_FILE_SUFFIXES = (".pt", ".pth", ".bin", ".safetensors")


def open_weights(
    path: str | Path, storage_options: StorageOptions = None
) -> dict[str, torch.Tensor]:
    """The tensors of the state dict in ``path``, each a view of the mapped file; of a DCP
    checkpoint's folder (on disk, or at an fsspec URL), meta tensors (shapes and dtypes
    only)."""
    local = local_path(path, storage_options)
    if local is None:
        if str(path).rstrip("/").endswith(WHOLE_FILE_SUFFIXES):
            raise WeightsError(
                f"model.weights: {path} is a file at a URL, which no rank can map; give a "
                "torch.distributed.checkpoint folder there (a run's checkpoint, or "
                "dcp.save(model.state_dict(), checkpoint_id=url)), of which each rank reads "
                "its part, or copy the file to every worker's disk"
            )
        return checkpoint_tensors(path, storage_options)[0]
    path = local
    if path.is_dir():
        return checkpoint_tensors(path)[0]
    if not path.is_file():
        raise WeightsError(f"model.weights: {path} is neither a file nor a checkpoint's folder")
    try:
        if path.suffix == ".safetensors":
            return _safetensors(path)
        state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except (OSError, RuntimeError, ValueError, struct.error, json.JSONDecodeError) as error:
        raise WeightsError(f"model.weights: {path} cannot be read: {error}") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise WeightsError(
            f"model.weights: {path} holds no state dict of tensors (torch.save(model.state_dict()))"
        )
    return state


def _safetensors(path: Path) -> dict[str, torch.Tensor]:
    with path.open("rb") as file:
        (length,) = struct.unpack("<Q", file.read(8))
        header = json.loads(file.read(length))
        # Copy-on-write: the tensors are writable views, and nothing writes to the file.
        mapped = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_COPY)
    start = 8 + length
    state = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype = SAFETENSORS_DTYPES.get(entry["dtype"])
        if dtype is None:
            raise WeightsError(f"model.weights: {path}: {name} has dtype {entry['dtype']}")
        begin, end = entry["data_offsets"]
        if begin == end:  # an empty tensor has no bytes to map
            state[name] = torch.empty(entry["shape"], dtype=dtype)
            continue
        count = (end - begin) // dtype.itemsize
        flat = torch.frombuffer(mapped, dtype=dtype, count=count, offset=start + begin)
        state[name] = flat.view(entry["shape"])
    return state


def checkpoint_tensors(
    path: str | Path, storage_options: StorageOptions = None
) -> tuple[dict[str, torch.Tensor], str]:
    """The model's tensors in the DCP checkpoint at ``path`` (a folder, or a URL) as meta
    tensors, by their names in the model, and the prefix they have in the checkpoint
    (``"model."`` in a run's)."""
    try:
        items = read_metadata(path, storage_options).state_dict_metadata
    except CheckpointDamaged as error:
        raise WeightsError(f"model.weights: {path} is no readable checkpoint: {error}") from None
    prefix = "model." if any(key.startswith("model.") for key in items) else ""
    tensors = {
        key.removeprefix(prefix): torch.empty(item.size, dtype=item.properties.dtype, device="meta")
        for key, item in items.items()
        if key.startswith(prefix)
    }
    return tensors, prefix
