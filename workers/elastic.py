"""The step boundary of an elastic job's rank: where its world changes with no step redone.

An elastic job (``launch.world_size = "min:max"``) resizes between two steps: the controller
on the client asks every rank to stop at its next boundary (:func:`request_resize`: workers
joined, a queued job needs some back), or a rank's own worker is leaving (the process-group
plugin's teardown while the worker closes gracefully calls :func:`leaving`). Each rank votes at
every ``ctx.step_done``; the votes are summed by an all-reduce, so every rank stops at the same
step, with its state kept (``workers/live_recovery.py``), and the next generation of the group,
on the new set of workers, continues from it.

The vote runs one step behind: the all-reduce started at one boundary is read at the next, so a
step never waits for it (what a step costs is a few bytes on the wire, in the background). A
resize asked during step ``k`` therefore stops the ranks at the end of step ``k + 1``.
"""

import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# generation -> why it should stop at its next boundary ("joined", "yielded", "retired")
_wanted: dict[str, str] = {}
_lock = threading.Lock()
KEPT = 256  # generations remembered here; a worker's ranks come and go


class ResizeBoundary(BaseException):
    """Raised in a rank at the boundary where every rank agreed to stop for a resize; the rank
    task turns it into its outcome. A BaseException, so that training code's ``except
    Exception`` does not catch it."""

    def __init__(self, step: int) -> None:
        super().__init__(f"stopping at step {step} for a resize")
        self.step = step


def request_resize(generation: str, cause: str, **_: Any) -> bool:
    """Ask this worker's rank of ``generation`` to stop at its next step boundary (run with
    ``Client.run``, which passes ``dask_worker``); the first cause asked stays."""
    with _lock:
        _wanted.setdefault(generation, cause)
        while len(_wanted) > KEPT:
            del _wanted[next(iter(_wanted))]
    return True


def leaving(generation: str) -> None:
    """This worker is closing gracefully: its rank hands off at the next boundary."""
    request_resize(generation, "retired")


def wanted(generation: str) -> str | None:
    """Why this worker's rank of ``generation`` should stop at its next boundary, or None."""
    return _wanted.get(generation)


class Boundary:
    """One rank's vote at each step boundary of one generation (see the module's text)."""

    def __init__(self, generation: str, *, device: "torch.device", backend: str) -> None:
        import torch

        self.generation = generation
        # nccl moves only CUDA tensors; gloo CPU ones.
        self._device = device if backend == "nccl" else torch.device("cpu")
        self._pending: tuple[Any, torch.Tensor] | None = None

    def passed(self, step: int) -> None:
        """Step ``step`` is done and its state kept: vote, and stop here if the previous
        boundary's votes asked for it (raises :class:`ResizeBoundary`)."""
        import torch
        import torch.distributed as dist

        agreed = self._read()
        if agreed:
            raise ResizeBoundary(step)
        vote = torch.tensor([1 if wanted(self.generation) else 0], dtype=torch.int32)
        vote = vote.to(self._device)
        work = dist.all_reduce(vote, op=dist.ReduceOp.MAX, async_op=True)
        self._pending = (work, vote)

    def close(self) -> None:
        """The rank function returned: the vote in flight is finished, on every rank alike."""
        self._read()

    def _read(self) -> bool:
        if self._pending is None:
            return False
        work, vote = self._pending
        self._pending = None
        work.wait()
        return bool(vote.item())
