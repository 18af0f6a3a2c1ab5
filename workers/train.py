"""The per-rank training loop: build, then step by step and epoch by epoch, then close.

``train`` reads top to bottom: :func:`build` a :class:`Trainer`, :func:`run_epoch` until done
(each a series of :func:`train_step` and one :func:`evaluate`), :func:`close` into a
:class:`RankResult`. It needs only an initialized process group, so the torchrun benchmark runs
the very same code. What parallelism does to the model and to a step is the
:class:`~workers.strategies.base.Strategy`'s; the loop reaches the world outside the rank only
through :class:`Hooks` (metrics records, liveness, checkpoints), which ``run_rank``, the Dask
task, fills from Dask.
"""

import contextlib
import functools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from distributed import get_worker
from pydantic import BaseModel
from torch import nn

from workers import live_recovery, model_pieces
from workers.activation_checkpointing import apply_activation_checkpointing
from workers.checkpoint import (
    STOP_WAIT_SHARE,
    AsyncCheckpoints,
    CheckpointConfig,
    CheckpointDestination,
    CheckpointState,
    Progress,
    load_checkpoint,
    save_checkpoint,
)
from workers.collection_shard import (
    CollectionPlan,
    RankShard,
    collections_model_inputs,
    trainer_splits,
)
from workers.compilation import apply_compile
from workers.data import (
    BatchShare,
    DataConfig,
    OpenedStore,
    RankBatches,
    StoreSplit,
    open_store,
    zero_samples,
)
from workers.elastic import ResizeBoundary
from workers.in_place_init import InPlaceInit
from workers.losses import Criterion
from workers.model_pieces import HeldPieces, Piece
from workers.model_sources import resolve
from workers.models import ModelConfig, build_model
from workers.optimizers import (
    OptimizerFactory,
    ScheduleFactory,
    build_optimizer,
    build_schedule,
)
from workers.peak_memory import PeakMemory
from workers.precision import Precision, warn_if_slow
from workers.process_group import Membership
from workers.rank_context import RankContext
from workers.records import EpochRecord, StartRecord, StepRecord
from workers.spec.layout import Layout
from workers.spec.sections import TrainingConfig
from workers.strategies import get_strategy
from workers.strategies.base import EpochSums, RankPlacement, Strategy


@dataclass(frozen=True)
class TrainJob:
    """What every rank of one job receives."""

    data: DataConfig  # resolved: absolute paths, store URL filled in
    model: ModelConfig
    training: TrainingConfig
    layout: Layout  # computed once on the client
    # The strategy's own section (RunConfig.strategy_settings); a staged strategy's with its
    # split_points resolved by the client, so every rank cuts alike.
    settings: BaseModel | None = None
    # Where checkpoints go (None: nowhere); the one to continue from comes with the attempt.
    checkpoint: CheckpointConfig | None = None
    # train(data=...): Dask collections planned by the client, in place of the store.
    collections: CollectionPlan | None = None
    # A model factory given in Python (train(config, model=...)), in place of model.name.
    factory: Callable[..., nn.Module] | None = None
    # An optimizer and a schedule given in Python (train(config, optimizer=..., lr_schedule=...)),
    # in place of training.optimizer and training.lr_schedule.
    optimizer: OptimizerFactory | None = None
    lr_schedule: ScheduleFactory | None = None
    # An elastic job's layout for each world size it may run on, computed once on the client:
    # each generation of its group takes the one of its size. None: ``layout`` alone.
    layouts: dict[int, Layout] | None = None

    def layout_of(self, world_size: int) -> Layout:
        """The layout of a generation of ``world_size`` ranks."""
        if self.layouts is None:
            return self.layout
        return self.layouts[world_size]


@dataclass
class RankResult:
    rank: int
    history: list[dict[str, float]]
    steps: int
    samples_per_s: float  # the job's (all replicas), as every rank counts it: Throughput
    steady_samples_per_s: float
    first_step_at: float
    # This rank's part of the final model (workers/model_pieces.py): the client assembles them.
    # On a Dask worker, a handle to them: they wait there for the client to take them.
    model_pieces: dict[str, Piece] | HeldPieces = field(default_factory=dict, repr=False)
    peak_memory_bytes: int | None = None  # workers/peak_memory.py; None: not measurable


Save = Callable[[CheckpointState, Progress], None]
Restore = Callable[[CheckpointState], Progress]


