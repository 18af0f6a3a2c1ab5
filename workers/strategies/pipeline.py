"""Model and pipeline parallelism with ``torch.distributed.pipelining``, optionally x data parallel.

The model is cut at named top-level children into consecutive stages. Ranks form a
``(pp, dp)`` mesh: the ``pp`` ranks of a row hold one stage each (or several, interleaved)
and pass activations forward and gradients back; the ``dp`` replicas of a stage average
gradients with FSDP2 or DDP. Model parallelism is the degenerate pipeline: one micro-batch,
so only one stage works at a time, exactly the seed article's ModelPart1 → ModelPart2.
"""

import itertools
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)

from workers.config_models import PipelineConfig
from workers.data import StoreSplit, fixed_shape_eval_batches
from workers.layout import Layout
from workers.precision import Precision
from workers.strategies.base import EpochSums, Strategy, register

SCHEDULES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
}


def cut_into_stages(model: nn.Module, split_points: Sequence[str]) -> list[nn.Sequential]:
    """Consecutive stages; stage ``i+1`` starts at ``split_points[i]``.

    Each stage keeps its children's names, so a stage's ``state_dict`` keys are the full model's.
    """
    names = [name for name, _ in model.named_children()]
    if not isinstance(model, nn.Sequential):
        raise ValueError(
            f"model: {type(model).__name__} is not an nn.Sequential of named layers, so it "
            "cannot be cut into pipeline stages"
        )
    positions = []
    for point in split_points:
        if point not in names:
            raise ValueError(
                f"pipeline.split_points: {point!r} names no top-level module; the model's are "
                f"{names}"
            )
        positions.append(names.index(point))
    if positions != sorted(positions) or 0 in positions:
        raise ValueError(
            f"pipeline.split_points: {list(split_points)} must follow the model's order "
            f"{names} and leave the first stage at least one layer"
        )
    bounds = [0, *positions, len(names)]
    children = dict(model.named_children())
    return [
        nn.Sequential(OrderedDict((n, children[n]) for n in names[start:end]))
        for start, end in itertools.pairwise(bounds)
    ]


def even_split(names: Sequence[str], n_stages: int) -> list[str]:
    """Split points that give every stage the same number of layers (the first ones get more)."""
    if n_stages > len(names):
        raise ValueError(
            f"pipeline: {n_stages} stages need at least {n_stages} layers; the model has "
            f"{len(names)} ({list(names)})"
        )
    base, extra = divmod(len(names), n_stages)
    points, at = [], 0
    for stage in range(n_stages - 1):
        at += base + (stage < extra)
        points.append(names[at])
    return points


@dataclass
class Pipeline:
    """This rank's part of a pipeline: its stage modules and the schedule that drives them."""

    stages: list[nn.Module]  # the (possibly FSDP/DDP-wrapped) modules this rank holds
    schedule: object
    is_first: bool
    is_last: bool
    pp_rank: int
    pp_size: int
    dp_rank: int
    dp_size: int
    pp_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup | None
    mesh: DeviceMesh

    def parameters(self) -> list[nn.Parameter]:
        return [p for stage in self.stages for p in stage.parameters()]

    def train(self, mode: bool = True) -> None:
        for stage in self.stages:
            stage.train(mode)


def apply_pipeline(
    model: nn.Module,
    *,
    config: PipelineConfig,
    layout: Layout,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    device: torch.device,
) -> Pipeline:
    """Keep this rank's stages of ``model`` and build the schedule that runs them.

    The default process group must be initialized with ``layout.world_size`` ranks, which form
    the layout's ``(pp, dp)`` mesh. ``config.split_points`` must be resolved. One micro-batch is
    plain model parallelism.
    """
    if dist.get_world_size() != layout.world_size:
        raise ValueError(
            f"pipeline: the layout is for {layout.world_size} ranks, the process group has "
            f"{dist.get_world_size()}"
        )
    if config.split_points is None:
        raise ValueError("pipeline.split_points: resolve them on the client before the ranks")
    pp, dp, n_stages = layout.pp, layout.dp, layout.n_stages
    stages = cut_into_stages(model, config.split_points)
    if len(stages) != n_stages:
        raise ValueError(
            f"pipeline.split_points: {len(config.split_points)} points make {len(stages)} "
            f"stages, but {pp} pipeline ranks x {layout.stages_per_rank} stages per rank need "
            f"{n_stages}"
        )
    mesh = init_device_mesh(device.type, (pp, dp), mesh_dim_names=("pp", "dp"))
    pp_rank, dp_rank = mesh.get_local_rank("pp"), mesh.get_local_rank("dp")
    pp_group = mesh.get_group("pp")
    dp_group = mesh.get_group("dp") if dp > 1 else None
    assert dist.get_rank() == pp_rank * dp + dp_rank

    # Interleaved ("looped") placement: rank r holds stages r, r + pp, r + 2·pp, …
    mine = list(range(pp_rank, n_stages, pp))
    modules, pipeline_stages = [], []
    for index in mine:
        module = _replicate(stages[index].to(device), config=config, mesh=mesh, device=device)
        modules.append(module)
        pipeline_stages.append(PipelineStage(module, index, n_stages, device, group=pp_group))
    n_microbatches = layout.n_microbatches
    schedule_class = ScheduleGPipe if n_microbatches == 1 else SCHEDULES[config.schedule]
    if schedule_class is ScheduleInterleaved1F1B:
        schedule = schedule_class(pipeline_stages, n_microbatches=n_microbatches, loss_fn=loss_fn)
    else:
        (stage,) = pipeline_stages
        schedule = schedule_class(stage, n_microbatches=n_microbatches, loss_fn=loss_fn)
    return Pipeline(
        stages=modules,
        schedule=schedule,
        is_first=0 in mine,
        is_last=n_stages - 1 in mine,
        pp_rank=pp_rank,
        pp_size=pp,
        dp_rank=dp_rank,
        dp_size=dp,
        pp_group=pp_group,
        dp_group=dp_group,
        mesh=mesh,
    )


