"""A rank's training state kept in its worker's memory across a job's attempts, so that after a
lost worker the job continues from a surviving replica instead of from its last checkpoint.

Under data parallelism every rank holds the same parameters and optimizer state. A rank names
its state once (``ctx.restore(state)``; the built-in trainer does it in its build) and says
after each step where it stands (``ctx.step_done(step)``). Nothing big is copied then: only
the state's small parts (buffers, schedulers, counters) are, because a failure in the next
step's forward may already have changed them; parameters and optimizer state change only in
the optimizer's step, and a rank whose optimizer stepped after its last ``step_done`` holds a
state of no known step, which is never used.

When a worker is lost, the surviving ranks' tasks end but their workers keep what they were
given. The launcher asks them what they hold (:func:`held`), picks the newest state
(:func:`choose_source`), and the next attempt's ranks receive it from that rank by broadcast
(:func:`receive`): nothing is redone but the step that was in flight. Checkpoints remain the
way back when no replica survives (one rank; staged or sharded models, where no other rank
holds a lost rank's part).
"""

import copy
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from workers.training_state import apply_state, capture_state


@dataclass(frozen=True)
class LiveSource:
    """The rank whose kept state the next attempt's ranks receive, and its step."""

    rank: int
    step: int
    done_at: float  # wall clock of that step on the source's worker


@dataclass
class Received:
    """What a rank got from the source: the step, the source's progress (the built-in
    trainer's position), and this rank's own progress as it kept it, if it survived."""

    step: int
    progress: dict[str, Any]
    own_progress: dict[str, Any] | None


@dataclass
class _Kept:
    state: Mapping[str, Any]  # modules, optimizers, stateful objects, values
    step: int
    done_at: float
    buffers: dict[str, tuple[list[str], list[torch.Tensor], list[torch.Tensor]]]
    small: tuple[dict[str, Any], dict[str, Any]] = field(default_factory=lambda: ({}, {}))
    progress: dict[str, Any] = field(default_factory=dict)
    clean: bool = True  # no optimizer stepped since ``step``
    hooks: list[Any] = field(default_factory=list)

    def drop(self) -> None:
        for hook in self.hooks:
            hook.remove()
        self.hooks.clear()


# job id -> this worker's kept state. A worker runs one rank of one job at a time.
_kept: dict[str, _Kept] = {}
# job id -> the seconds this worker's rank spent in its latest `receive` of that job's state
# (the broadcast's share of a resize's pause: `received_s`). A few jobs remembered.
_received_s: dict[str, float] = {}
RECEIVED_KEPT = 64


def keep(
    job_id: str,
    state: Mapping[str, Any],
    *,
    step: int,
    replicated: bool | None = None,
    progress: Mapping[str, Any] | None = None,
) -> None:
    """Keep ``state`` (the live objects, not copies) as this rank's state of ``job_id`` at
    ``step``, if it is ``replicated``: every rank holds the same state (None: when every module
    in it is a ``DistributedDataParallel``)."""
    forget()  # an earlier job's state (one that ended without saying so), or this job's last
    modules = {k: v for k, v in state.items() if isinstance(v, nn.Module)}
    if replicated is None:
        replicated = bool(modules) and all(
            isinstance(m, DistributedDataParallel) for m in modules.values()
        )
    if not replicated:
        return  # no other rank could stand in for this one's part: the checkpoint will
    buffers = {}
    for key, module in modules.items():
        named = list(_unwrapped(module).named_buffers())
        live = [b for _, b in named]
        buffers[key] = ([n for n, _ in named], live, [b.detach().clone() for b in live])
    # The caller's dict itself: the loop may put new values under its names as it goes.
    kept = _Kept(state=state, step=step, done_at=time.time(), buffers=buffers)
    for optimizer in state.values():
        if isinstance(optimizer, torch.optim.Optimizer):
            kept.hooks.append(optimizer.register_step_post_hook(_stepped(kept)))
    _kept[job_id] = kept
    step_done(job_id, step, progress=progress)