@dataclass(frozen=True)
class Checkpoints:
    """When this rank saves a checkpoint (always at the last step), and how."""

    save: Save
    every_steps: int = 0  # also every N steps within an epoch; 0: never
    at_epoch_end: bool = True
    # Waits for an asynchronous save in flight and commits it (collective); None: saves are
    # committed as they return.
    finish: Callable[[], Any] | None = None
    # The run ends by an exception (stopped, failed) with an asynchronous save maybe in
    # flight: waits for it a bounded time, no collective (AsyncCheckpoints.interrupted).
    interrupted: Callable[[], Any] | None = None

    @classmethod
    def in_directory(
        cls,
        config: CheckpointConfig,
        *,
        run_id: str | None = None,
        report: Callable[[dict[str, Any]], None] | None = None,
        release_timeout_s: float = 15.0,
    ) -> "Checkpoints":
        """DCP checkpoints of run ``run_id`` under ``config.directory``
        (``workers.checkpoint``); ``report`` gets rank 0's record of an asynchronous save that
        failed; a stopped rank waits for its save in flight within ``release_timeout_s``
        (``launch.release_timeout_s``)."""
        directory = config.directory
        assert directory is not None
        writer = None
        if config.async_save:
            writer = AsyncCheckpoints(
                directory,
                keep=config.keep,
                signing_key_file=config.signing_key_file,
                storage_options=config.storage_options,
                on_failure=report,
                run_id=run_id,
            )

        destination = CheckpointDestination.of(config, run_id=run_id)

        def save(state: CheckpointState, progress: Progress) -> None:
            save_checkpoint(destination, state, progress=progress, writer=writer)

        return cls(
            save=save,
            every_steps=config.every_steps,
            at_epoch_end=config.at_epoch_end,
            finish=writer.finish if writer else None,
            interrupted=(
                functools.partial(writer.interrupted, STOP_WAIT_SHARE * release_timeout_s)
                if writer
                else None
            ),
        )


@dataclass(frozen=True)
class Hooks:
    """The loop's only ways out of the rank; each is optional."""

    # The job's metrics records ("start", "step", "epoch"); called on the reporting rank only.
    report: Callable[[dict[str, Any]], None] | None = None
    # Each logged step's record, on every rank that knows the loss: kept with the rank's state
    # so that a step the reporting rank finished but never sent is sent by the next attempt.
    keep_step: Callable[[dict[str, Any]], None] | None = None
    # The step reached, after every step: the launcher's proof of life. Throttle it yourself.
    heartbeat: Callable[[int], None] | None = None
    checkpoints: Checkpoints | None = None
    # Where the loop stands after every step and at each epoch's end (kept for recovery).
    step_done: Callable[["Position"], None] | None = None
    # This rank's peak memory so far (a rank context measures it from the rank's start);
    # None: train() measures from its own start.
    peak_memory: Callable[[], int | None] | None = None


@dataclass(frozen=True)
class Position:
    """Where a step left the loop; the sums stay on the device (no host sync per step)."""

    epoch: int
    batch: int  # the next batch of that epoch
    step: int
    sums: EpochSums
    history: list[dict[str, Any]]


@dataclass
class Throughput:
    """The job's samples (all replicas together) and seconds in training loops (validation
    excluded), in total and up to the warm step: the first steps pay one-off costs, so
    ``steady`` leaves them out.

    The one place the job's samples/s is computed: the epoch records (the epoch line, the
    ``dask_train_samples_per_second`` gauge, TensorBoard's ``perf/samples_per_s``) and
    ``TrainResult.samples_per_s`` / ``steady_samples_per_s`` (``summary.json``, the CLI's
    closing line) all mean the same figure. The stages of a pipeline work on the same samples,
    so only replicas add up (``job_rows`` of the batches).
    """

    warm_step: int
    steps: int = 0
    samples: int = 0
    seconds: float = 0.0
    warm_samples: int = 0
    warm_seconds: float = math.nan
    first_step_at: float = math.nan  # wall clock, for the client's restart figures

    def step_done(self, samples: int, *, epoch_started: float) -> None:
        """``samples``: what all replicas trained on in this step."""
        self.steps += 1
        self.samples += samples
        if self.steps == 1:
            self.first_step_at = time.time()
        if self.steps == self.warm_step:
            self.warm_seconds = self.seconds + time.perf_counter() - epoch_started
            self.warm_samples = self.samples

    def epoch_done(self, seconds: float, *, samples_before: int) -> float:
        """Count the epoch's training ``seconds``; the job's samples/s over the epoch (the
        samples since ``samples_before``)."""
        self.seconds += seconds
        return (self.samples - samples_before) / seconds if seconds else 0.0

    @property
    def overall(self) -> float:
        return self.samples / self.seconds if self.seconds else 0.0

    @property
    def steady(self) -> float:
        if not self.warm_step:
            return self.overall
        return (self.samples - self.warm_samples) / (self.seconds - self.warm_seconds)


