"""Stage planning: where to cut a model so that no pipeline stage waits on a slower one.

The profile (``workers.profiling``) is measured on a rank worker; this module only does
arithmetic on it: the contiguous partition that minimizes the slowest stage under the
device's memory, the predicted pipeline bubble, and which strategy fits the model, batch and
cluster.
"""

import itertools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import dask.config
import torch
from distributed import Client
from torch import nn

from workers.data import zero_samples
from workers.profiling import DeviceProfile, LayerProfile, MicroBatch, profile_model
from workers.spec.errors import ConfigError
from workers.spec.layout import Layout
from workers.spec.names import MODEL_LAYERS
from workers.spec.plans import get_plan
from workers.spec.plans.pipeline import PipelinePlan
from workers.spec.run import RunConfig
from workers.spec.sections import TrainingConfig
from workers.stage_cuts import (
    check_cut,
    check_tensor_parallel_stages,
    cut_points,
    even_split,
)
from workflows.cluster.training_cluster import WorkersGone, live_workers, wait_on_workers
from workflows.jobs.launcher import select_workers
from workflows.runs.resolved_run import ResolvedRun

logger = logging.getLogger(__name__)

# Per parameter byte a stage also holds its gradient and SGD's momentum buffer.
_PARAM_COPIES = 3
# A bound on one profile (a few forward and backward passes per layer); a model that takes
# longer is better cut by hand (pipeline.split_points) or by layers (pipeline.balance).
PROFILE_TIMEOUT_S = 300


class ProfileFailed(RuntimeError):
    """The model could not be profiled: its worker left, or it took longer than the bound."""


class MemoryLimitExceeded(ConfigError):
    """A rank of the run needs more memory than a worker's nanny lets its process use."""


@dataclass(frozen=True)
class StagePlan:
    layers: tuple[str, ...]
    seconds: float  # forward + backward of one micro-batch
    memory_bytes: int


