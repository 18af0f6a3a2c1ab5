"""Model and pipeline parallelism with ``torch.distributed.pipelining``, optionally x data parallel.

The model is cut into stages as ``workers/stage_cuts.py`` says (named children of an
``nn.Sequential``, between the blocks of a model that names them, or traced at module paths).
Ranks form a ``(pp, dp, tp)`` mesh: the ``pp`` ranks of a row hold one stage each (or several,
interleaved) and pass activations forward and gradients back; the ``dp`` replicas of a stage are
FSDP2 shards (the mesh's ``dp_shard``), DDP replicas (``dp_replicate``) or both (HSDP), as the
layout says;
the ``tp`` ranks of a replica split each stage's layers by the model's tensor-parallel plan
(stages cut without tracing: a traced stage's layers are graph nodes no plan can name). Model
parallelism is the degenerate pipeline: one micro-batch, so only one stage works at a time,
exactly the seed article's ModelPart1 → ModelPart2.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import (
    Pipe,
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    build_stage,
)
from torch.distributed.tensor.parallel import ParallelStyle
from torch.nn.parallel import DistributedDataParallel

from workers.activation_checkpointing import checkpointed_modules
from workers.compat.torch_private import flatten_mesh
from workers.data import StoreSplit, fixed_shape_eval_batches
from workers.device_mesh import build_device_mesh
from workers.in_place_init import is_meta, to_device
from workers.model_pieces import Piece, own_pieces
from workers.precision import Precision
from workers.spec.layout import Layout
from workers.spec.plans.pipeline import StagingSettings
from workers.spec.sections import PipelineConfig
from workers.stage_cuts import (
    TRACED_AND_CHECKPOINTED,
    check_tensor_parallel_stages,
    cut_into_stages,
    is_traced,
    move_traced_ops,
    trace_stages,
)
from workers.strategies.base import EpochSums, RankPlacement, Strategy, register
from workers.strategies.tensor_parallel import apply_plan_part, tensor_parallel_plan

SCHEDULES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
}


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
    tp_rank: int  # the tp ranks of a replica compute the same losses: the first counts them
    pp_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup | None
    mesh: DeviceMesh
    # Traced stages keep the mode they were traced in: .eval() does not switch BatchNorm to
    # its running statistics or Dropout off. So validation runs through stages traced in eval
    # mode that share the training stages' parameters and buffers; None where FSDP shards
    # them (validation then runs the training stages, and restores the running statistics).
    eval_schedule: object | None = None
    traced: bool = False

    def parameters(self) -> list[nn.Parameter]:
        return [p for stage in self.stages for p in stage.parameters()]

    def train(self, mode: bool = True) -> None:
        for stage in self.stages:
            stage.train(mode)


@dataclass(frozen=True)
class _StageCut:
    """Every stage of the model, and for a traced model its trace (``Pipe``) and the
    eval-mode trace validation runs (none where FSDP shards the stages)."""

    stages: list[nn.Module]
    pipe: Pipe | None = None
    eval_pipe: Pipe | None = None


def _cut(
    model: nn.Module, split_points: Sequence[str], *, sample: torch.Tensor | None, sharded: bool
) -> _StageCut:
    """``model`` cut into its stages at ``split_points`` (traced on ``sample`` where it is
    traced)."""
    if not is_traced(model):
        return _StageCut(cut_into_stages(model, split_points))
    if checkpointed_modules(model):
        raise ValueError(TRACED_AND_CHECKPOINTED.format(model=type(model).__name__))
    if sample is None:
        raise ValueError(f"pipeline: {type(model).__name__} is traced, which needs a sample")
    # Every rank traces the whole model the same way and keeps its own stages.
    pipe = trace_stages(model, sample, split_points)
    stages = [pipe.get_stage_module(index) for index in range(pipe.num_stages)]
    eval_pipe = None if sharded else trace_eval_stages(model, sample, split_points)
    return _StageCut(stages, pipe, eval_pipe)


def apply_pipeline(
    model: nn.Module,
    *,
    placement: RankPlacement,
    settings: StagingSettings,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> Pipeline:
    """Keep this rank's stages of ``model`` and build the schedule that runs them.

    The default process group must be initialized with ``placement.layout.world_size`` ranks,
    which form the layout's ``(pp, dp, tp)`` mesh. ``settings.pipeline.split_points`` must be
    resolved. One micro-batch is plain model parallelism. A model that is traced
    (``stage_cuts.is_traced``) is traced on ``placement.sample``, one micro-batch of inputs on
    the CPU, once as it trains and, unless FSDP shards its stages, once in eval mode for
    validation. ``settings.tp_plan`` (the model's, ``model.tp_plan``) splits each stage's
    layers where ``layout.tp > 1``.
    """
    layout, device, config = placement.layout, placement.device, settings.pipeline
    split_points = _checked_split_points(layout, config)
    pp, dp, tp, n_stages = layout.pp, layout.dp, layout.tp, layout.n_stages
    # The replicas' dimensions: FSDP2's shards, DDP's copies, or HSDP's copies of shards; a
    # pipeline of one copy keeps dp_shard, of size 1, to index.
    replicas = _replica_dimensions(layout)
    mesh = build_device_mesh(layout, device, keep=("pp", *replicas))
    plan = None
    if tp > 1:  # the whole model's plan, for each stage to split its part by
        check_tensor_parallel_stages(model)
        plan = tensor_parallel_plan(model, mesh=mesh["tp"], plan_path=settings.tp_plan)
    cut = _cut(model, split_points, sample=placement.sample, sharded=layout.dp_shard > 1)
    if len(cut.stages) != n_stages:
        raise ValueError(
            f"pipeline.split_points: {len(split_points)} points make {len(cut.stages)} "
            f"stages, but {pp} pipeline ranks x {layout.stages_per_rank} stages per rank need "
            f"{n_stages}"
        )
    replica_mesh = mesh[replicas] if len(replicas) == 1 else flatten_mesh(mesh[replicas], "dp")
    pp_rank, dp_rank = mesh.get_local_rank("pp"), replica_mesh.get_local_rank()
    tp_rank = mesh.get_local_rank("tp") if tp > 1 else 0
    assert dist.get_rank() == layout.rank(pp_rank=pp_rank, dp_rank=dp_rank, tp_rank=tp_rank)
    # Interleaved ("looped") placement: rank r holds stages r, r + pp, r + 2·pp, …
    mine = list(range(pp_rank, n_stages, pp))
    modules, pipeline_stages, eval_stages = _rank_stages(
        cut, mine, mesh=mesh, replicas=replicas, plan=plan, device=device
    )
    n_microbatches = layout.n_microbatches
    schedule_class = ScheduleGPipe if n_microbatches == 1 else SCHEDULES[config.schedule]
    return Pipeline(
        stages=modules,
        schedule=_schedule(schedule_class, pipeline_stages, n_microbatches, loss_fn=loss_fn),
        # Run forward only (schedule.eval), without a loss: the caller scores the real rows.
        eval_schedule=_schedule(schedule_class, eval_stages, n_microbatches, loss_fn=None)
        if eval_stages
        else None,
        is_first=0 in mine,
        is_last=n_stages - 1 in mine,
        pp_rank=pp_rank,
        pp_size=pp,
        dp_rank=dp_rank,
        dp_size=dp,
        tp_rank=tp_rank,
        pp_group=mesh.get_group("pp"),
        dp_group=replica_mesh.get_group() if dp > 1 else None,
        mesh=mesh,
        traced=cut.pipe is not None,
    )


def _checked_split_points(layout: Layout, config: PipelineConfig) -> tuple[str, ...]:
    """The resolved split points, once the process group is the layout's world."""
    if dist.get_world_size() != layout.world_size:
        raise ValueError(
            f"pipeline: the layout is for {layout.world_size} ranks, the process group has "
            f"{dist.get_world_size()}"
        )
    if config.split_points is None:
        raise ValueError("pipeline.split_points: resolve them on the client before the ranks")
    return config.split_points


def _rank_stages(
    cut: _StageCut,
    mine: list[int],
    *,
    mesh: DeviceMesh,
    replicas: tuple[str, ...],
    plan: dict[str, ParallelStyle] | None,
    device: torch.device,
) -> tuple[list[nn.Module], list[PipelineStage], list[PipelineStage]]:
    """This rank's stages (``mine``) on its device, split by the tensor-parallel ``plan`` if
    any and replicated over ``replicas``: the modules, the stages the schedule trains, and the
    eval-mode stages validation runs (none where the cut has no eval trace)."""
    pp_group, n_stages = mesh.get_group("pp"), len(cut.stages)
    pipe, eval_pipe = cut.pipe, cut.eval_pipe
    modules, pipeline_stages, eval_stages = [], [], []
    for index in mine:
        # A stage on the meta device stays there until sharded (workers/in_place_init.py).
        stage = cut.stages[index] if is_meta(cut.stages[index]) else cut.stages[index].to(device)
        if pipe is not None:
            # The tracer burns the trace's device into ops that make tensors (torch.zeros …);
            # Pipe.build_stage moves them the same way, but builds on the unwrapped module.
            move_traced_ops(stage, device)
        if plan is not None:
            stage = apply_plan_part(stage, mesh=mesh["tp"], plan=plan)
        module = _replicate(
            stage, mesh=mesh, replicas=replicas, device=device, traced=pipe is not None
        )
        modules.append(module)
        if pipe is None:
            pipeline_stages.append(PipelineStage(module, index, n_stages, device, group=pp_group))
        else:
            # The traced stage reads from the pipe's graph which stage sends each input, so
            # a value that skips a stage still arrives.
            pipeline_stages.append(build_stage(module, index, pipe.info(), device, pp_group))
        if eval_pipe is not None:
            evaluating = eval_pipe.get_stage_module(index)
            # Moving the stage to the device gave it new buffers: share them again.
            share_state(evaluating, stage)
            move_traced_ops(evaluating, device)
            eval_stages.append(build_stage(evaluating, index, eval_pipe.info(), device, pp_group))
    return modules, pipeline_stages, eval_stages


def _replica_dimensions(layout: Layout) -> tuple[str, ...]:
    """The mesh dimensions over which a stage's replicas run, outermost first."""
    if layout.dp_shard > 1 and layout.dp_replicate > 1:
        return ("dp_replicate", "dp_shard")  # HSDP: copies of shards
    if layout.dp_shard > 1 or layout.dp == 1:
        return ("dp_shard",)
    return ("dp_replicate",)


def _schedule(
    schedule_class: type,
    stages: list,
    n_microbatches: int,
    *,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None,
) -> object:
    if schedule_class is ScheduleInterleaved1F1B:
        return schedule_class(stages, n_microbatches=n_microbatches, loss_fn=loss_fn)
    (stage,) = stages
    return schedule_class(stage, n_microbatches=n_microbatches, loss_fn=loss_fn)


def trace_eval_stages(model: nn.Module, sample: torch.Tensor, split_points: Sequence[str]) -> Pipe:
    """:func:`trace_stages` with ``model`` in eval mode: stages whose BatchNorm normalizes by
    the running statistics and whose Dropout is off, sharing ``model``'s parameters and
    buffers. ``model`` keeps its modes."""
    modes = {module: module.training for module in model.modules()}
    model.eval()
    try:
        return trace_stages(model, sample, split_points)
    finally:
        for module, mode in modes.items():
            module.training = mode


def share_state(target: nn.Module, source: nn.Module) -> None:
    """Make ``target``'s parameters and buffers ``source``'s tensors of the same names: one
    set of numbers, whatever updates or moves them (no copies)."""
    tensors = dict(source.named_parameters(remove_duplicate=False))
    tensors |= dict(source.named_buffers(remove_duplicate=False))
    named = [
        *(name for name, _ in target.named_parameters(remove_duplicate=False)),
        *(name for name, _ in target.named_buffers(remove_duplicate=False)),
    ]
    for name in named:
        owner, _, attribute = name.rpartition(".")
        # A parameter's name takes a parameter, a buffer's a tensor: nn.Module's own rules.
        setattr(target.get_submodule(owner), attribute, tensors[name])


class _TracedStageDDP(DistributedDataParallel):
    """DDP over a traced stage. ``build_stage``'s stage reads the traced graph (its inputs and
    outputs) off the module it runs; DDP's wrapper would hide it. Running the wrapper, rather
    than the bare stage, keeps the schedule's DDP handling: no all-reduce until the last
    micro-batch's backward, which averages the gradients over the stage's replicas."""

    @property
    def graph(self) -> torch.fx.Graph:
        return self.module.graph


def _replicate(
    module: nn.Module,
    *,
    mesh: DeviceMesh,
    replicas: tuple[str, ...],
    device: torch.device,
    traced: bool = False,
) -> nn.Module:
    """Make the replicas of one stage average their gradients over the mesh's ``replicas``
    dimensions (:func:`_replica_dimensions`): DDP over ``dp_replicate`` alone, FSDP2 over
    ``dp_shard``, HSDP over both."""
    if replicas == ("dp_replicate",):
        # DDP copies rank 0's values at once: it needs storage (the values are drawn after,
        # the same on every replica).
        module = to_device(module, device)
        wrapper = _TracedStageDDP if traced else DistributedDataParallel
        # static_graph=True looks tempting for a fixed pipeline but gives silently wrong
        # parameters with torch 2.14 (measured), so the dynamic reducer stays.
        return wrapper(
            module,
            process_group=mesh.get_group("dp_replicate"),
            device_ids=[device.index] if device.type == "cuda" else None,
        )
    if mesh[replicas].size() == 1:  # one copy of each stage: nothing to average
        return module
    from torch.distributed.fsdp import fully_shard

    return fully_shard(module, mesh=mesh[replicas])


def model_pieces(pipeline: Pipeline) -> dict[str, Piece]:
    """This rank's pieces of its stages under the full model's names: the local pieces of
    sharded and split tensors where it is their first replica, and plain tensors from the
    stage's first replica (first tp rank)."""
    first = pipeline.dp_rank == 0 and pipeline.tp_rank == 0
    pieces: dict[str, Piece] = {}
    for module in pipeline.stages:
        plain = module.module if hasattr(module, "module") else module
        pieces |= own_pieces(plain.state_dict(), sends_plain=first)
    return pieces


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
    def lays_out_meta(cls, model: nn.Module) -> bool:
        return not is_traced(model)  # a traced cut runs the model

    @classmethod
    def prepare(cls, model: nn.Module, placement: RankPlacement) -> "PipelineStrategy":
        settings = placement.settings
        if not isinstance(settings, StagingSettings):
            raise ValueError(f"{cls.name}: needs the [pipeline] section, split points resolved")

        def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            # The trainer sets the criterion after prepare: read it when the schedule calls.
            return strategy.criterion(output, target)

        pipe = apply_pipeline(model, placement=placement, settings=settings, loss_fn=loss)
        strategy = cls(pipe, layout=placement.layout, device=placement.device)
        return strategy

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
        if pipe.tp_rank == 0:
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
        if pipe.dp_group is not None:
            # Replicas' running statistics drift apart: each sees its own micro-batches, and
            # the schedule runs DDP's forward under no_sync, where DDP broadcasts no buffers.
            # Validate with the first replica's, which the run hands back.
            first = dist.get_global_rank(pipe.dp_group, 0)
            for buffer in (b for stage in pipe.stages for b in stage.buffers()):
                dist.broadcast(buffer, src=first, group=pipe.dp_group)
        schedule = pipe.schedule if pipe.eval_schedule is None else pipe.eval_schedule
        # Traced stages without eval-mode twins (FSDP-sharded) normalize validation
        # micro-batches in training mode, which would move BatchNorm's running statistics:
        # evaluating must leave the model as it was.
        restore = pipe.traced and pipe.eval_schedule is None
        buffers = [b for stage in pipe.stages for b in stage.buffers()] if restore else []
        kept = [b.clone() for b in buffers]
        sums = EpochSums(device=device, criterion=self.criterion)
        for x, y, real in fixed_shape_eval_batches(
            split, rank=pipe.dp_rank, world_size=pipe.dp_size, batch_size=batch_size
        ):
            with precision.autocast():
                # Forward only: no activations are kept for a backward that never comes.
                # The schedule computes its loss_fn on the last stage too; padded rows make that
                # loss wrong, so the sums below come from the real rows of the logits instead.
                logits = schedule.eval(
                    *([x.to(device)] if pipe.is_first else []),
                    # The eval-mode stages' schedule computes no loss, so it takes no target.
                    target=y.to(device) if pipe.is_last and pipe.eval_schedule is None else None,
                )
            if pipe.is_last and real and pipe.tp_rank == 0:
                # Scored as the whole-model strategies score (Strategy.criterion, EpochSums).
                logits, y = logits[:real].float(), y[:real].to(device)
                sums.add(self.criterion(logits, y), logits, y)
        for buffer, value in zip(buffers, kept, strict=True):
            buffer.copy_(value)
        # The other ranks add zeros: every rank gets the last stages' figures.
        return self.criterion.metrics(sums.all_reduced())

    def model_pieces(self) -> dict[str, Piece]:
        return model_pieces(self.pipe)


@register
class ModelParallel(PipelineStrategy):
    """The seed article's ModelPart1 -> ModelPart2: the degenerate pipeline, whose layout has
    one micro-batch, so only one stage works at a time and the schedule is plain GPipe."""

    name = "model_parallel"