def _replicate(
    module: nn.Module, *, config: PipelineConfig, mesh: DeviceMesh, device: torch.device
) -> nn.Module:
    """Make the dp replicas of one stage average their gradients."""
    if config.dp == 1:
        return module
    if config.dp_mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        # static_graph=True looks tempting for a fixed pipeline but gives silently wrong
        # parameters with torch 2.14 (measured), so the dynamic reducer stays.
        return DistributedDataParallel(
            module,
            process_group=mesh.get_group("dp"),
            device_ids=[device.index] if device.type == "cuda" else None,
        )
    from torch.distributed.fsdp import fully_shard

    return fully_shard(module, mesh=mesh["dp"])


def full_state_dict(pipeline: Pipeline) -> dict[str, torch.Tensor]:
    """This rank's stages' parameters as plain CPU tensors under the full model's names.

    FSDP shards are gathered, so every dp replica holds the whole stage afterwards.
    """
    state: dict[str, torch.Tensor] = {}
    for module in pipeline.stages:
        plain = module.module if hasattr(module, "module") else module
        for name, value in plain.state_dict().items():
            if hasattr(value, "full_tensor"):
                value = value.full_tensor()
            state[name] = value.detach().cpu().clone()
    return state


def clip_grad_norm(pipeline: Pipeline, max_norm: float) -> torch.Tensor:
    """Clip by the norm of the whole model's gradient, which is spread over the pp ranks."""
    grads = [p.grad for p in pipeline.parameters() if p.grad is not None]
    local = [g.full_tensor() if hasattr(g, "full_tensor") else g for g in grads]
    squared = torch.zeros((), dtype=torch.float64, device=pipeline.mesh.device_type)
    for g in local:
        squared += g.double().pow(2).sum()
    # Every dp replica holds the same (averaged) gradients: summing over pp alone is the norm.
    dist.all_reduce(squared, group=pipeline.pp_group)
    total = squared.sqrt()
    # A Python float scales plain tensors and FSDP's sharded DTensors alike.
    coefficient = min(1.0, max_norm / (float(total) + 1e-6))
    for g in grads:
        g.mul_(coefficient)
    return total


@register
class PipelineStrategy(Strategy):
    """Each rank holds its stages; the schedule runs micro-batches through them."""

    name = "pipeline"

    def __init__(self, pipe: Pipeline, *, layout: Layout, device: torch.device) -> None:
        self.pipe, self.layout, self.device = pipe, layout, device

    @classmethod
    def prepare(
        cls,
        model: nn.Module,
        *,
        layout: Layout,
        rank: int,
        device: torch.device,
        pipeline: PipelineConfig | None = None,
    ) -> "PipelineStrategy":
        if pipeline is None:
            raise ValueError(f"{cls.name}: needs the [pipeline] section, split points resolved")
        pipe = apply_pipeline(
            model, config=pipeline, layout=layout, loss_fn=F.cross_entropy, device=device
        )
        return cls(pipe, layout=layout, device=device)

    @property
    def modules(self) -> list[nn.Module]:
        return self.pipe.stages

    def forward_backward(
        self, x: torch.Tensor, y: torch.Tensor, *, precision: Precision, sums: EpochSums
    ) -> torch.Tensor | None:
        pipe = self.pipe
        # The schedule cuts the batch into micro-batches, runs forward and backward through
        # every stage and averages the gradients over micro-batches.
        losses: list[torch.Tensor] = []
        with precision.autocast():
            logits = pipe.schedule.step(
                *([x] if pipe.is_first else []),
                target=y if pipe.is_last else None,
                losses=losses if pipe.is_last else None,
            )
        if not pipe.is_last:
            return None
        # Micro-batches are equal in size, so their mean loss is the batch's.
        loss = torch.stack(losses).detach().mean()
        sums.add(loss, logits, y)
        return loss

    def clip_grad_norm(self, max_norm: float) -> None:
        clip_grad_norm(self.pipe, max_norm)

    @torch.no_grad()
    def evaluate(
        self, split: StoreSplit, *, batch_size: int, precision: Precision
    ) -> dict[str, float]:
        pipe, device = self.pipe, self.device
        pipe.train(False)
        sums = torch.zeros(3, dtype=torch.float64, device=device)
        for x, y, real in fixed_shape_eval_batches(
            split, rank=pipe.dp_rank, world_size=pipe.dp_size, batch_size=batch_size
        ):
            with precision.autocast():
                # Forward only: no activations are kept for a backward that never comes.
                # The schedule computes its loss_fn on the last stage too; padded rows make that
                # loss wrong, so the sums below come from the real rows of the logits instead.
                logits = pipe.schedule.eval(
                    *([x.to(device)] if pipe.is_first else []),
                    target=y.to(device) if pipe.is_last else None,
                )
            if pipe.is_last:
                logits, y = logits[:real].float(), y[:real].to(device)
                sums[0] += F.cross_entropy(logits, y, reduction="sum").double()
                sums[1] += (logits.argmax(1) == y).sum().double()
                sums[2] += real
        dist.all_reduce(sums)
        loss_sum, correct, count = sums.tolist()
        return {"loss": loss_sum / max(count, 1), "accuracy": correct / max(count, 1)}

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        state = full_state_dict(self.pipe)  # gathers FSDP shards: every replica takes part
        return state if self.pipe.dp_rank == 0 else None
