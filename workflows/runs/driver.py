"""Train from a client: config → cluster → process group → rank loops → result.

>>> from workflows import train
>>> result = train("workflows/configs/digits_ddp.toml")
"""

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from distributed import Client
from pydantic import BaseModel

from workers.collection_shard import CollectionPlan
from workers.optimizers import OptimizerFactory, ScheduleFactory
from workers.records import ResumedRecord
from workers.sources import COLLECTION_SOURCES, SourceError, check_root, get_source
from workers.spec.errors import ConfigError
from workers.spec.names import model_source
from workers.spec.plans import get_plan
from workers.spec.run import RunConfig
from workers.spec.sections import LOSSES, DataConfig
from workers.train import RankResult, TrainJob, run_rank
from workflows.cluster.training_cluster import TrainingCluster, start_cluster
from workflows.data.array_store import write_array_store
from workflows.data.preprocess import prepare_store
from workflows.data.stores import StoreManifest, read_manifest
from workflows.jobs.code_shipping import ship_modules
from workflows.jobs.collections import (
    DataError,
    check_fixed_world,
    check_trainer_data,
    trainer_data,
)
from workflows.jobs.interrupts import DroppedInterrupts
from workflows.jobs.launch import JobHold, LaunchResult, TrainingFailed, launch_on
from workflows.jobs.request import JobRequest
from workflows.observe.events import EventHandler
from workflows.observe.tracking import Tracker
from workflows.runs.config import check_model, load_config, model_builder
from workflows.runs.model_handback import collect_model
from workflows.runs.planner import check_worker_memory
from workflows.runs.resolved_run import ResolvedRun, resolve_run

logger = logging.getLogger(__name__)


@dataclass
class TrainResult:
    """What a finished `train` hands back to the client.

    Every samples/s figure is the job's, all data-parallel replicas together.

    Attributes:
        name: The config's name.
        strategy: ``ddp``, ``data_parallel``, ``model_parallel``, ``pipeline``, ``fsdp`` or
            ``hsdp``.
        world_size: The number of ranks.
        history: One dict per epoch: loss and the task's metrics (train and ``val_``),
            samples/s, learning rate.
        samples_per_s: Samples per second over the whole run.
        steady_samples_per_s: The same after the first steps' one-off costs.
        wall_s: Seconds from the call to the end.
        first_step_s: From the ``train`` call to the first finished step, preprocessing and
            planning included.
        store: The dataset store used; ``None`` when trained from Dask collections.
        state_dict: The final parameters, on the CPU: every rank's pieces put together on the
            client (workers/model_pieces.py).
        split_points: Where a staged strategy cut the model; ``None`` otherwise.
        recoveries: One dict per restart: the failure, what it continued from, the step
            resumed from, the seconds lost.
        first_step_after_launch_s: From the ranks' launch (the store ready) to the first step.
        job_id: The job's label on ``/metrics`` and the Training page: ``<name>-<8 hex>``.
        peak_memory_mib: Each rank's peak memory while training, in rank order: CUDA's
            allocator peak on a GPU, the growth of the process's peak resident set on a CPU,
            less the pages of files (a library's code) first read meanwhile (the export of the
            model at the end left out); ``None`` where not measurable.
        resizes: One dict per change of an elastic run's world (``launch.world_size =
            "min:max"``): ``from``, ``to``, ``step``, ``cause``, ``pause_s``,
            ``redone_steps``.
    """

    name: str
    strategy: str
    world_size: int
    history: list[dict[str, float]]
    # The job's samples/s (all replicas together), as the epoch records' samples_per_s: one
    # meaning on the epoch line, in summary.json and on /metrics (workers/train.py Throughput).
    samples_per_s: float
    steady_samples_per_s: float  # the same after the first steps' one-off costs
    wall_s: float
    first_step_s: float  # from the train() call, preprocessing and planning included
    store: StoreManifest | None  # None: trained from Dask collections (train(data=...))
    state_dict: dict[str, torch.Tensor] = field(repr=False)
    split_points: tuple[str, ...] | None = None  # where staged strategies cut the model
    recoveries: list[dict[str, Any]] = field(default_factory=list)  # one per restart
    first_step_after_launch_s: float = float("nan")  # from the ranks' launch, the store ready
    job_id: str = ""  # the job's label on /metrics and the Training page: <name>-<8 hex>
    peak_memory_mib: list[float | None] = field(default_factory=list)  # per rank, in order
    resizes: list[dict[str, Any]] = field(default_factory=list)  # an elastic run's, in order

    @property
    def final(self) -> dict[str, float]:
        """The last epoch's figures (``history[-1]``)."""
        return self.history[-1]


