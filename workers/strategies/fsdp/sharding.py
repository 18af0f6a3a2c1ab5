"""Sharded data parallelism with FSDP2 (``fully_shard``): ``fsdp`` and ``hsdp``.

Every rank reads its own share of the batch, as under DDP, but holds only a shard of each
parameter, its gradient and its optimizer state: a unit's parameters are all-gathered for its
forward and backward, and its gradients reduce-scattered after. ``hsdp`` shards within groups
of ``dp_shard`` ranks and all-reduces across the ``dp_replicate`` groups, so the gathers stay
within a group (a host) and only the reduced gradients cross hosts.
"""

from contextlib import AbstractContextManager, nullcontext

import torch
from pydantic import BaseModel
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.tensor import DTensor

from workers.data import StoreSplit, fixed_shape_eval_batches
from workers.device_mesh import build_device_mesh
from workers.device_policy import policy_for
from workers.in_place_init import to_device
from workers.model_pieces import Piece, own_pieces
from workers.models import model_blocks
from workers.precision import Precision
from workers.spec.layout import Layout
from workers.spec.plans.fsdp import ShardingSettings
from workers.strategies.base import EpochSums, RankPlacement, WholeModel, register
from workers.strategies.tensor_parallel import apply_tensor_parallel


def apply_fsdp(
    model: nn.Module,
    *,
    mesh: DeviceMesh,
    precision: Precision,
    reshard_after_forward: bool,
    cpu_offload: bool,
) -> FSDPModule:
    """Shard ``model`` over ``mesh``, moving the shards to the mesh's device: a 1-D mesh shards,
    a 2-D ``(dp_replicate, dp_shard)`` mesh is HSDP.

    Each top-level module that holds parameters becomes one unit (the members of a top-level
    ``nn.ModuleList`` or ``nn.ModuleDict`` each one), then the root takes the rest: a unit's
    parameters are gathered only while it runs, so the peak is one unit whole plus every
    shard, not the whole model (torchtitan wraps each transformer block the same way). In
    ``bf16`` the gathered parameters are cast to bf16 and the gradients reduced in fp32
    (``MixedPrecisionPolicy``); the outputs come back in fp32 for the loss.
    """
    if precision.scaler.is_enabled():
        raise ValueError("training.precision: FSDP has no loss scaling for fp16; use 'bf16'")
    dtype = precision.dtype
    mixed = MixedPrecisionPolicy(
        param_dtype=dtype, reduce_dtype=torch.float32 if dtype else None, output_dtype=torch.float32
    )
    offload = CPUOffloadPolicy() if cpu_offload else OffloadPolicy()
    options = {"mesh": mesh, "mp_policy": mixed, "offload_policy": offload}
    for unit in model_blocks(model):
        fully_shard(unit, reshard_after_forward=reshard_after_forward, **options)
    # The root's parameters are gathered for the backward anyway: keeping them saves a gather.
    return fully_shard(model, reshard_after_forward=False, **options)