@dataclass(frozen=True)
class PipelineCut:
    """The pipeline a plan weighs: where it cuts the model, the stages that makes, and the
    micro-batches and data-parallel replicas it runs them with."""

    points: tuple[str, ...]
    stages: tuple[StagePlan, ...]
    n_microbatches: int
    dp: int


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one rank holds while training, by what holds them."""

    parameters: int
    gradients: int  # DDP's: the gradients and its all-reduce buckets, a copy each
    optimizer: int  # the optimizer's state: training.optimizer's buffers per parameter
    activations: int  # saved for backward, for the rank's rows of one step
    # checkpoint.async_save's copies of the rank's part of the state (parameters and optimizer
    # state): the staged one, kept for the run, and its serialized files while they are written
    checkpoint: int = 0

    @property
    def total(self) -> int:
        return (
            self.parameters + self.gradients + self.optimizer + self.activations + self.checkpoint
        )


# Buffers the size of the parameters that each torch.optim class keeps (its state per parameter,
# as torch 2.14's step() makes it); a class not here, or one by import path, is counted as
# Adam's 2.
_OPTIMIZER_BUFFERS = {
    "Adam": 2, "AdamW": 2, "Adamax": 2, "NAdam": 2, "RAdam": 2, "SparseAdam": 2, "Adadelta": 2,
    "Rprop": 2, "Adagrad": 1, "ASGD": 1, "Muon": 1, "Adafactor": 0,
}  # fmt: skip


def optimizer_buffers(training: TrainingConfig) -> int:
    """How many copies of the parameters ``training.optimizer`` keeps as its state: SGD its
    momentum (none without), AdamW its two moments (three with ``amsgrad``), RMSprop its
    square average plus a momentum and a mean where those are on."""
    name, kwargs = training.optimizer_class, training.optimizer_kwargs
    if name == "SGD":
        return 1 if training.momentum > 0 else 0
    if name == "RMSprop":
        return 1 + (kwargs.get("momentum", 0) > 0) + bool(kwargs.get("centered", False))
    return _OPTIMIZER_BUFFERS.get(name, 2) + bool(kwargs.get("amsgrad", False))


def estimate_memory(
    profile: DeviceProfile,
    *,
    rows: int,
    optimizer_buffers: int,
    shard: int = 1,
    checkpoint_copies: int = 0,
) -> MemoryEstimate:
    """A rank's memory for ``rows`` rows a step of the profiled model: a DDP replica when
    ``shard`` is 1; under FSDP2 over ``shard`` ranks, its shards plus two units gathered whole
    (the largest unit's parameters as it runs and the next one's, prefetched) and two more of
    gradients (the unit's whole gradient and the copy FSDP2 reduce-scatters from). A unit is
    the profile's ``largest_unit_bytes`` (0: the largest layer's). Asynchronous checkpoints hold
    ``checkpoint_copies`` of the rank's own parameters and optimizer state (`checkpoint_copies`).

    Measured against it (``make bench-fsdp``, which prints both): within 15% on the linear
    stack, the GPT and vit_b_16, under DDP and FSDP, at 2 and 4 ranks on the CPU."""
    layers = profile.layers
    params = sum(layer.param_bytes for layer in layers)
    activations = (
        sum(layer.activation_bytes for layer in layers) * rows // max(profile.micro_batch, 1)
    )
    own = params if shard == 1 else -(-params // shard)
    checkpoint = checkpoint_copies * (1 + optimizer_buffers) * own
    if shard == 1:
        return MemoryEstimate(
            params, 2 * params, optimizer_buffers * params, activations, checkpoint
        )
    unit = profile.largest_unit_bytes or max(layer.param_bytes for layer in layers)
    return MemoryEstimate(
        own + 2 * unit, own + 2 * unit, optimizer_buffers * own, activations, checkpoint
    )


def checkpoint_copies(config: RunConfig, *, checkpointed: bool | None = None) -> int:
    """How many copies of a rank's part of the state its checkpoints hold at their peak:
    with ``checkpoint.async_save`` (the default) two, the CPU copy the rank keeps for the whole
    run (``workers.checkpoint.AsyncCheckpoints``) and its serialized files while they are
    written (measured: ``make bench-fsdp`` with ``--checkpoints``); none for a synchronous save
    or a run without checkpoints (``checkpointed``; None: whether ``checkpoint.directory`` is
    set)."""
    if checkpointed is None:
        checkpointed = config.checkpoint.directory is not None
    return 2 if checkpointed and config.checkpoint.async_save else 0


def suggested_shard(estimates: dict[int, MemoryEstimate], memory_bytes: int) -> int | None:
    """The fewest ranks to shard over (``parallel.dp_shard``) that fit a rank in
    ``memory_bytes``: 1 when a replica fits; None when even the most sharding does not."""
    fitting = [
        shard for shard, estimate in sorted(estimates.items()) if estimate.total <= memory_bytes
    ]
    return fitting[0] if fitting else None


@dataclass(frozen=True)
class Plan:
    strategy: str
    schedule: str
    n_stages: int
    n_microbatches: int
    dp: int
    split_points: tuple[str, ...]
    stages: tuple[StagePlan, ...]
    profile: DeviceProfile
    predicted_step_s: dict[str, float]  # strategy -> seconds per optimizer step
    fits_one_device: bool
    recommendation: str
    world_size: int
    # Per rank at world_size ranks: a DDP replica under 1, sharded over dp_shard ranks under
    # each divisor of the world size.
    memory: dict[int, MemoryEstimate]

    @property
    def bubble(self) -> float:
        """Share of a pipelined step each stage idles: (p - 1) / (m + p - 1)."""
        p, m = self.n_stages, self.n_microbatches
        return (p - 1) / (m + p - 1)

    def render(self) -> str:
        mib = 2**20
        lines = [
            f"Per-layer profile on {self.profile.device}, micro-batch of "
            f"{self.profile.micro_batch} (forward + backward):",
            f"  {'layer':<12}{'ms':>9}{'params MiB':>12}{'activations MiB':>17}",
        ]
        for layer in self.profile.layers:
            lines.append(
                f"  {layer.name:<12}{layer.seconds * 1e3:>9.3f}{layer.param_bytes / mib:>12.3f}"
                f"{layer.activation_bytes / mib:>17.3f}"
            )
        lines.append(
            f"Split into {self.n_stages} stages at {list(self.split_points)} "
            f"(device memory {self.profile.memory_bytes / mib:,.0f} MiB per stage):"
        )
        for index, stage in enumerate(self.stages):
            lines.append(
                f"  stage {index}: {', '.join(stage.layers)}: {stage.seconds * 1e3:.3f} ms, "
                f"{stage.memory_bytes / mib:.1f} MiB"
            )
        lines.append(
            f"Predicted bubble with {self.schedule}, m={self.n_microbatches}: "
            f"(p-1)/(m+p-1) = {self.bubble:.1%}"
        )
        lines.append("Predicted seconds per optimizer step:")
        for strategy, seconds in self.predicted_step_s.items():
            lines.append(f"  {strategy:<15}{seconds * 1e3:>10.2f} ms")
        lines.append(
            f"Memory per rank at {self.world_size} ranks (parameters + gradients + optimizer "
            f"state + activations + asynchronous checkpoints' copies; device "
            f"{self.profile.memory_bytes / mib:,.0f} MiB):"
        )
        for shard, estimate in self.memory.items():
            label = "ddp" if shard == 1 else f"fsdp, dp_shard={shard}"
            parts = (
                estimate.parameters,
                estimate.gradients,
                estimate.optimizer,
                estimate.activations,
                estimate.checkpoint,
            )
            lines.append(
                f"  {label:<20}{estimate.total / mib:>10,.1f} MiB  ("
                + " + ".join(f"{part / mib:,.1f}" for part in parts)
                + ")"
            )
        lines.append(f"Recommendation: {self.recommendation}")
        return "\n".join(lines)


def stage_memory(layers: Sequence[LayerProfile], in_flight: int) -> int:
    """Bytes a stage of ``layers`` needs with ``in_flight`` micro-batches' activations held."""
    params = sum(layer.param_bytes for layer in layers) * _PARAM_COPIES
    return params + sum(layer.activation_bytes for layer in layers) * in_flight