def print_progress(record: dict[str, Any]) -> None:
    """The seed article's epoch line, plus validation and the job's throughput (all ranks)."""
    if record.get("kind") == "epoch":
        print(format_epoch(record), flush=True)
    elif record.get("kind") == "resumed":
        print(ResumedRecord.model_validate(record).line(), flush=True)


# The figures an epoch line shows, where the task reports them: classification reports
# accuracy, regression MSE, MAE and R² (workers/losses.py).
_FIGURES = {"loss": "Loss", "accuracy": "Acc", "mse": "MSE", "mae": "MAE", "r2": "R2"}


def format_epoch(r: dict[str, Any]) -> str:
    shown = [(key, label) for key, label in _FIGURES.items() if key in r]
    shown += [
        (f"val_{key}", f"Val {label}") for key, label in _FIGURES.items() if f"val_{key}" in r
    ]
    figures = ", ".join(f"{label}: {r[key]:.4f}" for key, label in shown)
    return f"Epoch [{r['epoch']}/{r['epochs']}], {figures}, {r['samples_per_s']:.0f} samples/s"


def train(
    config: RunConfig | str | Path | dict[str, Any],
    *,
    model: Callable[..., torch.nn.Module] | None = None,
    optimizer: OptimizerFactory | None = None,
    lr_schedule: ScheduleFactory | None = None,
    cluster: TrainingCluster | Client | None = None,
    on_event: EventHandler | None = print_progress,
    tracker: Tracker | None = None,
    data: Mapping[str, tuple[Any, Any]] | None = None,
    stop: threading.Event | None = None,
) -> TrainResult:
    """Train ``config`` on ``cluster`` (or on a local cluster started and closed here).

    The dataset store is built or checked first, then every rank runs the built-in trainer
    under `launch`: checkpoints, recovery and events work as for your own function.

    Args:
        config: A `RunConfig`, a TOML file's path, or a dict of its sections.
        model: A callable returning an ``nn.Module``, used in place of ``model.name`` (which
            the run's records then do not describe). It is called with ``model.kwargs``, and
            ``num_classes`` and the input shape where it takes them. Code the workers cannot
            import travels to them.
        optimizer: A callable taking the model's parameters (a list) and returning a
            ``torch.optim.Optimizer``, used in place of ``training.optimizer`` (its groups and
            hyperparameters are the callable's own). It travels to the workers as ``model``
            does; checkpoints hold its state.
        lr_schedule: A callable taking the optimizer and the run's total steps and returning
            an ``LRScheduler``, used in place of ``training.lr_schedule``; a resumed run steps
            it to the step it resumes at.
        cluster: A `TrainingCluster` or a Dask ``Client``; ``None`` starts a local cluster
            from ``config.cluster`` and closes it afterwards.
        on_event: Receives each rank-0 metrics record (epoch ends, and steps when
            ``training.log_every_steps`` is set) while the job runs; the default prints the
            epoch lines, ``None`` is silent.
        tracker: Where the records also go; without one, the TensorBoard folder and MLflow run
            that ``config.tracking`` names (opened and finished here).
        data: ``{"train": (X, y), "val": (X_val, y_val)}``, Dask arrays or dataframes, in
            place of ``config.data``'s dataset: the partitions are read where they lie.
        stop: Setting this event ends the job: its ranks are stopped and `JobStopped` is
            raised.

    Returns:
        The history, the final parameters (rank 0's, on the CPU) and the timings.

    Raises:
        ConfigError: The config, the model or the loss is invalid; the message names the
            field.
        DataError: A ``data`` collection cannot be trained on (a `ValueError`).
        TrainingFailed: More failures than ``launch.max_failures`` allows.
        LaunchError: Too few eligible workers, or a backend the workers lack.
        JobStopped: ``stop`` was set.

    Example:
        ```python
        with start_cluster(n_workers=2) as cluster:
            result = train("workflows/configs/digits_ddp.toml", cluster=cluster)
        print(result.final["val_accuracy"])
        ```
    """
    called_at = time.time()
    if not isinstance(config, RunConfig):
        config = load_config(config)
    if data is None:
        # A missing data.root is told now, before a cluster starts or a job queues.
        try:
            check_root(config.data.resolved())
        except SourceError as error:
            raise ConfigError(str(error)) from None
    owned_tracker = tracker is None and config.tracking.enabled
    if owned_tracker:
        tracker = Tracker.open(config.tracking, config.model_dump(mode="json"))
    handler = on_event if tracker is None else tracker.wrap(on_event)
    # A Ctrl-C that Python drops in a finalizer while this waits is raised again.
    with DroppedInterrupts(), tracker.closing() if owned_tracker else contextlib.nullcontext():
        # A cluster started here is closed here, whatever happens; one given is left open.
        scope = (
            start_cluster(config.cluster) if cluster is None else contextlib.nullcontext(cluster)
        )
        with scope as cluster:
            client = cluster.client if isinstance(cluster, TrainingCluster) else cluster
            run = resolve_run(client, config)
            call = _TrainCall(client, handler, called_at, model, (optimizer, lr_schedule), stop)
            result = _train_on(call, run, data)
        if owned_tracker:
            tracker.finish_result(result)
        return result