@dataclass
class Trainer:
    """One rank's training, made by :func:`build`: what it trains with and where it stands."""

    config: TrainingConfig
    layout: Layout
    rank: int
    device: torch.device
    strategy: Strategy
    precision: Precision
    batches: RankBatches | RankShard
    val: StoreSplit
    optimizer: torch.optim.Optimizer
    schedule: torch.optim.lr_scheduler.LRScheduler
    total_steps: int
    start: Progress  # where this run began: a checkpoint's progress, or the very beginning
    step: int
    history: list[dict[str, float]]
    throughput: Throughput

    @property
    def criterion(self) -> Criterion:
        return self.strategy.criterion

    @property
    def checkpoint_state(self) -> CheckpointState:
        return CheckpointState(self.strategy.modules, self.optimizer, self.precision.scaler)


def run_rank(ctx: RankContext, job: TrainJob) -> RankResult:
    """The built-in trainer as a rank function of :func:`workflows.launch`: its records and
    heartbeats go out through the context, it continues from a surviving replica's state or
    the attempt's checkpoint, and keeps its state for the next attempt."""
    last_step: list[int | None] = [None]
    layout = job.layout_of(ctx.world_size)

    def heartbeat(step: int) -> None:
        # The first call comes before any step: the context already announced the start.
        if last_step[0] is not None:
            ctx.heartbeat(samples=(step - last_step[0]) * layout.per_rank_batch)
        last_step[0] = step

    recent = RecentSteps()

    def step_done(position: Position) -> None:
        live_recovery.step_done(
            ctx.job_id,
            position.step,
            progress=_progress(
                epoch=position.epoch,
                batch=position.batch,
                history=position.history,
                sums=position.sums.values,
                count=position.sums.count,
                steps=recent.records,
            ),
        )
        ctx.boundary_passed(position.step)  # an elastic job's world changes here

    checkpoints = None
    if job.checkpoint is not None and job.checkpoint.directory is not None:
        checkpoints = Checkpoints.in_directory(
            job.checkpoint,
            run_id=ctx.run_id,
            report=ctx.emit,
            release_timeout_s=ctx.release_timeout_s,
        )
    if job.factory is None:
        # The model's library first (torchvision's code: 165 MiB resident in a process that
        # holds only torch, measured): the peak this rank reports is the job's memory, which
        # the plan estimates, not code its worker loads once.
        resolve(job.model.name)
        ctx.reset_peak_memory()
    job_memory = get_strategy(job.training.strategy).job_memory
    with job_memory(job.settings, layout=layout, device=ctx.membership.device):
        result = train(
            job,
            membership=ctx.membership,
            layout=layout,
            hooks=Hooks(
                report=ctx.emit,
                keep_step=recent.keep,
                heartbeat=heartbeat,
                checkpoints=checkpoints,
                step_done=step_done,
                peak_memory=ctx.peak_memory_bytes,
            ),
            restore=_continue(
                ctx, job.checkpoint, recent=recent, reporting=ctx.rank == layout.reporting_rank
            ),
            state_arrives=ctx.live_source is not None,
        )
    # The pieces wait on this worker for the client to take them (workers/model_pieces.py):
    # the task's result, which Dask may spill to disk, carries only their names.
    pieces = result.model_pieces
    assert isinstance(pieces, dict)
    held = model_pieces.hold(ctx.job_id, pieces, worker=get_worker().address)
    return replace(result, model_pieces=held)


class RecentSteps:
    """A rank's latest step records, kept with its state (``live_recovery``): the steps the
    reporting rank finished but never sent, its worker lost with them, are sent by the next
    attempt's reporting rank from the surviving replica's records.

    Only the latest: a lost worker takes with it the records Dask had not sent yet (it batches
    a worker's events every few milliseconds) and the step in flight, a handful of steps.
    """

    KEPT = 64

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []

    def keep(self, record: dict[str, Any]) -> None:
        self.records.append(record)
        del self.records[: -self.KEPT]

    def received(self, records: list[dict[str, Any]], *, step: int) -> list[dict[str, Any]]:
        """The source's records up to ``step``, the one continued from: this rank's own from
        now on (another loss soon after finds them here), and returned to be sent again (the
        client drops those it has)."""
        self.records = [r for r in records if r["step"] <= step][-self.KEPT :]
        return list(self.records)