def balanced_split(
    layers: Sequence[LayerProfile], n_stages: int, *, memory_bytes: int, in_flight: int
) -> list[str]:
    """Split points of the contiguous partition whose slowest stage is fastest and fits memory.

    Dynamic programming over (stages used, layers covered): O(stages · layers²).
    """
    n = len(layers)
    if n_stages > n:
        raise ValueError(f"pipeline: {n_stages} stages need at least {n_stages} layers, have {n}")
    prefix = [0.0]
    for layer in layers:
        prefix.append(prefix[-1] + layer.seconds)
    infinity = float("inf")
    # best[k][j]: the slowest stage when the first j layers form k stages; cut[k][j]: where
    # the k-th stage starts in that partition.
    best = [[infinity] * (n + 1) for _ in range(n_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, n_stages + 1):
        for j in range(k, n + 1):
            for i in range(k - 1, j):
                if best[k - 1][i] == infinity:
                    continue
                if stage_memory(layers[i:j], in_flight) > memory_bytes:
                    continue
                slowest = max(best[k - 1][i], prefix[j] - prefix[i])
                if slowest < best[k][j]:
                    best[k][j], cut[k][j] = slowest, i
    if best[n_stages][n] == infinity:
        raise ValueError(
            f"pipeline: the model does not fit in {n_stages} stages of "
            f"{memory_bytes / 2**20:,.0f} MiB; use more workers or fewer micro-batches in flight"
        )
    starts, j = [], n
    for k in range(n_stages, 0, -1):
        j = cut[k][j]
        starts.append(j)
    return [layers[i].name for i in sorted(starts)[1:]]


def plan(
    client: Client,
    run: ResolvedRun,
    *,
    num_classes: int,
    build: Callable[[], nn.Module] | None = None,
    checkpointed: bool | None = None,
) -> Plan:
    """Profile the model on the first worker and plan its stages for the run's ranks.

    ``build`` (run on the worker) gives the model instead of ``config.model``. The layers of a
    model that is not an ``nn.Sequential`` are the pieces between its cut points, traced.
    ``checkpointed``: whether the run writes checkpoints (``dask-train run`` always does, into
    its run directory); None: whether ``checkpoint.directory`` is set.
    """
    config, world_size = run.config, run.layout.world_size
    p = config.pipeline
    layout = planned_layout(run)
    n_stages, m = layout.n_stages, layout.n_microbatches
    # What the schedule keeps alive per stage: GPipe every micro-batch, 1F1B at most p.
    in_flight = m if p.schedule == "gpipe" else min(m, n_stages)
    worker = min(live_workers(client))
    model = ProfiledModel(config, num_classes, build)
    profile = _profile_on(client, worker, model, micro_batch=layout.micro_batch)
    names = [layer.name for layer in profile.layers]
    if p.split_points is not None:
        points = list(p.split_points)
    elif p.balance == "layers":
        points = even_split(names, n_stages)
    else:
        points = balanced_split(
            profile.layers, n_stages, memory_bytes=profile.memory_bytes, in_flight=in_flight
        )
    bounds = [0, *(names.index(point) for point in points), len(names)]
    stages = tuple(
        StagePlan(
            layers=tuple(names[a:b]),
            seconds=sum(layer.seconds for layer in profile.layers[a:b]),
            memory_bytes=stage_memory(profile.layers[a:b], in_flight),
        )
        for a, b in itertools.pairwise(bounds)
    )
    return _recommend(
        config,
        profile,
        PipelineCut(tuple(points), stages, n_microbatches=m, dp=layout.dp),
        world_size=world_size,
        checkpoint_copies=checkpoint_copies(config, checkpointed=checkpointed),
    )


@dataclass(frozen=True)
class ProfiledModel:
    """The model a profile builds: ``config``'s ``[model]`` for ``num_classes`` classes, or the
    one ``build`` returns (run on the worker)."""

    config: RunConfig
    num_classes: int
    build: Callable[[], nn.Module] | None = None


def _profile_on(
    client: Client, worker: str, model: ProfiledModel, *, micro_batch: int, repeats: int = 7
) -> DeviceProfile:
    """The model's profile, measured on ``worker`` (one worker, so that every layer is timed on
    the same device). Dask would hold a task bound to a worker that left for good, so this
    watches the worker: one killed while profiling (out of memory, most often) is a
    ProfileFailed naming it within a second or two, not a silent wait."""
    config = model.config
    future = client.submit(
        profile_model,
        config.model,
        MicroBatch(micro_batch, config.data.sample_shape, tokens=config.data.tokens),
        num_classes=model.num_classes,
        build=model.build,
        repeats=repeats,
        key=f"profile-{config.model.name}",
        workers=[worker],
        pure=False,
    )
    try:
        wait_on_workers(client, [future], [worker], timeout_s=PROFILE_TIMEOUT_S)
        return future.result()
    except WorkersGone:
        c = config.cluster
        limit = (
            "its own memory limit"
            if c.scheduler or c.scheduler_file
            else f"cluster.memory_limit = {c.memory_limit!r}"
        )
        raise ProfileFailed(
            f"the worker profiling {config.model.name} ({worker}) left the cluster: "
            f"killed, most likely for memory ({limit}); give it more, or cut "
            "without a profile: pipeline.split_points, or pipeline.balance = 'layers'"
        ) from None
    except TimeoutError:
        raise ProfileFailed(
            f"profiling {config.model.name} on {worker} took over {PROFILE_TIMEOUT_S} s; "
            "cut without a profile: pipeline.split_points, or pipeline.balance = 'layers'"
        ) from None
    finally:
        future.cancel()


_MIB = 2**20


def check_worker_memory(
    client: Client,
    run: ResolvedRun,
    *,
    num_classes: int,
    build: Callable[[], nn.Module] | None = None,
) -> None:
    """Refuse, before any rank starts, a run whose rank needs more memory than a worker of its
    cluster may use: a :class:`MemoryLimitExceeded` naming the figures and the fields that
    lower them. The need is ``dask-train plan``'s estimate (`estimate_memory`) for the run's
    own layout (every world of an elastic range) from the model's sizes on the meta device:
    its parameters, their gradients, the optimizer's state and the asynchronous checkpoints'
    CPU copies; ``build`` gives the model instead of ``config.model``.

    The activations are not counted: measuring them runs the model whole on a worker, which
    costs seconds a run (8.6 s for resnet18 at first) and leaves that worker's heap grown for
    the job after it (measured: an FSDP rank's peak 114 MiB where 85 MiB without). So a run
    refused needs at least what the error says; `dask-train plan` measures the rest. Staged
    and tensor-parallel runs are left alone: the planner cuts stages to fit the workers'
    memory, and the estimate does not model split layers."""
    config = run.config
    layouts = list((run.layouts or {run.layout.world_size: run.layout}).values())
    split = any(layout.pp > 1 or layout.tp > 1 for layout in layouts)
    if get_plan(config.training.strategy).staged or split:
        return
    bound = _smallest_worker(client, run)
    if bound is None:
        return
    whole = _on_meta(ProfiledModel(config, num_classes, build))
    if whole is None:
        return  # a model that computes with its tensors as it is built: its sizes are unknown
    from workers.models import largest_unit_bytes

    parameters = sum(p.numel() * p.element_size() for p in whole.parameters())
    unmeasured = LayerProfile("model", 0.0, parameters, activation_bytes=0, output_bytes=0)
    sizes = DeviceProfile("meta", 0, 1, (unmeasured,), largest_unit_bytes(whole))
    estimate = _RankNeed(config, tuple(layouts), on_gpu=bound.on_gpu).largest(sizes)
    if _RankNeed.host_bytes(estimate, on_gpu=bound.on_gpu) > bound.allowed:
        raise MemoryLimitExceeded(_too_large(config, estimate, bound))


@dataclass(frozen=True)
class WorkerBound:
    """The worker with the smallest memory limit among those a run may take, and the fraction
    of it where its nanny restarts it."""

    address: str
    limit: int  # bytes
    terminate: float  # distributed.worker.memory.terminate
    on_gpu: bool  # whether its ranks' tensors are in a GPU's memory

    @property
    def allowed(self) -> int:
        return int(self.terminate * self.limit)


def _smallest_worker(client: Client, run: ResolvedRun) -> WorkerBound | None:
    """The run's most limited worker; None where no worker has a limit or a nanny that
    enforces it."""
    workers = live_workers(client)
    limits = {
        a: workers[a].get("memory_limit") or 0 for a in select_workers(workers, run.launch.workers)
    }
    limited = {address: limit for address, limit in limits.items() if limit}
    if not limited:  # 0 or None: no limit
        return None
    worker, limit = min(limited.items(), key=lambda item: item[1])
    # The nanny restarts a worker whose process passes this fraction of its limit
    # (distributed.worker.memory.terminate; False: never), not the limit itself: a rank that
    # fits the limit but not the fraction is killed all the same. Read on the worker, whose
    # nanny's config it is (a `dask worker` elsewhere may have its own).
    key = "distributed.worker.memory.terminate"
    terminate = client.run(dask.config.get, key, workers=[worker])[worker]
    if not terminate:
        return None
    on_gpu = client.run(torch.cuda.is_available, workers=[worker])[worker]
    return WorkerBound(worker, limit, float(terminate), on_gpu)


@dataclass(frozen=True)
class _RankNeed:
    """What a rank of the run holds, over the run's layouts (an elastic range has several)."""

    config: RunConfig
    layouts: tuple[Layout, ...]
    on_gpu: bool

    def largest(self, profile: DeviceProfile) -> MemoryEstimate:
        """The largest estimate over the run's layouts, of what the worker's process holds."""
        estimates = [
            estimate_memory(
                profile,
                rows=layout.micro_batch,
                optimizer_buffers=optimizer_buffers(self.config.training),
                shard=layout.dp_shard,
                checkpoint_copies=checkpoint_copies(self.config),
            )
            for layout in self.layouts
        ]
        return max(estimates, key=lambda e: self.host_bytes(e, on_gpu=self.on_gpu))

    @staticmethod
    def host_bytes(estimate: MemoryEstimate, *, on_gpu: bool) -> int:
        """What a rank's estimate puts in its worker's process: all of it on a CPU, the
        checkpoints' CPU copy on a GPU (the rank's tensors are in device memory)."""
        return estimate.checkpoint if on_gpu else estimate.total


def _on_meta(model: ProfiledModel) -> nn.Module | None:
    """The model built on the meta device (its sizes, no memory); None for one that computes
    with its tensors as it is built."""
    from workers.losses import Criterion
    from workers.models import build_model

    config = model.config
    try:
        with torch.device("meta"):
            if model.build is not None:
                return model.build()
            return build_model(
                config.model,
                num_classes=Criterion.of(config.training).outputs(model.num_classes),
                seed=0,
                input_shape=config.data.sample_shape,
            )
    except (NotImplementedError, RuntimeError):
        return None


def _too_large(config: RunConfig, estimate: MemoryEstimate, bound: WorkerBound) -> str:
    """What a run refused for memory is told: the figures, and the fields that change them."""
    on_gpu, limit, terminate = bound.on_gpu, bound.limit, bound.terminate
    needed = estimate.checkpoint if on_gpu else estimate.total
    what = (
        "its checkpoints' CPU copy"
        if on_gpu
        else (
            f"parameters {estimate.parameters / _MIB:,.0f} + gradients "
            f"{estimate.gradients / _MIB:,.0f} + optimizer state {estimate.optimizer / _MIB:,.0f}"
            + f" + checkpoint copies {estimate.checkpoint / _MIB:,.0f}; activations not counted"
        )
    )
    # The activations are not counted (check_worker_memory says why): a CPU rank needs more.
    at_least = "" if on_gpu else "at least "
    changes = [
        "give the workers more memory (cluster.memory_limit, or --memory-limit of your "
        "`dask worker`s)"
    ]
    if estimate.checkpoint:
        changes.append(
            f"keep no CPU copy of the state (checkpoint.async_save = false: "
            f"-{estimate.checkpoint / _MIB:,.0f} MiB)"
        )
    if not on_gpu:
        if not get_plan(config.training.strategy).splits_layers:
            changes.append("shard the model over the ranks (training.strategy = 'fsdp')")
        else:
            changes.append(
                "shard it over more ranks (launch.world_size; parallel.dp_shard for hsdp)"
            )
    return (
        f"cluster.memory_limit: a rank of this run needs {at_least}{needed / _MIB:,.0f} MiB "
        f"({what}; `dask-train plan` shows the estimate), more than worker {bound.address} may "
        f"use: {terminate:.0%} of its {limit / _MIB:,.0f} MiB limit, "
        f"{terminate * limit / _MIB:,.0f} MiB, where its nanny restarts it "
        "(distributed.worker.memory.terminate). " + _sentence("; or ".join(changes))
    )


def _sentence(text: str) -> str:
    return text[:1].upper() + text[1:] + "."


def planned_layout(run: ResolvedRun) -> Layout:
    """The layout a plan is for: the run's own for a staged strategy. Any other run is
    planned as the pipeline its [pipeline] section describes, on at least 2 stages, to compare.
    """
    config = run.config
    if get_plan(config.training.strategy).staged:
        return run.layout
    dp = config.pipeline.dp
    world_size = dp * max(2, run.layout.world_size // dp)
    return _staged_plan(config).degrees(config.training, config.pipeline, world_size=world_size)


def _staged_plan(config: RunConfig) -> PipelinePlan:
    """The staged strategy a cut is planned for: the run's own, else the pipeline its
    [pipeline] section describes."""
    plan = get_plan(config.training.strategy)
    return plan if isinstance(plan, PipelinePlan) else get_plan("pipeline")


def _recommend(
    config: RunConfig,
    profile: DeviceProfile,
    cut: PipelineCut,
    *,
    world_size: int,
    checkpoint_copies: int = 0,
) -> Plan:
    memory = _memory_per_rank(
        config, profile, world_size=world_size, checkpoint_copies=checkpoint_copies
    )
    predicted = _predicted_step_s(config, profile, cut, world_size=world_size)
    shard = suggested_shard(memory, profile.memory_bytes)
    return Plan(
        strategy=config.training.strategy,
        schedule=_staged_plan(config).schedule(config.pipeline),
        n_stages=len(cut.stages),
        n_microbatches=cut.n_microbatches,
        dp=cut.dp,
        split_points=cut.points,
        stages=cut.stages,
        profile=profile,
        predicted_step_s=predicted,
        fits_one_device=shard == 1,
        recommendation=_recommendation(
            profile,
            memory,
            predicted,
            shard=shard,
            n_microbatches=cut.n_microbatches,
            world_size=world_size,
        ),
        world_size=world_size,
        memory=memory,
    )


def _memory_per_rank(
    config: RunConfig, profile: DeviceProfile, *, world_size: int, checkpoint_copies: int
) -> dict[int, MemoryEstimate]:
    """A rank's memory at ``world_size`` ranks: a DDP replica under 1, sharded over
    ``dp_shard`` ranks under each divisor of the world size."""
    return {
        shard: estimate_memory(
            profile,
            rows=config.training.batch_size // world_size,
            optimizer_buffers=optimizer_buffers(config.training),
            shard=shard,
            checkpoint_copies=checkpoint_copies,
        )
        for shard in range(1, world_size + 1)
        if world_size % shard == 0
    }


def _predicted_step_s(
    config: RunConfig, profile: DeviceProfile, cut: PipelineCut, *, world_size: int
) -> dict[str, float]:
    """Seconds per optimizer step by strategy. Compute scales with rows: a step of B rows
    costs B / micro_batch micro-batch units."""
    unit = sum(layer.seconds for layer in profile.layers)
    rows = config.training.batch_size
    per_row = unit / profile.micro_batch
    p, m = len(cut.stages), cut.n_microbatches
    slowest_per_row = max(stage.seconds for stage in cut.stages) / profile.micro_batch
    return {
        # DDP: every rank runs the whole model on its share of the batch (all-reduce ignored).
        "ddp": per_row * rows / world_size,
        # Model parallel: one batch walks the stages one after another.
        "model_parallel": per_row * rows,
        # Pipeline: m + p - 1 slots, each as long as the slowest stage on a micro-batch.
        "pipeline": slowest_per_row * (rows / (cut.dp * m)) * (m + p - 1),
    }


def _recommendation(
    profile: DeviceProfile,
    memory: dict[int, MemoryEstimate],
    predicted: dict[str, float],
    *,
    shard: int | None,
    n_microbatches: int,
    world_size: int,
) -> str:
    """Which strategy to run and why: DDP where a replica fits, else the least sharding that
    fits, else a pipeline where micro-batches overlap, else plain model parallelism."""
    whole, m = memory[1].total, n_microbatches
    if shard == 1:
        choice = "ddp"
        why = (
            f"the whole model needs {whole / 2**20:.1f} MiB and fits one device, so DDP keeps "
            f"every worker busy without a pipeline bubble ({predicted['ddp'] * 1e3:.2f} ms per "
            f"step vs {predicted['pipeline'] * 1e3:.2f} ms pipelined)"
        )
    elif shard is not None:
        # Sharded over all ranks is FSDP; over fewer, HSDP replicates across the groups.
        choice = f"{'fsdp' if shard == world_size else 'hsdp'} with parallel.dp_shard = {shard}"
        why = (
            f"a DDP replica needs {whole / 2**20:,.1f} MiB per rank, more than the device's "
            f"{profile.memory_bytes / 2**20:,.0f} MiB; sharding parameters, gradients and "
            f"optimizer state over {shard} ranks needs {memory[shard].total / 2**20:,.1f} MiB"
        )
    elif m > 1 and predicted["pipeline"] < predicted["model_parallel"]:
        choice = "pipeline"
        why = (
            f"the model ({whole / 2**20:.1f} MiB) does not fit one device; pipelining "
            f"{m} micro-batches overlaps the stages ({predicted['pipeline'] * 1e3:.2f} ms per "
            f"step vs {predicted['model_parallel'] * 1e3:.2f} ms model parallel)"
        )
    else:
        choice = "model_parallel"
        why = (
            f"the model ({whole / 2**20:.1f} MiB) does not fit one device; with one "
            "micro-batch nothing overlaps, so plain model parallelism is as fast as a pipeline"
        )
    return f"{choice}: {why}"


def resolve_split_points(
    client: Client,
    run: ResolvedRun,
    *,
    num_classes: int,
    build: Callable[[], nn.Module] | None = None,
) -> tuple[str, ...]:
    """The cut every rank of a staged run will use: the configured one, an even one, or a
    planned one. ``build`` gives the model instead of ``config.model``; it is checked here
    first, traced as the ranks will trace it: a :class:`ConfigError` naming the field where it
    fails."""
    config, layout = run.config, run.layout
    p = config.pipeline
    if build is not None:
        # The config checked the cut of model.name's model when it loaded, not this one's.
        try:
            model = build()
            if layout.tp > 1:
                check_tensor_parallel_stages(model)
            check_cut(model, _sample(config, layout.micro_batch), p.split_points)
        except ValueError as error:
            raise ConfigError(str(error)) from None
    if p.split_points is not None:
        return p.split_points
    # A model with fewer layers than the stages a world known only now makes is the config's
    # error (exit 2 on the CLI), as it is where the config gives the world size.
    try:
        if p.balance == "layers":
            if build is None and config.model.name in MODEL_LAYERS:
                names = list(MODEL_LAYERS[config.model.name])
            else:
                names = _cut_points(config, layout=layout, num_classes=num_classes, build=build)
            return tuple(even_split(names, layout.n_stages))
        return plan(client, run, num_classes=num_classes, build=build).split_points
    except ConfigError:
        raise
    except ValueError as error:
        raise ConfigError(str(error)) from None


def _cut_points(
    config: RunConfig,
    *,
    layout: Layout,
    num_classes: int,
    build: Callable[[], nn.Module] | None,
) -> list[str]:
    """A model's cut points, found on the client (one forward of a micro-batch)."""
    from workers.models import build_model

    if build is None:
        model = build_model(
            config.model,
            num_classes=num_classes,
            seed=config.training.seed,
            input_shape=config.data.sample_shape,
        )
    else:
        model = build()
    return cut_points(model, _sample(config, layout.micro_batch))


def _sample(config: RunConfig, rows: int) -> torch.Tensor:
    """``rows`` samples shaped and typed as the store gives them: zeros (token 0 or 0.0)."""
    return zero_samples(rows, config.data.sample_shape, tokens=config.data.tokens)


__all__ = [
    "MemoryEstimate",
    "MemoryLimitExceeded",
    "Plan",
    "balanced_split",
    "check_worker_memory",
    "checkpoint_copies",
    "estimate_memory",
    "optimizer_buffers",
    "plan",
    "planned_layout",
    "resolve_split_points",
    "stage_memory",
    "suggested_shard",
]