# train(optimizer=..., lr_schedule=...), passed on together to the job.
Components = tuple[OptimizerFactory | None, ScheduleFactory | None]


@dataclass(frozen=True)
class _TrainCall:
    """What one ``train`` call fixes for every step after it resolved the run: the cluster's
    client, who hears the records, when it was called, the code it was given in Python (a
    model factory, an optimizer and a schedule) and what stops it."""

    client: Client
    on_event: EventHandler | None
    called_at: float
    factory: Callable[..., torch.nn.Module] | None = None
    components: Components = (None, None)
    stop: threading.Event | None = None


def _train_on(
    call: _TrainCall, run: ResolvedRun, data: Mapping[str, tuple[Any, Any]] | None = None
) -> TrainResult:
    """Train ``run`` from its store, or from the Dask collections ``data`` (given, or read by
    a source read as collections): written into a store, or read where they lie."""
    config = run.config
    if data is None and config.data.dataset in COLLECTION_SOURCES:
        data = _read_collections(config)
    if data is None:
        return _train_prepared(call, run)
    classification = config.training.resolved_task == "classification"
    if config.data.collections == "store":
        # Written into a store by Dask tasks, then read chunk by chunk: larger than memory.
        check_trainer_data(data, config.training.strategy)
        # Unless data.store names one, collections go to a store of their own (named by their
        # fingerprint), never over the store of the dataset the config leaves as its default.
        target = config.data if run.store_named else config.data.model_copy(update={"store": None})
        manifest = write_array_store(call.client, data, target, classification=classification)
        stored = run.with_data(config.data.model_copy(update={"store": manifest.url}))
        return _train_prepared(call, stored, manifest=manifest)
    check_fixed_world(run.launch)  # an elastic run reads a store
    # The collections go where the ranks will run: the job holds its workers first.
    hold = JobHold(
        call.client, run.launch, name=config.name, on_event=call.on_event, stop=call.stop
    )
    with (
        hold,
        trainer_data(
            call.client,
            data,
            config.training.strategy,
            hold.world_size,
            classification=classification,
            workers=hold.workers(),
        ) as prepared,
    ):
        return _train_prepared(call, run, collections=prepared.plan, hold=hold)


def _read_collections(config: RunConfig) -> dict[str, tuple[Any, Any]]:
    """The Dask collections of a source read as collections (parquet, zarr). Their refusals are
    a DataError, as those of collections passed in ``data`` are."""
    data = config.data
    try:
        return get_source(data.dataset).collections(data, seed=config.training.seed)
    except SourceError as error:
        raise DataError(str(error)) from None


def _known_classes(
    data: DataConfig, collections: CollectionPlan | None, manifest: StoreManifest | None
) -> int:
    """The class count the model is checked with before the store is built: the store's, when
    it is known; otherwise 10 (the check only builds the model on the meta device)."""
    if manifest is not None:
        return manifest.num_classes
    if collections is not None:
        return 10
    known = read_manifest(data.store_url, storage_options=data.storage_options)
    return len(known["classes"]) if known else 10


def _train_prepared(
    call: _TrainCall,
    run: ResolvedRun,
    *,
    collections: CollectionPlan | None = None,
    manifest: StoreManifest | None = None,
    hold: JobHold | None = None,
) -> TrainResult:
    """Train ``run``'s ranks from ``collections``, or from the store ``manifest`` describes, or
    else from the store that preprocessing its data builds (or finds complete)."""
    client, on_event, called_at, stop = call.client, call.on_event, call.called_at, call.stop
    config = run.config
    known_classes = _known_classes(config.data, collections, manifest)
    _check_code(call, config, known_classes)
    # A rank its worker cannot hold is refused now, not killed by the worker's nanny mid-run.
    builder = None if call.factory is None else model_builder(config, known_classes, call.factory)
    check_worker_memory(client, run, num_classes=known_classes, build=builder)
    if collections is None and manifest is None:
        # Preprocess on the same cluster first, unless a complete store for these inputs exists.
        manifest = prepare_store(client, config.data, seed=config.training.seed)
    settings, points = config.strategy_settings, None
    if get_plan(config.training.strategy).staged:
        assert manifest is not None  # staged strategies take no collections (trainer_data)
        points = _cut_once(client, run, num_classes=manifest.num_classes, factory=call.factory)
        cut = config.pipeline.model_copy(update={"split_points": points})
        settings = settings.model_copy(update={"pipeline": cut})
    job = _train_job(call, run, settings, collections)
    checkpoints = config.checkpoint.directory
    launched_at = time.time()
    request = JobRequest(
        fn=run_rank,
        settings=run.launch,
        name=config.name,
        args=(job,),
        checkpoint_dir=checkpoints if config.checkpoint.resume == "auto" else None,
        keep_checkpoints=config.checkpoint.keep,
        storage_options=config.checkpoint.storage_options,
        run_id=config.checkpoint_owner,
        signing_key_file=config.checkpoint.signing_key_file,
        task_prefix="train",
        # Epoch records whose events were still in flight when the job returned.
        final_records=lambda results: list(results[0].history),
        called_at=called_at,
    )
    launched = launch_on(client, request, on_event=on_event, stop=stop, hold=hold)
    # Each rank hands back its pieces (its shards, its stages); together the whole model.
    state_dict = collect_model(client, [result.model_pieces for result in launched.results])
    return _train_result(
        config,
        launched,
        state_dict=state_dict,
        store=manifest,
        split_points=points,
        times=(called_at, launched_at),
    )


