"""The trained model handed to the client in pieces, so that no rank gathers it whole.

Each rank sends what it holds and no other rank sends: the local piece of a sharded or split
tensor (a DTensor) where the rank is the first of its replicas, and plain tensors from one
rank that the strategy names. The client puts the pieces together (:func:`assemble`). A model
larger than one worker thus ends a job as it trained: spread over the ranks.
"""

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np
import torch
from torch.distributed.tensor import DTensor

from workers.compat.torch_private import local_offsets

NUMPY_DTYPES = {
    torch.float64, torch.float32, torch.float16, torch.int64, torch.int32, torch.int16,
    torch.int8, torch.uint8, torch.bool,
}  # fmt: skip


@dataclass(frozen=True)
class Piece:
    """One rank's part of a tensor of the model: ``value`` at ``offsets`` in the whole tensor,
    whose shape is ``shape``.

    ``value`` is a NumPy array over the rank's own memory where NumPy has the dtype: Dask
    pickles it to out-of-band buffers, without a copy (measured in one process: a 400 MB
    piece serialized for sending added nothing to the resident set), where a tensor is
    pickled through a copy of its bytes."""

    value: np.ndarray | torch.Tensor
    offsets: tuple[int, ...]
    shape: tuple[int, ...]

    @property
    def tensor(self) -> torch.Tensor:
        """``value`` as a tensor; over a read-only buffer (as it arrived), a copy of it."""
        if not isinstance(self.value, np.ndarray):
            return self.value
        return torch.from_numpy(self.value if self.value.flags.writeable else self.value.copy())


def _first_replica(tensor: DTensor) -> bool:
    """Whether this rank is the first on every mesh dimension ``tensor`` is replicated over:
    its piece is sent by it alone."""
    coordinate = tensor.device_mesh.get_coordinate()
    assert coordinate is not None  # every rank of the job is in the model's meshes
    return all(
        at == 0
        for at, placement in zip(coordinate, tensor.placements, strict=True)
        if placement.is_replicate()
    )


def own_pieces(state: Mapping[str, torch.Tensor], *, sends_plain: bool) -> dict[str, Piece]:
    """This rank's pieces of ``state`` (a module's ``state_dict``), copied to the CPU: every
    DTensor's local piece where this rank is its first replica, and the plain tensors if
    ``sends_plain`` (the rank the strategy picks among those that hold the same ones)."""
    pieces = {}
    for name, tensor in state.items():
        if isinstance(tensor, DTensor):
            if not _first_replica(tensor):
                continue
            local, offsets = tensor.to_local(), local_offsets(tensor)
        elif sends_plain:
            local, offsets = tensor, (0,) * tensor.dim()
        else:
            continue
        value = local.detach().cpu()
        # The rank is done with it: shared, not copied (a piece in a dtype NumPy lacks, bf16,
        # is copied, so that it holds only its own bytes).
        shared = value.numpy() if value.dtype in NUMPY_DTYPES else value.clone()
        pieces[name] = Piece(shared, offsets, tuple(tensor.shape))
    return pieces


def assemble(parts: Iterable[Mapping[str, Piece]]) -> dict[str, torch.Tensor]:
    """The whole model's tensors from every rank's pieces, in the order first sent.

    A piece sent again at the same place (copies a DTensor's mesh does not see: the tp ranks
    of a layer FSDP shards but the plan leaves whole) is checked and dropped: copies that
    differ are a bug. So is a tensor whose pieces do not cover it."""
    whole: dict[str, torch.Tensor] = {}
    seen: dict[str, dict[tuple[int, ...], torch.Tensor]] = {}
    for part in parts:
        for name, piece in part.items():
            value = piece.tensor
            if name not in whole:
                entire = tuple(value.shape) == piece.shape
                whole[name] = value if entire else torch.empty(piece.shape, dtype=value.dtype)
                seen[name] = {}
            earlier = seen[name].get(piece.offsets)
            if earlier is not None and earlier.shape == value.shape:
                if not torch.equal(earlier, value):
                    raise ValueError(f"model pieces: two ranks' copies of {name} differ")
                continue
            seen[name][piece.offsets] = value
            if whole[name] is not value:
                at = tuple(slice(o, o + n) for o, n in zip(piece.offsets, value.shape, strict=True))
                whole[name][at] = value
    for name, pieces in seen.items():
        count = sum(value.numel() for value in pieces.values())
        if count != whole[name].numel():
            raise ValueError(
                f"model pieces: {name} {tuple(whole[name].shape)} got {count} of "
                f"{whole[name].numel()} values from the ranks"
            )
    return whole