@register
class FSDP(WholeModel):
    """Every rank trains on its share of the batch and holds a shard of the model."""

    name = "fsdp"
    wrapped: nn.Module  # an FSDPModule, or the split model where nothing is sharded

    @classmethod
    def lays_out_meta(cls, model: nn.Module) -> bool:
        return True  # fully_shard and parallelize_module lay out meta tensors

    @classmethod
    def returns_freed_memory(
        cls, settings: BaseModel | None, *, layout: Layout, device: torch.device
    ) -> bool:
        # A CPU rank holding shards gives back what FSDP frees at once (workers/malloc.py);
        # a GPU's caching allocator keeps its own.
        fsdp = (settings if isinstance(settings, ShardingSettings) else ShardingSettings()).fsdp
        sharded = fsdp.return_freed_memory and layout.dp_shard > 1
        return sharded and policy_for(device).returns_sharded_memory

    @classmethod
    def prepare(cls, model: nn.Module, placement: RankPlacement) -> "FSDP":
        layout, rank, device = placement.layout, placement.rank, placement.device
        settings = placement.settings or ShardingSettings()
        if not isinstance(settings, ShardingSettings):
            raise ValueError(f"{cls.name}: takes ShardingSettings, not {type(settings).__name__}")
        fsdp = settings.fsdp
        if fsdp.cpu_offload and device.type != "cuda":
            raise ValueError(
                f"fsdp.cpu_offload: rank {rank} trains on the CPU, where the shards are in host "
                "memory already; set cpu_offload = false (it moves a GPU's shards to the host)"
            )
        mesh = build_device_mesh(layout, device, keep=("dp_shard",))
        # Left where it was built (the CPU): parallelize_module and fully_shard move each
        # rank's slices and shards to the mesh's device, so the whole model never lands on it.
        if layout.tp > 1:
            model = apply_tensor_parallel(model, mesh=mesh["tp"], plan_path=settings.tp_plan)
        if layout.dp == 1:  # tensor parallelism alone: nothing to shard over
            return cls(to_device(model, device), layout=layout, rank=rank, device=device)
        dp_mesh = mesh["dp_replicate", "dp_shard"] if layout.dp_replicate > 1 else mesh["dp_shard"]
        sharded = apply_fsdp(
            model,
            mesh=dp_mesh,
            precision=placement.precision,
            reshard_after_forward=fsdp.reshard_after_forward,
            cpu_offload=fsdp.cpu_offload,
        )
        return cls(sharded, layout=layout, rank=rank, device=device)

    def _gradient_sync(self, last: bool) -> AbstractContextManager:
        # Micro-batches before the last accumulate unreduced gradients, as DDP's no_sync does.
        if isinstance(self.wrapped, FSDPModule):
            self.wrapped.set_requires_gradient_sync(last)
        return nullcontext()

    def _autocast(self, precision: Precision) -> AbstractContextManager:
        if isinstance(self.wrapped, FSDPModule):
            return nullcontext()  # the mixed-precision policy casts the gathered parameters
        return precision.autocast()  # tensor parallelism alone: no policy, autocast

    def clip_grad_norm(self, max_norm: float) -> None:
        grads = [p.grad for p in self.wrapped.parameters() if p.grad is not None]
        # Sharded and split gradients are DTensors: each rank's norm is of its pieces, and the
        # DTensor's full value is the whole gradient's. A layer the plan leaves whole has the
        # same plain gradient on every rank: its norm is counted once, as it is.
        sharded = [g for g in grads if isinstance(g, DTensor)]
        plain = [g for g in grads if not isinstance(g, DTensor)]
        squares = []
        if sharded:
            squares.append(nn.utils.get_total_norm(sharded).full_tensor().double() ** 2)
        if plain:
            squares.append(nn.utils.get_total_norm(plain).double() ** 2)
        total = float(torch.stack(squares).sum().sqrt())
        # A Python float scales plain tensors and DTensors alike (torch's own clip mixes them).
        coefficient = min(1.0, max_norm / (total + 1e-6))
        for grad in grads:
            grad.mul_(coefficient)

    @torch.no_grad()
    def evaluate(
        self, split: StoreSplit, *, batch_size: int, precision: Precision
    ) -> dict[str, float]:
        self.wrapped.eval()
        layout = self.layout
        sums = EpochSums(device=self.device, criterion=self.criterion)
        # Every forward gathers parameters with every other rank: each rank runs the same
        # number of batches, the last ones padded, and counts only the real rows. The tp ranks
        # of one replica run the same batches; the first of them counts them.
        counts = layout.tp_rank(self.rank) == 0
        for x, y, real in fixed_shape_eval_batches(
            split, rank=layout.dp_rank(self.rank), world_size=layout.dp, batch_size=batch_size
        ):
            with self._autocast(precision):
                logits = self.wrapped(x.to(self.device)).float()
            if real and counts:
                logits, y = logits[:real], y[:real].to(self.device)
                sums.add(self.criterion(logits, y), logits, y)
        return self.criterion.metrics(sums.all_reduced())

    def model_pieces(self) -> dict[str, Piece]:
        # Each rank's shards and slices (DTensors); the plain tensors (buffers, layers the
        # tensor-parallel plan leaves whole) are the same on every rank: the first sends them.
        return own_pieces(self.wrapped.state_dict(), sends_plain=self.rank == 0)


@register
class HSDP(FSDP):
    """FSDP2 within groups of ``parallel.dp_shard`` ranks (a host's GPUs), replicated across the
    ``parallel.dp_replicate`` groups: the layout gives the degrees and :class:`FSDP` builds the
    2-D mesh from them."""

    name = "hsdp"