def _continue(
    ctx: RankContext,
    checkpoint: CheckpointConfig | None = None,
    *,
    recent: RecentSteps | None = None,
    reporting: bool = False,
) -> Restore:
    """Load a surviving replica's kept state, else the attempt's checkpoint (if any); then keep
    this rank's state for the next attempt. From a replica, the reporting rank sends again its
    latest step records (``RecentSteps``)."""
    source = ctx.live_source

    def restore(state: CheckpointState) -> Progress:
        if source is not None:
            got = live_recovery.receive(
                ctx.job_id, _kept_state(state), source, device=ctx.device, backend=ctx.backend
            )
            # The epoch's running sums are each rank's own: a survivor keeps its own, a
            # replacement counts from here (the epoch's train metrics cover fewer samples).
            own = got.own_progress or {}
            sums = own.get("sums")
            start = Progress(
                epoch=got.progress["epoch"],
                batch=got.progress["batch"],
                step=got.step,
                sums=[*sums.tolist(), float(own["count"])] if sums is not None else [],
                history=got.progress["history"],
            )
            if recent is not None:
                resent = recent.received(got.progress.get("steps", []), step=got.step)
                for record in resent if reporting else []:
                    ctx.emit(record)
        elif ctx.resume_from is not None:
            start = load_checkpoint(
                ctx.resume_from,
                modules=state.modules,
                optimizer=state.optimizer,
                scaler=state.scaler,
                signing_key_file=ctx.signing_key_file,
                storage_options=checkpoint.storage_options if checkpoint else None,
            )
        else:
            start = Progress()
        # Where this attempt starts is a position too: a worker lost before its first step
        # leaves the survivors holding it.
        sums = torch.tensor(start.sums[:-1], dtype=torch.float64) if start.sums else None
        at_start = _progress(
            epoch=start.epoch,
            batch=start.batch,
            history=start.history,
            sums=sums,
            count=int(start.sums[-1]) if start.sums else 0,
            steps=recent.records if recent is not None else [],
        )
        live_recovery.keep(ctx.job_id, _kept_state(state), step=start.step, progress=at_start)
        return start

    return restore


def train(
    job: TrainJob,
    *,
    membership: Membership,
    layout: Layout,
    hooks: Hooks = Hooks(),  # frozen: one shared default is safe
    restore: Restore | None = None,
    state_arrives: bool = False,
) -> RankResult:
    """Train ``job`` on this rank of an initialized process group laid out as ``layout`` (an
    elastic job's layout: in its order of global batches, ``RankBatches``). ``state_arrives``:
    ``restore`` receives every rank's state from a live replica (`RankPlacement`)."""
    config = job.training
    # One measure per process: the kernel's high-water mark has one reset.
    peak_memory = hooks.peak_memory or PeakMemory.start(membership.device).bytes
    trainer = build(
        job, membership=membership, layout=layout, restore=restore, state_arrives=state_arrives
    )
    if membership.rank != layout.reporting_rank:
        hooks = replace(hooks, report=None)  # one rank speaks for the job
    if hooks.heartbeat:
        hooks.heartbeat(trainer.step)
    if hooks.report:
        start = StartRecord(
            strategy=config.strategy,
            world_size=layout.world_size,
            epochs=config.epochs,
            total_steps=trainer.total_steps,
        )
        hooks.report(start.to_event())
    try:
        for epoch in range(trainer.start.epoch, config.epochs):
            if trainer.step >= trainer.total_steps:
                break
            run_epoch(trainer, epoch, hooks=hooks)
        _finish_saving(hooks)  # the run's last checkpoint counts before the run is done
    except BaseException:
        if hooks.checkpoints is not None and hooks.checkpoints.interrupted is not None:
            hooks.checkpoints.interrupted()  # bounded; committed or abandoned, never half
        raise
    # Read before the export: gathering the whole model for the client is not training's peak.
    return close(trainer, peak_memory_bytes=peak_memory())


@dataclass(frozen=True)
class _ModelInputs:
    """What the model is built for: the classes it outputs, one sample's shape, and one
    micro-batch of zeros for the strategies that trace it."""

    num_classes: int
    input_shape: tuple[int, ...]
    sample: torch.Tensor