def step_done(job_id: str, step: int, *, progress: Mapping[str, Any] | None = None) -> None:
    """This rank's kept state is now at ``step``: copy its small parts as of now."""
    kept = _kept.get(job_id)
    if kept is None:
        return
    from workers.compat.torch_private import foreach_copy_

    for _, live, copies in kept.buffers.values():
        if live:
            foreach_copy_(copies, [b.detach() for b in live])
    small = {k: v for k, v in kept.state.items() if not _big(v)}
    tensors, values = capture_state(small) if small else ({}, {})
    kept.small = (_copies(tensors), copy.deepcopy(values))
    kept.progress = _copies(dict(progress or {}))
    kept.step, kept.done_at, kept.clean = step, time.time(), True


def forget(job_id: str | None = None, *, others: bool = False, **_: Any) -> None:
    """Drop the kept state of ``job_id`` (None: every job's; ``others``: every job's but
    ``job_id``'s). Also run with ``Client.run``, which passes ``dask_worker``."""
    if others:
        keys = [key for key in _kept if key != job_id]
    else:
        keys = [job_id] if job_id is not None else list(_kept)
    for key in keys:
        kept = _kept.pop(key, None)
        if kept is not None:
            kept.drop()


def holding() -> bool:
    """Whether this worker keeps any job's state."""
    return bool(_kept)


def held(job_id: str, **_: Any) -> dict[str, Any] | None:
    """What this worker keeps of ``job_id`` (run with ``Client.run``): its step, whether it
    is clean, and when that step was done; None: nothing."""
    kept = _kept.get(job_id)
    if kept is None:
        return None
    return {"step": kept.step, "clean": kept.clean, "done_at": kept.done_at}


def choose_source(
    held_by_rank: list[dict[str, Any] | None], *, checkpoint_step: int | None
) -> LiveSource | None:
    """The rank to continue from: the newest clean kept state, if it is at least as new as the
    newest checkpoint; the lowest such rank on a tie. None: use the checkpoint."""
    usable = [
        (kept["step"], -rank, kept["done_at"])
        for rank, kept in enumerate(held_by_rank)
        if kept and kept["clean"]
    ]
    if not usable:
        return None
    step, negative_rank, done_at = max(usable)
    if checkpoint_step is not None and step < checkpoint_step:
        return None
    return LiveSource(rank=-negative_rank, step=step, done_at=done_at)


def receive(
    job_id: str,
    state: dict[str, Any],
    source: LiveSource,
    *,
    device: torch.device,
    backend: str,
) -> Received:
    """Load the source rank's kept state into ``state`` on every rank (collective)."""
    started = time.perf_counter()
    kept = _kept.get(job_id)
    own_progress = kept.progress if kept is not None else None
    rank = dist.get_rank()
    if rank == source.rank:
        if kept is None or kept.step != source.step:
            raise RuntimeError(
                f"live recovery: rank {rank} was chosen to hand over step {source.step} of job "
                f"{job_id}, but keeps {None if kept is None else kept.step}"
            )
        tensors, values = _capture_kept(kept)
        leaves = list(_leaves(tensors))
        header = {
            "values": values,
            "leaves": [(path, t.shape, t.dtype, t.device.type) for path, t in leaves],
            "progress": _without_tensors(kept.progress),
            "progress_tensors": [(p, t.shape, t.dtype) for p, t in _leaves(kept.progress)],
        }
        sent = [t for _, t in leaves] + [t for _, t in _leaves(kept.progress)]
    else:
        header, sent = None, []
    box = [header]
    dist.broadcast_object_list(box, src=source.rank, device=_wire_device(device, backend))
    header = box[0]
    assert header is not None
    if rank != source.rank:
        sent = [torch.empty(shape, dtype=dtype) for _, shape, dtype, _ in header["leaves"]]
        sent += [torch.empty(shape, dtype=dtype) for _, shape, dtype in header["progress_tensors"]]
    on_wire = [t.to(_wire_device(device, backend)).contiguous() for t in sent]
    for work in [dist.broadcast(t, src=source.rank, async_op=True) for t in on_wire]:
        work.wait()
    count = len(header["leaves"])
    tensors = _nest(
        (path, t.to(device if kind == "cuda" else "cpu"))
        for (path, _, _, kind), t in zip(header["leaves"], on_wire[:count], strict=True)
    )
    progress = _fill(
        header["progress"],
        zip([p for p, _, _ in header["progress_tensors"]], on_wire[count:], strict=True),
    )
    if set(header["values"]) != set(state):
        raise KeyError(
            f"live recovery: rank {source.rank} kept {sorted(header['values'])}, this rank "
            f"restores {sorted(state)}; every rank must restore the same names"
        )
    apply_state(state, tensors, header["values"])
    _received_s[job_id] = time.perf_counter() - started
    while len(_received_s) > RECEIVED_KEPT:
        del _received_s[next(iter(_received_s))]
    return Received(step=source.step, progress=progress, own_progress=own_progress)