def _check_code(call: _TrainCall, config: RunConfig, known_classes: int | None) -> None:
    """The model's, the loss's and the optimizer's code, checked before the store is built or a
    rank starts, where torch must build them to tell (built-in ones are checked without)."""
    if (
        call.factory is not None
        or not config.model.builtin
        or config.training.loss not in LOSSES
        or not config.training.checked_without_torch
    ):
        check_model(config, num_classes=known_classes, factory=call.factory)
        # Modules named by import path that the workers lack travel to them; a factory given
        # in Python travels inside the job, and launch_on ships what that refers to.
        ship_modules(call.client, _imported_modules(config))


def _train_job(
    call: _TrainCall,
    run: ResolvedRun,
    settings: BaseModel | None,
    collections: CollectionPlan | None,
) -> TrainJob:
    """What every rank of ``run`` is given: its sections, its layout, the strategy's settings
    (a staged run's with its cut), its data and the code given in Python."""
    config = run.config
    checkpoint = config.checkpoint
    return TrainJob(
        data=config.data,
        model=config.model,
        training=config.training,
        layout=run.layout,
        settings=settings,
        checkpoint=checkpoint if checkpoint.directory else None,
        collections=collections,
        factory=call.factory,
        optimizer=call.components[0],
        lr_schedule=call.components[1],
        layouts=run.layouts,
    )


def _cut_once(
    client: Client,
    run: ResolvedRun,
    *,
    num_classes: int,
    factory: Callable[..., torch.nn.Module] | None,
) -> tuple[str, ...]:
    """A staged run's split points, resolved once on the client so that every rank holds the
    same stages: the configured ones, or planned. A factory is built here as every rank
    builds it, to check and plan its cut."""
    # torch.distributed.pipelining costs ~0.8 s to import: only staged runs pay it.
    from workflows.runs.planner import resolve_split_points

    return resolve_split_points(
        client,
        run,
        num_classes=num_classes,
        build=None if factory is None else model_builder(run.config, num_classes, factory),
    )


def _train_result(
    config: RunConfig,
    launched: LaunchResult,
    *,
    state_dict: dict[str, Any],
    store: StoreManifest | None,
    split_points: tuple[str, ...] | None,
    times: tuple[float, float],
) -> TrainResult:
    """What ``train`` hands back, from the job's rank 0 and the times it was called and
    launched at (epoch seconds)."""
    called_at, launched_at = times
    results: list[RankResult] = launched.results
    rank0 = results[0]
    return TrainResult(
        name=config.name,
        strategy=config.training.strategy,
        world_size=len(results),
        history=rank0.history,
        samples_per_s=rank0.samples_per_s,
        steady_samples_per_s=rank0.steady_samples_per_s,
        wall_s=time.time() - launched_at,
        first_step_s=rank0.first_step_at - called_at,
        first_step_after_launch_s=rank0.first_step_at - launched_at,
        store=store,
        state_dict=state_dict,
        recoveries=launched.recoveries,
        resizes=launched.resizes,
        split_points=split_points,
        job_id=launched.job_id,
        peak_memory_mib=[
            None if r.peak_memory_bytes is None else round(r.peak_memory_bytes / 2**20, 1)
            for r in results
        ],
    )


def _imported_modules(config: RunConfig) -> set[str]:
    """The top-level modules of the import paths in ``model.name``, ``training.loss``,
    ``training.optimizer`` and ``training.lr_schedule``."""
    training = config.training
    named = (training.loss, training.optimizer, training.lr_schedule)
    paths = [name for name in named if ":" in name]
    source, _ = model_source(config.model.name)
    if source == "import_path":
        paths.append(config.model.name)
    return {path.partition(":")[0].split(".")[0] for path in paths}


__all__ = [
    "ConfigError",
    "TrainResult",
    "TrainingFailed",
    "format_epoch",
    "print_progress",
    "train",
]