def build(
    job: TrainJob,
    *,
    membership: Membership,
    layout: Layout,
    restore: Restore | None = None,
    state_arrives: bool = False,
) -> Trainer:
    """The model laid out by the strategy, this rank's data shard, the optimizer and the LR
    schedule, continued from ``restore``'s checkpoint when given (``state_arrives``: from a
    live replica's, received by every rank). Collective."""
    config, rank, device = job.training, membership.rank, membership.device
    torch.manual_seed(config.seed + rank)
    precision = Precision(config.precision, device)
    if rank == 0:
        warn_if_slow(config.precision, device)
    store = (
        open_store(job.data.store_url, storage_options=job.data.storage_options)
        if job.collections is None
        else None
    )
    placed = _Placed(membership, layout, precision, state_arrives)
    strategy = _laid_out(job, store, placed)
    batches, val = _rank_splits(job, store, layout=layout, rank=rank)
    made = build_optimizer(config=config, parameters=strategy.parameters(), factory=job.optimizer)
    start = Progress()
    if restore is not None:
        start = restore(CheckpointState(strategy.modules, made, precision.scaler))
    total_steps = _total_steps(config, batches, start)
    # At the resumed step: a resumed run's rates are the straight run's.
    schedule = build_schedule(
        optimizer=made,
        config=config,
        total_steps=total_steps,
        step=start.step,
        factory=job.lr_schedule,
    )
    return Trainer(
        config=config,
        layout=layout,
        rank=rank,
        device=device,
        strategy=strategy,
        precision=precision,
        batches=batches,
        val=val,
        optimizer=made,
        schedule=schedule,
        total_steps=total_steps,
        start=start,
        step=start.step,
        history=list(start.history),
        throughput=Throughput(warm_step=min(3, (total_steps - start.step) // 4)),
    )


@dataclass(frozen=True)
class _Placed:
    """Where a rank's model is laid out: its membership and layout, the run's precision, and
    whether its state arrives from a live replica once laid out."""

    membership: Membership
    layout: Layout
    precision: Precision
    state_arrives: bool = False


def _laid_out(job: TrainJob, store: OpenedStore | None, placed: _Placed) -> Strategy:
    """The job's model laid out for this rank, for the store's data (``store``) or the
    collections' (``store`` None), with the run's criterion. Collective."""
    criterion = Criterion.of(job.training)
    inputs = _model_inputs(job, store, layout=placed.layout)
    placement = RankPlacement(
        layout=placed.layout,
        rank=placed.membership.rank,
        device=placed.membership.device,
        precision=placed.precision,
        settings=job.settings,
        sample=inputs.sample,
        state_arrives=placed.state_arrives,
    )
    strategy = lay_out_model(
        job.model,
        job.training,
        placement=placement,
        num_classes=criterion.outputs(inputs.num_classes),
        input_shape=inputs.input_shape,
        factory=job.factory,
    )
    strategy.criterion = criterion
    return strategy


def _model_inputs(job: TrainJob, store: OpenedStore | None, *, layout: Layout) -> _ModelInputs:
    """The model's inputs as the store (``store``) or the collections (``store`` None) give
    them."""
    if store is not None:
        return _ModelInputs(
            num_classes=store.num_classes,
            input_shape=tuple(store.train.images.shape[1:]),
            sample=store.train.zeros(layout.micro_batch),
        )
    assert job.collections is not None
    num_classes, input_shape = collections_model_inputs(job.collections)
    return _ModelInputs(
        num_classes=num_classes,
        input_shape=input_shape,
        sample=zero_samples(layout.micro_batch, input_shape),
    )


def _rank_splits(
    job: TrainJob, store: OpenedStore | None, *, layout: Layout, rank: int
) -> tuple["RankBatches | RankShard", StoreSplit]:
    """This rank's training batches and the validation split, from the store (``store``) or
    the collections (``store`` None)."""
    seed = job.training.seed
    if store is None:
        assert job.collections is not None
        return trainer_splits(
            job.collections, rank=rank, batch_size=layout.per_rank_batch, seed=seed
        )
    share = BatchShare(
        rank=layout.dp_rank(rank),
        world_size=layout.dp,
        batch_size=layout.share_of(layout.dp_rank(rank)),
        global_batch=layout.batch_size if layout.elastic == "global" else None,
        per_rank_blocks=layout.elastic == "per_rank",
    )
    batches = RankBatches(store.train, job.data, share, seed=seed)
    return batches, store.val


def lay_out_model(
    model_config: ModelConfig,
    config: TrainingConfig,
    *,
    placement: RankPlacement,
    num_classes: int,
    input_shape: tuple[int, ...],
    factory: Callable[..., nn.Module] | None = None,
) -> Strategy:
    """The model built, checkpointed as ``training.activation_checkpointing`` says, its blocks
    compiled if ``training.compile``, laid out by the strategy for this rank (``placement``),
    and its values drawn (collective)."""
    model, in_place = _built_model(
        model_config, config, num_classes=num_classes, input_shape=input_shape, factory=factory
    )
    apply_activation_checkpointing(
        model,
        mode=config.activation_checkpointing,
        module_classes=tuple(config.activation_checkpointing_modules),
    )
    if config.compile:
        apply_compile(model, backend=config.compile_backend)
    strategy = get_strategy(config.strategy).prepare(model, placement)
    if in_place is not None:  # laid out on the meta device: each rank draws only its part
        in_place.materialize(strategy.modules, device=placement.device)
    return strategy


def _built_model(
    model_config: ModelConfig,
    config: TrainingConfig,
    *,
    num_classes: int,
    input_shape: tuple[int, ...],
    factory: Callable[..., nn.Module] | None,
) -> tuple[nn.Module, InPlaceInit | None]:
    """The model as the strategy receives it, and what draws its values once the strategy has
    laid it out (None: it holds them already).

    A strategy that splits the model gets it on the meta device where its values are each
    module's ``reset_parameters()`` (``model.init``), so that no rank holds it whole
    (``Strategy.lays_out_meta``: not a pipeline cut by tracing, which runs the model), or
    copies its part of ``model.weights``. Built whole, a factory's model draws
    reset_parameters' values here (or copies the file's), so that every strategy starts from
    the same numbers; the built-in models' constructors draw these very values.
    """

    def build(meta: bool) -> nn.Module:
        with torch.device("meta") if meta else contextlib.nullcontext():
            return build_model(
                model_config,
                num_classes=num_classes,
                seed=config.seed,
                input_shape=input_shape,
                factory=factory,
            )

    if not model_config.in_place_init:
        return build(meta=False), None
    model = build(meta=True)  # the client built it there (workflows/runs/config.check_model)
    weights = model_config.weights
    if get_strategy(config.strategy).lays_out_meta(model):
        # Refuses a module it cannot draw, or a weights file that is not the model's.
        return model, InPlaceInit(
            model, seed=config.seed, weights=weights, storage_options=model_config.storage_options
        )
    model = build(meta=False)
    in_place = InPlaceInit(
        model, seed=config.seed, weights=weights, storage_options=model_config.storage_options
    )
    if weights is not None or not model_config.builtin:
        in_place.materialize([model], device=torch.device("cpu"))
    return model, None


def train_step(
    trainer: Trainer, x: torch.Tensor, y: torch.Tensor, *, sums: EpochSums
) -> torch.Tensor | None:
    """One optimizer step on this rank's batch; the loss where this rank knows it."""
    config, precision, optimizer = trainer.config, trainer.precision, trainer.optimizer
    x, y = x.to(trainer.device, non_blocking=True), y.to(trainer.device, non_blocking=True)
    optimizer.zero_grad(set_to_none=True)
    loss = trainer.strategy.forward_backward(x, y, precision=precision, sums=sums)
    if config.max_grad_norm is not None:
        precision.unscale(optimizer)
        trainer.strategy.clip_grad_norm(config.max_grad_norm)
    precision.step(optimizer)
    trainer.schedule.step()
    trainer.step += 1
    return loss


def run_epoch(trainer: Trainer, epoch: int, *, hooks: Hooks) -> dict[str, Any]:
    """Train ``epoch`` (its rest, in the epoch a checkpoint left off), then validate; returns
    the epoch's record, also appended to the history."""
    config, start, checkpoints = trainer.config, trainer.start, hooks.checkpoints
    resumed = epoch == start.epoch
    start_batch = start.batch if resumed else 0
    sums = EpochSums(
        start.sums if resumed else None, device=trainer.device, criterion=trainer.criterion
    )
    samples_before = trainer.throughput.samples
    trainer.strategy.train()
    epoch_started = time.perf_counter()
    batches = trainer.batches.epoch(epoch, start_batch=start_batch)
    # The epoch's position after each step: the next batch, or the next block of an elastic
    # job that keeps each rank's batch (a step of n ranks takes n blocks).
    stride, steps_left = trainer.batches.stride, trainer.batches.steps_from(start_batch)
    # Where a run that ends before the epoch does (max_steps) stands: its final checkpoint is
    # this, so that one continued with a larger max_steps trains the epoch's remaining batches.
    stopped: Progress | None = None
    for i, (x, y) in enumerate(batches):
        batch, after = start_batch + i * stride, start_batch + (i + 1) * stride
        loss = train_step(trainer, x, y, sums=sums)
        # Before the boundary: an elastic job's ranks may stop there, and the step's record
        # must go out all the same (metrics.jsonl had a hole at every resize).
        if config.log_every_steps and trainer.step % config.log_every_steps == 0:
            _step_record(trainer, epoch, loss, hooks=hooks)
        if hooks.step_done:
            _step_done(
                trainer,
                Position(epoch, after, trainer.step, sums, trainer.history),
                hooks=hooks,
            )
        if hooks.heartbeat:
            hooks.heartbeat(trainer.step)
        trainer.throughput.step_done(trainer.batches.job_rows(batch), epoch_started=epoch_started)
        last_of_epoch = i == steps_left - 1
        if trainer.step >= trainer.total_steps:
            if not last_of_epoch:
                stopped = Progress(epoch, after, trainer.step, sums.tolist(), trainer.history)
            break
        # Every N steps, except at an epoch's end: that checkpoint follows in a moment.
        every = checkpoints.every_steps if checkpoints else 0
        if every and trainer.step % every == 0 and not last_of_epoch:
            at = Progress(epoch, after, trainer.step, sums.tolist(), trainer.history)
            _save(trainer, at, hooks=hooks)
    train_seconds = time.perf_counter() - epoch_started
    samples_per_s = trainer.throughput.epoch_done(train_seconds, samples_before=samples_before)
    return _close_epoch(trainer, epoch, sums, samples_per_s, stopped=stopped, hooks=hooks)


def _close_epoch(
    trainer: Trainer,
    epoch: int,
    sums: EpochSums,
    samples_per_s: float,
    *,
    stopped: Progress | None,
    hooks: Hooks,
) -> dict[str, Any]:
    """The end of an epoch (or of a run stopped in one, at ``stopped``): validation, the
    epoch's record in the history and out to the client, and the checkpoint it calls for."""
    config, checkpoints = trainer.config, hooks.checkpoints
    totals = sums.all_reduced()
    val = evaluate(trainer)
    if hooks.heartbeat:
        hooks.heartbeat(trainer.step)  # validation is progress too
    # A dict, as TrainResult.history and the checkpoints keep it.
    record = EpochRecord(
        epoch=epoch + 1,
        epochs=config.epochs,
        step=trainer.step,
        # The task's figures: loss and accuracy, or loss, mse, mae and r2.
        **trainer.criterion.metrics(totals),
        **{f"val_{name}": value for name, value in val.items()},
        samples_per_s=samples_per_s,  # the job's, as TrainResult's
        lr=trainer.schedule.get_last_lr()[0],
    ).to_event()
    if trainer.history and trainer.history[-1]["epoch"] == epoch + 1:
        # The epoch's record from a run that stopped in it (max_steps): this one is the
        # whole epoch's.
        trainer.history[-1] = record
    else:
        trainer.history.append(record)
    if hooks.step_done:
        empty = EpochSums(device=trainer.device, criterion=trainer.criterion)
        _step_done(
            trainer, Position(epoch + 1, 0, trainer.step, empty, trainer.history), hooks=hooks
        )
    if hooks.report:
        hooks.report(record)
    if checkpoints and (checkpoints.at_epoch_end or trainer.step >= trainer.total_steps):
        if stopped is not None:
            # The history kept with it holds the record of the part trained, which the
            # epoch's own replaces once it is trained to its end.
            stopped.history = trainer.history
        ended = Progress(epoch + 1, 0, trainer.step, _zeros(trainer), trainer.history)
        _save(trainer, stopped or ended, hooks=hooks)
    return record


def evaluate(trainer: Trainer) -> dict[str, float]:
    """Validation loss and the task's metrics over the whole split, on every rank
    (collective)."""
    return trainer.strategy.evaluate(
        trainer.val, batch_size=trainer.layout.per_rank_batch, precision=trainer.precision
    )


def close(trainer: Trainer, *, peak_memory_bytes: int | None = None) -> RankResult:
    """One throughput figure for the whole run, and this rank's pieces of the model for the
    client (workers/model_pieces.py): nothing gathered whole.

    A run resumed from its final checkpoint has nothing left to train: it hands back the
    checkpoint's parameters and history.
    """
    # The gradients are spent: free them before this rank copies its pieces for the client.
    trainer.optimizer.zero_grad(set_to_none=True)
    pieces = trainer.strategy.model_pieces()
    return RankResult(
        rank=trainer.rank,
        history=trainer.history,
        steps=trainer.step,
        samples_per_s=trainer.throughput.overall,
        steady_samples_per_s=trainer.throughput.steady,
        first_step_at=trainer.throughput.first_step_at,
        model_pieces=pieces,
        peak_memory_bytes=peak_memory_bytes,
    )


def _step_record(trainer: Trainer, epoch: int, loss: torch.Tensor | None, *, hooks: Hooks) -> None:
    """The step's record: to the client from the reporting rank, and kept on every rank that
    knows the loss (``hooks.keep_step``). The loss is this rank's, of its share of the batch,
    not all-reduced: another rank's kept record stands in for the reporting rank's marked
    ``reported_by_rank`` (an all-reduce here, between the optimizer's step and
    ``step_done``, would leave a survivor of a lost peer stuck in it with a state of no
    known step, which live recovery cannot use). Every rank reads its loss on the logged
    steps: the reporting rank waits for it there anyway, and its peers meet it in the next
    step's collectives."""
    if hooks.report is None and hooks.keep_step is None:
        return
    if loss is None:
        assert hooks.report is None  # the reporting rank holds the last stage
        return
    at_step = {"epoch": epoch + 1, "step": trainer.step, "loss": loss.item()}
    if hooks.report is not None:
        record = StepRecord(**at_step).to_event()
        hooks.report(record)
    else:  # kept only: sent by the next attempt in place of the reporting rank's, so marked
        record = StepRecord(**at_step, reported_by_rank=trainer.rank).to_event()
    if hooks.keep_step is not None:
        hooks.keep_step(record)


def _step_done(trainer: Trainer, position: Position, *, hooks: Hooks) -> None:
    """``hooks.step_done``; where an elastic job's world changes at this step and no rank keeps
    the whole state (sharded), a checkpoint of it first, which the next world loads
    resharded (collective: every rank stops at the same step)."""
    assert hooks.step_done is not None
    try:
        hooks.step_done(position)
    except ResizeBoundary:
        if hooks.checkpoints is not None and not trainer.strategy.replicated:
            at = Progress(
                position.epoch,
                position.batch,
                position.step,
                position.sums.tolist(),
                position.history,
            )
            _save(trainer, at, hooks=hooks)
        _finish_saving(hooks)  # the save in flight counts before the world changes
        raise


def _finish_saving(hooks: Hooks) -> None:
    if hooks.checkpoints is not None and hooks.checkpoints.finish is not None:
        hooks.checkpoints.finish()


def _save(trainer: Trainer, progress: Progress, *, hooks: Hooks) -> None:
    assert hooks.checkpoints is not None
    hooks.checkpoints.save(trainer.checkpoint_state, progress)
    if hooks.heartbeat:
        hooks.heartbeat(trainer.step)


def _kept_state(state: CheckpointState) -> dict[str, Any]:
    """The trainer's state as live recovery keeps and hands it over."""
    modules = {f"module{i}": module for i, module in enumerate(state.modules)}
    return modules | {"optimizer": state.optimizer, "scaler": state.scaler}


def _progress(
    *,
    epoch: int,
    batch: int,
    history: list,
    sums: torch.Tensor | None,
    count: int,
    steps: list[dict[str, Any]],
) -> dict[str, Any]:
    """What a rank keeps of where the loop is, for a replacement rank to start from (the
    epoch's running sums, when there are any, are the keeping rank's own; ``steps``, its
    latest step records)."""
    progress: dict[str, Any] = {
        "epoch": epoch,
        "batch": batch,
        "history": history,
        "steps": steps,
    }
    if sums is not None:
        progress |= {"sums": sums, "count": count}
    return progress


def _zeros(trainer: Trainer) -> list[float]:
    """The sums of an epoch not begun."""
    return EpochSums(device=torch.device("cpu"), criterion=trainer.criterion).tolist()


def _total_steps(
    config: TrainingConfig, batches: "RankBatches | RankShard", start: Progress
) -> int:
    """The run's steps: its epochs', or ``max_steps``. Where the position moves by one block
    per rank (an elastic job that keeps each rank's batch), the steps left follow the world,
    so they are counted from ``start`` at this world's pace."""
    if batches.stride == 1:
        total = config.epochs * len(batches)
    elif start.epoch >= config.epochs:
        total = start.step
    else:
        left = batches.steps_from(start.batch) + (config.epochs - start.epoch - 1) * len(batches)
        total = start.step + left
    return total if config.max_steps is None else min(total, config.max_steps)