def received_s(job_id: str, **_: Any) -> float | None:
    """The seconds this worker's rank spent in its latest :func:`receive` of ``job_id``'s
    state, None if it received none (run with ``Client.run``). A rank that reached the
    broadcast before the others waited there for them too: the least among a generation's
    ranks, the last to arrive, is the broadcast itself."""
    return _received_s.get(job_id)


def _stepped(kept: _Kept) -> Callable[..., None]:
    def hook(*_: Any) -> None:
        kept.clean = False

    return hook


def _big(value: Any) -> bool:
    # Read at recovery, not copied at each step. A GradScaler is here because its state_dict
    # reads the scale from the GPU (a sync every step); it changes only after the optimizer's
    # step, with no collective between, so a failure cannot leave it half a step ahead.
    return isinstance(value, nn.Module | torch.optim.Optimizer | torch.amp.GradScaler)


def _capture_kept(kept: _Kept) -> tuple[dict[str, Any], dict[str, Any]]:
    """The source's state as of its step: parameters and optimizer state as they are (clean:
    untouched since), buffers and small parts as copied then."""
    big = {k: _unwrapped(v) for k, v in kept.state.items() if _big(v)}
    tensors, values = capture_state(big) if big else ({}, {})
    for key, (names, _, copies) in kept.buffers.items():
        for name, saved in zip(names, copies, strict=True):
            if name in tensors[key]:
                tensors[key][name] = saved
    small_tensors, small_values = kept.small
    return tensors | small_tensors, values | small_values


def _unwrapped(value: Any) -> Any:
    return value.module if isinstance(value, DistributedDataParallel) else value


def _wire_device(device: torch.device, backend: str) -> torch.device:
    # nccl moves only CUDA tensors; gloo moves CPU ones (and CUDA ones through the host).
    return device if backend == "nccl" else torch.device("cpu")


def _leaves(tree: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], Any]]:
    if isinstance(tree, torch.Tensor):
        yield path, tree
    elif isinstance(tree, Mapping):
        for key, value in tree.items():
            yield from _leaves(value, (*path, key))


def _nest(leaves: Iterator[tuple[tuple[Any, ...], torch.Tensor]]) -> dict[Any, Any]:
    tree: dict[Any, Any] = {}
    for path, tensor in leaves:
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = tensor
    return tree


def _copies(tree: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return tree.detach().clone()
    if isinstance(tree, Mapping):
        return {k: _copies(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return list(tree)  # records appended later are new objects: a shallow copy holds
    return tree


def _without_tensors(tree: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return None
    if isinstance(tree, Mapping):
        return {k: _without_tensors(v) for k, v in tree.items()}
    return tree


def _fill(tree: Any, leaves: Any) -> Any:
    filled = copy.deepcopy(tree)
    for path, tensor in leaves:
        node = filled
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = tensor.cpu()
    return filled
