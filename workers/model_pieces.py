"""The trained model handed to the client in pieces, so that no rank gathers it whole.

Each rank sends what it holds and no other rank sends: the local piece of a sharded or split
tensor (a DTensor) where the rank is the first of its replicas, and plain tensors from one
rank that the strategy names. The client puts the pieces together (:func:`assemble`). A model
larger than one worker thus ends a job as it trained: spread over the ranks.

On a Dask worker the pieces wait on the worker (:func:`hold`) and the rank's result carries
only their names and sizes (:class:`HeldPieces`); the client then takes them a few at a time
(:func:`take`, by ``Client.run``: workflows/runs/model_handback.py). A result holding the pieces
themselves cost its worker a whole copy of them at the end: past
``distributed.worker.memory.spill`` (70% of the limit) Dask spills a finished task's result to
disk, which serializes it (measured: a pipeline stage of 780 MiB took its 3 GiB worker from 2.2
to 3.0 GiB, where its nanny kills it).
"""

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

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


@dataclass(frozen=True)
class HeldPieces:
    """A rank's pieces as its result carries them: where they wait, by name and size."""

    job_id: str
    worker: str  # the address of the worker that holds them
    nbytes: dict[str, int]  # name -> bytes, in the order the rank sent them

    def batches(self, max_bytes: int) -> Iterator[list[str]]:
        """The names in order, a batch at a time of at most ``max_bytes`` (or one piece)."""
        batch: list[str] = []
        size = 0
        for name, nbytes in self.nbytes.items():
            if batch and size + nbytes > max_bytes:
                yield batch
                batch, size = [], 0
            batch.append(name)
            size += nbytes
        if batch:
            yield batch


# job id -> the pieces this worker's rank left for the client. A worker runs one rank at a time.
_waiting: dict[str, dict[str, Piece]] = {}


def hold(job_id: str, pieces: dict[str, Piece], *, worker: str) -> HeldPieces:
    """Leave ``pieces`` on this worker for the client to :func:`take`."""
    forget(job_id, others=True)  # a job that ended without taking its own
    _waiting[job_id] = pieces
    return HeldPieces(job_id, worker, {name: _nbytes(piece) for name, piece in pieces.items()})


def take(job_id: str, names: list[str]) -> dict[str, Piece]:
    """The pieces ``names`` of ``job_id``, given up by this worker (``Client.run`` on it)."""
    waiting = _waiting.get(job_id)
    if waiting is None or any(name not in waiting for name in names):
        raise KeyError(f"this worker holds no pieces {names[:3]} of job {job_id}")
    taken = {name: waiting.pop(name) for name in names}
    if not waiting:
        del _waiting[job_id]
    return taken


def holding() -> bool:
    """Whether this worker holds pieces of any job's model."""
    return bool(_waiting)


def forget(job_id: str | None = None, *, others: bool = False, **_: Any) -> None:
    """Drop the pieces of ``job_id`` (None: every job's; ``others``: every job's but
    ``job_id``'s). Also run with ``Client.run``, which passes ``dask_worker``."""
    if others:
        for key in [key for key in _waiting if key != job_id]:
            del _waiting[key]
    elif job_id is None:
        _waiting.clear()
    else:
        _waiting.pop(job_id, None)


def _nbytes(piece: Piece) -> int:
    value = piece.value
    return value.nbytes if isinstance(value, np.ndarray) else value.numel() * value.element_size()


def _first_replica(tensor: "DTensor") -> bool:
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
    # Here, on a rank: the client imports this module too, and needs neither DTensor (~0.5 s
    # to import) nor the check of torch's private APIs, which imports DTensor's debug tools
    # and through them dynamo and inductor (~0.6 s more).
    from torch.distributed.tensor import DTensor

    from workers.compat.torch_private import local_offsets

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
