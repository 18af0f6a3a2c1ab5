"""Hyperparameter sweeps: trials of one training function (or config) packed on one cluster,
chosen by Optuna, pruned early, resumable.

>>> from workflows import start_cluster, sweep
>>> def fit(ctx, params):
...     ...  # train with params["lr"], params["hidden"]; ctx.report(val_loss=..., step=...)
>>> with start_cluster(n_workers=4) as cluster:
...     result = sweep(fit, {"lr": ("log", 1e-4, 1e-1), "hidden": [32, 64, 128]},
...                    n_trials=20, metric="val_loss", pruner="median", cluster=cluster)
>>> result.best_params

Each trial is one `workflows.launch` job of ``trial_world_size`` ranks, named
``<study>-trial-<n>``; ``max_concurrent`` of them run at once, each from a client thread.
Rank 0's ``ctx.report`` records carrying ``metric`` are the trial's intermediate values (step:
the record's ``step``, else its ``seq``): a trial the pruner stops has its job's ranks stopped
and is PRUNED. A trial's value is the last ``metric`` rank 0 reported; a function that never
reports it may return it instead (rank 0's return value, a number). A trial that raises is
FAIL, with its error in the ``error`` user attribute, and the sweep goes on.

Given a config (a ``RunConfig``, a TOML path or a dict) instead, the space's keys are config
paths (``training.lr``) and each trial runs the built-in trainer (:func:`workflows.train`) on
``trial_world_size`` ranks; the metric is read from its epoch records (``val_loss``,
``val_accuracy``, ...), the step being the epoch.

With a ``storage``, the same call again continues the study: its default ``study_name`` is
the function's qualified name (``<module>.<qualname>``) or ``<config name>-sweep``, the same
on every call. Finished trials are never run again, the trials a dead client left RUNNING are
re-run with the parameters they hold (``workflows/sweeps/sweep_owners.py``), and the study ends with
``n_trials`` trials. A fresh study takes another ``study_name`` (or another storage). In
memory, each call is a study of its own, ``sweep-<time>-<random>``. Every trial's state
change is also a Dask event on ``dask-train-sweep-<study>`` for the Training page.
"""

import contextlib
import functools
import logging
import math
import re
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import pandas as pd
from distributed import Client

from workers.records import EpochRecord, Record, ReportRecord, TrialRecord, parse_record
from workers.sources import COLLECTION_SOURCES, SourceError, check_root
from workers.spec.errors import ConfigError
from workers.spec.launch import WorkerSelection
from workers.spec.run import RunConfig
from workers.spec.secrets import redact, remember_url
from workers.spec.sections import KEEP_CREDENTIALS
from workflows.cluster.training_cluster import TrainingCluster, live_workers, start_cluster
from workflows.jobs.launcher import JobStopped, select_workers
from workflows.observe.monitoring import sweep_topic
from workflows.runs.config import load_config
from workflows.runs.run_storage import checked_url, is_url
from workflows.sweeps.sweep_owners import TrialOwners
from workflows.sweeps.sweep_space import (
    PRUNERS,
    SAMPLERS,
    config_override,
    first_value,
    is_number,
    search_space,
    suggest,
)

if TYPE_CHECKING:
    from optuna import Study
    from optuna.distributions import BaseDistribution
    from optuna.pruners import BasePruner
    from optuna.samplers import BaseSampler
    from optuna.storages import BaseStorage
    from optuna.trial import FrozenTrial, Trial

logger = logging.getLogger(__name__)

INSTALL_HINT = "sweep() needs Optuna, an optional extra: pip install 'dask-train[sweep]'"
JOURNAL_SUFFIXES = (".log", ".jsonl")
# Keywords sweep() gives every trial's launch() itself: the caller's would clash.
RESERVED = ("cluster", "world_size", "name", "checkpoint_dir", "on_event", "stop")
POLL_S = 1.0  # waiting for other sweeps' trials, and for ours between finishes
STOP_BOUND_S = 120.0  # interrupted: how long stopped trials may take to let go of their ranks
# The figures of the built-in trainer's epoch records, by task (workers/losses.py).
EPOCH_FIGURES = {"classification": ("loss", "accuracy"), "regression": ("loss", "mse", "mae", "r2")}

TrialHandler = Callable[[dict[str, Any]], None]


class TrialError(RuntimeError):
    """A trial that ran but produced no value of the metric."""


@dataclass
class BestTrial:
    """The best finished trial."""

    number: int
    params: dict[str, Any]
    value: float
    checkpoint_dir: str | None  # its checkpoints (sweep(checkpoint_dir=...), a config's folder)
    config: RunConfig | None  # a config sweep's: the trial's config, parameters applied


@dataclass
class SweepResult:
    """What a `sweep` hands back. ``best_*`` are None when no trial completed.

    Attributes:
        study_name: The study's name.
        best_params: The best trial's parameters by key.
        best_value: The best trial's value.
        best_trial: The best trial: ``number``, ``params``, ``value``, ``checkpoint_dir``,
            and for a config sweep the trial's ``config``.
        trials: One row per trial of the study (earlier runs of it included): ``number``,
            ``state`` (COMPLETE, PRUNED, FAIL, RUNNING, WAITING), ``value``, ``params`` (a
            dict) and one ``params_<key>`` column per key, ``wall_s``, ``ranks`` (ranks that
            returned), ``job_id``, ``started_at`` and ``ended_at`` (epoch seconds, on the
            client), ``error`` and ``checkpoint_dir``.
        study: The ``optuna.Study``: ``optuna.visualization`` takes it.
    """

    study_name: str
    best_params: dict[str, Any] | None
    best_value: float | None
    best_trial: BestTrial | None
    trials: pd.DataFrame = field(repr=False)
    study: "Study" = field(repr=False)


@dataclass
class TrialJob:
    """What one trial's run needs."""

    number: int
    name: str
    params: dict[str, Any]
    stop: threading.Event
    on_event: TrialHandler


@dataclass
class TrialOutcome:
    value: float
    ranks: int
    job_id: str
    checkpoint_dir: str | None


@dataclass
class FunctionTrials:
    """Trials of a rank function: ``fn(ctx, params, **kwargs)`` on every rank of a launch."""

    fn: Callable[..., Any]
    kwargs: dict[str, Any]
    world_size: int
    metric: str
    checkpoint_dir: str | None
    workers: WorkerSelection = field(default_factory=WorkerSelection)

    def prepare(self, client: Client, space: Mapping[str, Any]) -> None:
        """Nothing to share between a function's trials."""

    def read(self, record: Record) -> tuple[float, int] | None:
        """Rank 0's figure of the metric in a report record, with its step."""
        if not isinstance(record, ReportRecord) or record.rank != 0:
            return None
        value, step = record.metrics.get(self.metric), record.metrics.get("step")
        if not is_number(value):
            return None
        return float(value), step if isinstance(step, int) else record.seq

    def run(self, client: Client, job: TrialJob) -> TrialOutcome:
        from workflows.jobs.launch import launch

        folder = f"{self.checkpoint_dir}/{job.name}" if self.checkpoint_dir else None
        result = launch(
            self.fn,
            job.params,
            cluster=client,
            world_size=self.world_size,
            name=job.name,
            checkpoint_dir=folder,
            on_event=job.on_event,
            stop=job.stop,
            **self.kwargs,
        )
        reported = [r[self.metric] for r in result.metrics[0] if is_number(r.get(self.metric))]
        returned = result.results[0]
        if not reported and not is_number(returned):
            raise TrialError(
                f"rank 0 reported no {self.metric!r} (ctx.report({self.metric}=...)) and "
                f"returned {type(returned).__name__}, not a number"
            )
        return TrialOutcome(
            value=float(reported[-1] if reported else returned),
            ranks=len(result.results),
            job_id=result.job_id,
            checkpoint_dir=_absolute(folder) if folder else None,
        )


@dataclass
class ConfigTrials:
    """Trials of the built-in trainer: the base config with each trial's parameters set."""

    base: dict[str, Any]
    world_size: int
    metric: str
    checkpoint_dir: str | None

    @functools.cached_property
    def base_config(self) -> RunConfig:
        """The base, validated once (a staged model's cut is traced to be checked)."""
        return load_config(self.base)

    @property
    def workers(self) -> WorkerSelection:
        return self.base_config.launch.workers

    def config_for(self, number: int, name: str, params: Mapping[str, Any]) -> RunConfig:
        """The trial's config: ``params`` set by path, its own name, ranks and folders."""
        overrides = [config_override(key, value) for key, value in params.items()]
        overrides += [config_override("name", name), f"launch.world_size={self.world_size}"]
        base = self.base_config
        checkpoints = self.checkpoint_dir or base.checkpoint.directory
        if checkpoints:
            overrides.append(config_override("checkpoint.directory", f"{checkpoints}/{name}"))
        if base.tracking.tensorboard:
            overrides.append(
                config_override("tracking.tensorboard", f"{base.tracking.tensorboard}/{name}")
            )
        if base.tracking.mlflow_uri:
            # One experiment for the sweep, one MLflow run per trial.
            experiment = base.tracking.experiment or base.name
            overrides.append(config_override("tracking.experiment", experiment))
        return load_config(self.base, overrides)

    def check(self, space: Mapping[str, "BaseDistribution"]) -> None:
        """Every key a config path that takes its first value, and the metric one the epoch
        records carry: a typo fails here, before any trial."""
        try:
            self.config_for(0, "sweep-check", {})
        except ConfigError as error:
            raise ValueError(f"trial_world_size: {error}") from None
        for key, distribution in space.items():
            try:
                load_config(self.base, [config_override(key, first_value(distribution))])
            except ConfigError as error:
                raise ValueError(f"space[{key!r}]: not a config value here: {error}") from None
        try:
            first = {key: first_value(d) for key, d in space.items()}
            config = self.config_for(0, "sweep-check", first)
        except ConfigError as error:
            raise ValueError(f"space: {error}") from None
        figures = EPOCH_FIGURES[config.training.resolved_task]
        known = [*figures, *(f"val_{name}" for name in figures), "samples_per_s", "lr"]
        if self.metric not in known:
            raise ValueError(
                f"metric: {self.metric!r} is not in the epoch records of a "
                f"{config.training.resolved_task} run; use one of {known}"
            )

    def prepare(self, client: Client, space: Mapping[str, Any]) -> None:
        """Build (or find) the dataset store once, before trials that share it start together.
        Keys that change the store (``data.*``, ``training.seed``) make each trial build its
        own: run those one at a time."""
        from workflows.data.preprocess import prepare_store

        config = self.base_config
        changes_store = any(k.startswith("data.") or k == "training.seed" for k in space)
        if changes_store or config.data.dataset in COLLECTION_SOURCES:
            return
        prepare_store(client, config.data.resolved(), seed=config.training.seed)

    def read(self, record: Record) -> tuple[float, int] | None:
        """The metric in an epoch record, with the epoch as its step."""
        if not isinstance(record, EpochRecord):
            return None
        value = record.to_event().get(self.metric)
        return (float(value), record.epoch) if is_number(value) else None

    def run(self, client: Client, job: TrialJob) -> TrialOutcome:
        from workflows.runs.driver import train

        config = self.config_for(job.number, job.name, job.params)
        result = train(config, cluster=client, on_event=job.on_event, stop=job.stop)
        reported = [r[self.metric] for r in result.history if is_number(r.get(self.metric))]
        if not reported:
            raise TrialError(f"the epoch records carry no {self.metric!r}")
        checkpoints = config.checkpoint.directory
        return TrialOutcome(
            value=float(reported[-1]),
            ranks=result.world_size,
            job_id=result.job_id,
            checkpoint_dir=_absolute(checkpoints) if checkpoints else None,
        )


Trials = FunctionTrials | ConfigTrials


@dataclass(frozen=True)
class SweepRequest:
    """What :func:`sweep` (or ``dask-train sweep``) is asked, as given: :func:`sweep_spec`
    checks it. The fields are :func:`sweep`'s arguments of the same names; ``target`` is its
    ``fn_or_config``, and ``kwargs`` its keywords for each trial."""

    target: Any
    space: Mapping[str, Any]
    n_trials: int
    metric: str
    mode: str = "min"
    trial_world_size: int | None = None
    max_concurrent: int | None = None
    sampler: Any = "tpe"
    pruner: Any = None
    storage: Any = None
    study_name: str | None = None
    checkpoint_dir: str | Path | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class SweepSpec:
    """A sweep's request, validated."""

    trials: Trials
    space: dict[str, "BaseDistribution"]
    n_trials: int
    trial_world_size: int
    max_concurrent: int | None
    metric: str
    direction: str
    sampler: "BaseSampler"
    pruner: "BasePruner"
    storage: "BaseStorage"
    study_name: str

    @property
    def event_topic(self) -> str:
        """The Dask event topic of the sweep's trials (the Training page's table)."""
        return sweep_topic(self.study_name)


def sweep(
    fn_or_config: Callable[..., Any] | RunConfig | str | Path | dict[str, Any],
    space: Mapping[str, Any],
    *,
    n_trials: int,
    trial_world_size: int | None = None,
    max_concurrent: int | None = None,
    metric: str,
    mode: str = "min",
    sampler: "str | BaseSampler" = "tpe",
    pruner: "str | BasePruner | None" = None,
    storage: "str | Path | BaseStorage | None" = None,
    study_name: str | None = None,
    cluster: TrainingCluster | Client | None = None,
    checkpoint_dir: str | Path | None = None,
    on_trial: TrialHandler | None = None,
    **kwargs: Any,
) -> SweepResult:
    """Run ``n_trials`` trials of ``fn_or_config`` over ``space``; the best, every trial, and
    the Optuna study. Needs the ``[sweep]`` extra (Optuna).

    Each trial is a `launch` job of ``trial_world_size`` ranks; several run at once, and the
    scheduler's queue packs them onto the workers. A study in a ``storage`` is resumable: the
    same call again (the same default ``study_name``) never reruns a finished trial and ends
    with ``n_trials`` trials.

    Args:
        fn_or_config: A function ``fn(ctx, params, **kwargs)`` run on every rank of a trial
            (``params``: the trial's values by key); or a config (`RunConfig`, a TOML path or
            a dict) whose trials run the built-in trainer, with config paths
            (``"training.lr"``) as the keys of ``space``.
        space: Key to Optuna distribution, or ``("log", 1e-4, 1e-1)`` (log-uniform),
            ``(0.0, 0.5)`` (uniform), ``(1, 4)`` or ``("int", 1, 4)`` (integers, both ends
            included), ``[32, 64, 128]`` (choices).
        n_trials: How many trials the study ends with.
        trial_world_size: Ranks per trial; default a config's ``launch.world_size`` (a
            number), else 1.
        max_concurrent: Trials at once; default the eligible workers over
            ``trial_world_size``.
        metric: The figure to optimize: the last one rank 0 reported under this name (its
            ``step`` the pruner's step), else rank 0's return value if a number; for a config,
            an epoch figure (``val_loss``, ``val_accuracy``, ...).
        mode: ``"min"`` or ``"max"``.
        sampler: ``"tpe"``, ``"random"``, ``"grid"`` (every key a list of choices) or an
            Optuna sampler.
        pruner: ``None``, ``"median"``, ``"hyperband"``, ``"successive_halving"`` or an Optuna
            pruner; a pruned trial's ranks are stopped at once.
        storage: ``None`` (in memory), a database URL (``sqlite:///runs/sweep.db``), a
            journal file (``*.log``, ``*.jsonl``; also an fsspec URL, ``s3://bucket/x.log``,
            kept as one object per append) or an Optuna storage; a SQLite or journal file's
            folder is made.
        study_name: The study's name in ``storage``; an existing study of that name is
            continued. Default with a storage: the function's ``<module>.<qualname>`` (a
            script's file name for ``__main__``), or ``<config name>-sweep``; give another
            name for a fresh study. In memory: ``sweep-<time>-<random>``.
        cluster: A `TrainingCluster` or a Dask ``Client``; ``None`` starts a local cluster
            and closes it afterwards.
        checkpoint_dir: Each trial checkpoints into its own ``<study>-trial-<n>`` folder
            there (``ctx.save``; a trial taken over resumes from it). A config sweep uses the
            config's ``checkpoint.directory`` without it.
        on_trial: Receives each trial's state changes (the records of the Dask events on
            ``dask-train-sweep-<study>``).
        **kwargs: Keywords `launch` takes (``config``, ``data``, ``max_failures``, ...) go to
            each trial's launch; the others to ``fn``. A config sweep takes none for a
            function.

    Returns:
        The best parameters and value, every trial as a DataFrame, and the study.

    Raises:
        ValueError: A bad ``space`` form, ``metric``, ``mode`` or ``trial_world_size``; the
            message names it.
        ImportError: Optuna is not installed.

    A trial that raises is recorded as FAIL; the sweep goes on.
    """
    request = SweepRequest(
        fn_or_config,
        space,
        n_trials=n_trials,
        metric=metric,
        mode=mode,
        trial_world_size=trial_world_size,
        max_concurrent=max_concurrent,
        sampler=sampler,
        pruner=pruner,
        storage=storage,
        study_name=study_name,
        checkpoint_dir=checkpoint_dir,
        kwargs=kwargs,
    )
    spec = sweep_spec(request)
    return run_sweep(spec, cluster=cluster, on_trial=on_trial)


def run_sweep(
    spec: SweepSpec,
    *,
    cluster: TrainingCluster | Client | None = None,
    on_trial: TrialHandler | None = None,
) -> SweepResult:
    """Run a sweep checked by :func:`sweep_spec` (the CLI checks before its cluster starts)."""
    owned = cluster is None
    if cluster is None:
        base = spec.trials.base if isinstance(spec.trials, ConfigTrials) else None
        cluster = start_cluster(load_config(base).cluster if base else None)
    client = cluster.client if isinstance(cluster, TrainingCluster) else cluster
    try:
        return Sweep(_optuna(), spec, client, on_trial).run()
    finally:
        if owned:
            cluster.close()


def finished_study(spec: SweepSpec) -> SweepResult | None:
    """The result of ``spec``'s study when its storage holds it finished (``n_trials`` trials,
    none running or waiting): a sweep of it would run nothing, so none need start."""
    optuna = _optuna()
    if spec.study_name not in optuna.get_all_study_names(spec.storage):
        return None
    study = optuna.load_study(study_name=spec.study_name, storage=spec.storage)
    trials = study.get_trials(deepcopy=False)
    if len(trials) < spec.n_trials or not all(t.state.is_finished() for t in trials):
        return None
    return sweep_result(study, spec)


def _optuna() -> ModuleType:
    try:
        import optuna
    except ImportError:
        raise ImportError(INSTALL_HINT) from None
    # What the sweep needs of Optuna's private parts: a one-line error now, naming the version,
    # where this Optuna lacks them.
    import workflows.compat.optuna_private  # noqa: F401

    return optuna


def sweep_spec(request: SweepRequest) -> SweepSpec:
    """:func:`sweep`'s arguments checked before anything starts: a ``ValueError`` naming the
    field, or an ``ImportError`` without Optuna."""
    optuna = _optuna()
    _check_settings(request)
    n_trials, storage, study_name = request.n_trials, request.storage, request.study_name
    distributions = search_space(request.space)
    # A string: a folder, or a URL (s3://...), which Path would mangle.
    given = request.checkpoint_dir
    folder = str(given).rstrip("/") if given is not None else None
    trials = _trials(
        request.target,
        distributions,
        request.trial_world_size,
        request.metric,
        folder,
        request.kwargs,
    )
    if study_name is None:
        # Stored: the same call again finds its study. In memory there is nothing to find,
        # and a name of its own keeps its trials' checkpoint folders apart from earlier ones.
        study_name = (
            default_study_name(trials)
            if storage is not None
            else f"sweep-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
        )
    return SweepSpec(
        trials=trials,
        space=distributions,
        n_trials=n_trials,
        trial_world_size=trials.world_size,
        max_concurrent=request.max_concurrent,
        metric=request.metric,
        direction="minimize" if request.mode == "min" else "maximize",
        sampler=_sampler(optuna, request.sampler, distributions, n_trials),
        pruner=_pruner(optuna, request.pruner),
        storage=_storage(
            optuna,
            storage,
            trials.base_config.bucket_options(str(storage))
            if isinstance(trials, ConfigTrials) and isinstance(storage, str | Path)
            else {},
        ),
        study_name=study_name,
    )


def _check_settings(request: SweepRequest) -> None:
    """The request's counts, metric, mode and study name: a ``ValueError`` naming the field."""
    _count("n_trials", request.n_trials)
    if request.trial_world_size is not None:
        _count("trial_world_size", request.trial_world_size)
    if request.max_concurrent is not None:
        _count("max_concurrent", request.max_concurrent)
    metric, mode, study_name = request.metric, request.mode, request.study_name
    if not isinstance(metric, str) or not metric:
        raise ValueError(f"metric: the name of a reported figure, e.g. 'val_loss'; got {metric!r}")
    if mode not in ("min", "max"):
        raise ValueError(f"mode: 'min' or 'max', got {mode!r}")
    if study_name is not None and (not isinstance(study_name, str) or not study_name.strip()):
        raise ValueError(f"study_name: a non-empty name, got {study_name!r}")


def default_study_name(trials: "Trials") -> str:
    """The study a stored sweep continues when called again: ``<config name>-sweep``, or the
    function's ``<module>.<qualname>`` (a script run as ``__main__`` by its file's name)."""
    if isinstance(trials, ConfigTrials):
        return config_study(trials.base_config.name)
    fn = trials.fn
    module = getattr(fn, "__module__", None)
    if module == "__main__":
        script = getattr(sys.modules.get("__main__"), "__file__", None)
        module = Path(script).stem if script else None
    qualname = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    return f"{module}.{qualname}" if module else qualname


def _count(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}: a whole number of at least 1, got {value!r}")


def _trials(
    target: Any,
    space: dict[str, "BaseDistribution"],
    world_size: int | None,
    metric: str,
    checkpoint_dir: str | None,
    kwargs: dict[str, Any],
) -> Trials:
    if isinstance(target, RunConfig | str | Path | dict):
        if kwargs:
            raise ValueError(
                f"sweep: {sorted(kwargs)[0]}: keyword arguments go to a training function; "
                "a config sweep takes none (sweep config values through the space)"
            )
        try:
            # Kept in this process only (each trial's config is made from it): with the
            # storage options' credentials, which a dump written out leaves out.
            keep = {"context": KEEP_CREDENTIALS}
            base = target.model_dump(**keep) if isinstance(target, RunConfig) else target
            base = load_config(base).model_dump(mode="json", **keep)
        except ConfigError as error:
            raise ValueError(f"config: {error}") from None
        if world_size is None:  # the config's own, as a trainer's scaling config under Tune
            configured = base["launch"]["world_size"]
            world_size = configured if isinstance(configured, int) else 1
        trials = ConfigTrials(base, world_size, metric, checkpoint_dir)
        trials.check(space)
        _check_data_root(trials.base_config)
        return trials
    if not callable(target):
        raise ValueError(
            f"fn_or_config: a rank function fn(ctx, params) or a config (RunConfig, TOML path, "
            f"dict), got {type(target).__name__}"
        )
    clashes = [key for key in RESERVED if key in kwargs]
    if clashes:
        raise ValueError(f"sweep: {clashes[0]}: set by the sweep for every trial; leave it out")
    return FunctionTrials(target, kwargs, world_size or 1, metric, checkpoint_dir)


def _check_data_root(config: RunConfig) -> None:
    """A dataset folder that is not there is told now, before a cluster starts (as the CLI
    does)."""
    try:
        check_root(config.data.resolved())
    except SourceError as error:
        raise ValueError(f"config: {error}") from None


def _sampler(
    optuna: ModuleType, sampler: Any, space: dict[str, "BaseDistribution"], n_trials: int
) -> "BaseSampler":
    if isinstance(sampler, optuna.samplers.BaseSampler):
        return sampler
    if sampler == "tpe":
        # Trials that run at once: those without a value yet count as bad, so that the next
        # one is sampled elsewhere (Optuna 5's default; 4.x's was False).
        return optuna.samplers.TPESampler(constant_liar=True)
    if sampler == "random":
        return optuna.samplers.RandomSampler()
    if sampler != "grid":
        raise ValueError(f"sampler: one of {list(SAMPLERS)} or an Optuna sampler, got {sampler!r}")
    ranges = [
        k
        for k, d in space.items()
        if not isinstance(d, optuna.distributions.CategoricalDistribution)
    ]
    if ranges:
        raise ValueError(
            f"sampler: 'grid' needs a list of choices for every key; {ranges[0]!r} is a range"
        )
    grid = {key: list(d.choices) for key, d in space.items()}
    points = math.prod(len(choices) for choices in grid.values())
    if n_trials > points:
        raise ValueError(f"n_trials: {n_trials} exceeds the grid's {points} points")
    return optuna.samplers.GridSampler(grid)


def _pruner(optuna: ModuleType, pruner: Any) -> "BasePruner":
    if isinstance(pruner, optuna.pruners.BasePruner):
        return pruner
    if pruner is None:
        return optuna.pruners.NopPruner()
    named = {
        "median": optuna.pruners.MedianPruner,
        "hyperband": optuna.pruners.HyperbandPruner,
        "successive_halving": optuna.pruners.SuccessiveHalvingPruner,
    }
    if isinstance(pruner, str) and pruner in named:
        return named[pruner]()
    raise ValueError(f"pruner: None, one of {list(PRUNERS)} or an Optuna pruner, got {pruner!r}")


def _storage(
    optuna: ModuleType, storage: Any, storage_options: dict[str, Any] | None = None
) -> "BaseStorage":
    """``storage_options``: those of a journal's bucket (the config's, for its bucket)."""
    if storage is None:
        return optuna.storages.InMemoryStorage()
    if isinstance(storage, optuna.storages.BaseStorage):
        return storage
    text = str(storage) if isinstance(storage, str | Path) else ""
    if text.endswith(JOURNAL_SUFFIXES):  # a path, or a URL fsspec knows: s3:/x is a typo
        text = checked_url("storage", text)
    if text.endswith(JOURNAL_SUFFIXES) and is_url(text):  # a journal in a bucket
        from workflows.runs.object_journal import ObjectJournalBackend

        return optuna.storages.JournalStorage(ObjectJournalBackend(text, storage_options))
    if "://" in text:
        remember_url(text)  # a database's password: masked wherever it is shown
        _make_folder_of(text)
        try:
            return optuna.storages.RDBStorage(text)
        except Exception as error:
            said = f"storage: {text}: {type(error).__name__}: {error}"
            raise ValueError(redact(said)) from None
    if text.endswith(JOURNAL_SUFFIXES):
        path = Path(text).expanduser()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise ValueError(f"storage: {text}: {error}") from None
        backend = optuna.storages.journal.JournalFileBackend(str(path))
        return optuna.storages.JournalStorage(backend)
    raise ValueError(
        f"storage: None, a database URL (sqlite:///runs/sweep.db), a journal file (*.log, "
        f"*.jsonl, also in object storage: s3://bucket/sweeps/study.log) or an Optuna "
        f"storage, got {storage!r}"
    )


def _absolute(folder: str | Path) -> str:
    """A checkpoint folder as the workers and the results name it: absolute, a URL as it is."""
    return str(folder) if is_url(str(folder)) else str(Path(folder).absolute())


def _make_folder_of(url: str) -> None:
    """A SQLite file's folder is made, as a journal file's is (``sqlite:///runs/sweep.db``
    in a fresh checkout: SQLite makes the file, never its folder)."""
    if not url.startswith("sqlite:///"):
        return
    database = url.removeprefix("sqlite:///").split("?", 1)[0]
    if database and database != ":memory:":
        try:
            Path(database).expanduser().parent.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise ValueError(f"storage: {url}: {error}") from None


def trial_name(study_name: str, number: int) -> str:
    """The trial's job name (a config's ``name`` takes only these characters)."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", f"{study_name}-trial-{number}")


class PruningFeed:
    """A trial job's ``on_event``: rank 0's figures of the metric become the trial's
    intermediate values, and once the pruner says so, the job is asked to stop."""

    def __init__(
        self,
        trial: "Trial",
        read: Callable[[Record], tuple[float, int] | None],
        stop: threading.Event,
        reported: set[int],
    ) -> None:
        self.trial, self.read, self.stop = trial, read, stop
        self.pruned = False
        # Steps the trial holds already (one taken over) keep their values: Optuna keeps the
        # first value of a step.
        self._steps = set(reported)

    def __call__(self, record: dict[str, Any]) -> None:
        found = None if self.pruned else self.read(parse_record(record))
        # A restarted attempt reports the steps since its checkpoint again.
        if found is None or found[1] in self._steps:
            return
        value, step = found
        self._steps.add(step)
        self.trial.report(value, step)
        if self.trial.should_prune():
            self.pruned = True
            self.stop.set()


@dataclass
class RunningTrial:
    trial: "Trial"
    name: str
    params: dict[str, Any]
    stop: threading.Event
    feed: PruningFeed

    @property
    def number(self) -> int:
        return self.trial.number


class Sweep:
    """One client's part in a study: it starts trials (new ones, WAITING ones, and those that
    dead clients left RUNNING) until the study holds ``n_trials`` finished trials, at most
    ``max_concurrent`` at a time, each from a thread of its own."""

    def __init__(
        self, optuna: ModuleType, spec: SweepSpec, client: Client, on_trial: TrialHandler | None
    ) -> None:
        self.optuna, self.spec, self.client, self.on_trial = optuna, spec, client, on_trial
        self.study = self._open_study()
        self.owners = TrialOwners(self.study, client, on_lost=self._stop_lost)
        self.topic = spec.event_topic
        self._running: dict[Future, RunningTrial] = {}

    def _open_study(self) -> "Study":
        spec = self.spec
        study = self.optuna.create_study(
            storage=spec.storage,
            sampler=spec.sampler,
            pruner=spec.pruner,
            study_name=spec.study_name,
            direction=spec.direction,
            load_if_exists=True,
        )
        directions = [d.name.lower() for d in study.directions]
        if directions != [spec.direction]:
            raise ValueError(
                f"mode: study {spec.study_name!r} is set to {' and '.join(directions)}; this "
                f"sweep would {spec.direction}"
            )
        measured = study.user_attrs.get("metric", spec.metric)
        if measured != spec.metric:
            raise ValueError(
                f"metric: study {spec.study_name!r} measures {measured!r}, not {spec.metric!r}"
            )
        study.set_user_attr("metric", spec.metric)
        return study

    def run(self) -> SweepResult:
        concurrency = self._concurrency()
        self.spec.trials.prepare(self.client, self.spec.space)
        pool = ThreadPoolExecutor(concurrency, thread_name_prefix="dask-train-trial")
        with self.owners.beating():
            try:
                self._keep_busy(pool, concurrency)
            finally:
                self._stop_running()
                pool.shutdown(wait=False, cancel_futures=True)
        return sweep_result(self.study, self.spec)

    def _concurrency(self) -> int:
        size = self.spec.trial_world_size
        eligible = len(select_workers(live_workers(self.client), self.spec.trials.workers))
        if size > eligible:
            raise ValueError(
                f"trial_world_size: {size} ranks per trial, but the cluster has {eligible} "
                "eligible workers"
            )
        return self.spec.max_concurrent or max(1, eligible // size)

    def _keep_busy(self, pool: ThreadPoolExecutor, concurrency: int) -> None:
        running = self._running
        while True:
            while len(running) < concurrency and (trial := self._next_trial()) is not None:
                running[pool.submit(self._run_trial, trial)] = trial
            if not running:
                if self._study_done():
                    return
                # Other sweeps' trials still run: wait for them, or take them over when their
                # client dies.
                time.sleep(POLL_S)
                continue
            finished, _ = wait(running, timeout=POLL_S, return_when=FIRST_COMPLETED)
            for future in finished:
                running.pop(future)
                future.result()  # a trial's own errors are its FAIL: this raises only bugs

    def _stop_running(self) -> None:
        """Interrupted (Ctrl-C, an error of the sweep itself): stop every running trial's job;
        its trial stays RUNNING, released for a later sweep to take over."""
        for trial in self._running.values():
            trial.stop.set()
        wait(self._running, timeout=STOP_BOUND_S)

    def _stop_lost(self, trial_id: int) -> None:
        """Another sweep runs this trial now: ours stops, and leaves the trial to it."""
        from workflows.compat.optuna_private import trial_id as id_of

        for trial in list(self._running.values()):
            if id_of(trial.trial) == trial_id:
                trial.stop.set()

    def _study_done(self) -> bool:
        trials = self.study.get_trials(deepcopy=False)
        unfinished = [t for t in trials if not t.state.is_finished()]
        return len(trials) >= self.spec.n_trials and not unfinished

    def _next_trial(self) -> RunningTrial | None:
        """A trial to run now: one a dead client left RUNNING, else a WAITING or new one while
        the study holds fewer than ``n_trials``; None when there is none."""
        from workflows.compat.optuna_private import trial_id

        trials = self.study.get_trials(deepcopy=False)
        for frozen in self.owners.abandoned(trials):
            if self.owners.claim(frozen):
                logger.warning(
                    "taking over trial %d, left running by a sweep that is gone", frozen.number
                )
                taken = self.optuna.trial.Trial(self.study, trial_id(frozen))
                return self._prepared(taken, reported=set(frozen.intermediate_values))
        waiting = any(t.state == self.optuna.trial.TrialState.WAITING for t in trials)
        if len(trials) >= self.spec.n_trials and not waiting:
            return None
        trial = self.study.ask()
        self.owners.hold(trial_id(trial))
        return self._prepared(trial, reported=set())

    def _prepared(self, trial: "Trial", reported: set[int]) -> RunningTrial | None:
        """The trial with its parameters: those it holds (a trial taken over), the rest
        sampled now. A trial whose held values do not fit the space is FAIL."""
        stop = threading.Event()
        running = RunningTrial(
            trial=trial,
            name=trial_name(self.spec.study_name, trial.number),
            params={},
            stop=stop,
            feed=PruningFeed(trial, self.spec.trials.read, stop, reported),
        )
        try:
            running.params = {k: suggest(trial, k, d) for k, d in self.spec.space.items()}
        except ValueError as error:
            self._finish(running, "FAIL", time.time(), error=f"its parameters: {error}")
            return None
        return running

    def _run_trial(self, trial: RunningTrial) -> None:
        started = time.time()
        self._announce(trial, "RUNNING", wall_s=0.0)
        job = TrialJob(trial.number, trial.name, trial.params, trial.stop, trial.feed)
        try:
            outcome = self.spec.trials.run(self.client, job)
        except JobStopped:
            if trial.feed.pruned:
                self._finish(trial, "PRUNED", started)
            # Otherwise the sweep was interrupted (the trial stays RUNNING, released), or
            # another sweep took the trial over.
            return
        except Exception as error:
            logger.info("trial %d failed: %s: %s", trial.number, type(error).__name__, error)
            self._finish(trial, "FAIL", started, error=f"{type(error).__name__}: {error}")
            return
        if trial.feed.pruned:  # the pruner spoke as the job ended: it is pruned all the same
            self._finish(trial, "PRUNED", started, outcome)
        elif not math.isfinite(outcome.value):
            self._finish(
                trial, "FAIL", started, outcome, error=f"{self.spec.metric} was {outcome.value}"
            )
        else:
            self._finish(trial, "COMPLETE", started, outcome)

    def _finish(
        self,
        trial: RunningTrial,
        state: str,
        started: float,
        outcome: TrialOutcome | None = None,
        error: str | None = None,
    ) -> None:
        from workflows.compat.optuna_private import trial_id

        ended = time.time()
        attrs: dict[str, Any] = {
            "started_at": started,
            "ended_at": ended,
            "wall_s": ended - started,
        }
        if outcome is not None:
            attrs |= {
                "ranks": outcome.ranks,
                "job_id": outcome.job_id,
                "checkpoint_dir": outcome.checkpoint_dir,
            }
        if error is not None:
            attrs["error"] = (error.splitlines() or [""])[0][:1000]
        try:
            for key, value in attrs.items():
                trial.trial.set_user_attr(key, value)
            value = outcome.value if state == "COMPLETE" and outcome else None
            with _telling(self.study):
                told = self.study.tell(
                    trial.trial,
                    value,
                    state=self.optuna.trial.TrialState[state],
                    skip_if_finished=True,
                )
        except self.optuna.exceptions.UpdateFinishedTrialError:
            logger.warning("trial %d was finished by another sweep meanwhile", trial.number)
            return
        finally:
            self.owners.done(trial_id(trial.trial))
        job_id = outcome.job_id if outcome else ""
        self._announce(
            trial, state, value=told.value, wall_s=attrs["wall_s"], job_id=job_id, error=error
        )

    def _announce(
        self,
        trial: RunningTrial,
        state: str,
        *,
        wall_s: float,
        value: float | None = None,
        job_id: str = "",
        error: str | None = None,
    ) -> None:
        """The trial's state change: a Dask event for the Training page, and ``on_trial``."""
        record = TrialRecord(
            sweep=self.spec.study_name,
            number=trial.number,
            state=state,
            value=value,
            params=trial.params,
            job_id=job_id,
            wall_s=wall_s,
        )
        try:
            self.client.log_event(self.topic, record.to_event())
        except Exception as failure:  # the page misses one change; the sweep goes on
            logger.warning("trial %d: no %s event: %s", trial.number, state, failure)
        if self.on_trial is not None:
            if error:
                record = record.model_copy(update={"error": error})
            try:
                self.on_trial(record.to_event())
            except Exception:
                logger.exception("on_trial raised for trial %d", trial.number)


@contextlib.contextmanager
def _telling(study: "Study") -> Iterator[None]:
    """A sampler ends ``study.optimize`` by calling ``study.stop()`` from ``after_trial``
    (``GridSampler``, once its grid is covered), which raises outside ``optimize``; the sweep
    counts its trials itself, so the stop is let through as a no-op."""
    from workflows.compat.optuna_private import thread_local

    local = thread_local(study)
    before, local.in_optimize_loop = local.in_optimize_loop, True
    try:
        yield
    finally:
        local.in_optimize_loop = before


USER_COLUMNS = ("wall_s", "ranks", "job_id", "started_at", "ended_at", "error", "checkpoint_dir")


def trials_frame(trials: list["FrozenTrial"], keys: list[str]) -> pd.DataFrame:
    """One row per trial: see :class:`SweepResult`."""
    rows = []
    for trial in trials:
        row = {"number": trial.number, "state": trial.state.name, "value": trial.value}
        row |= {"params": dict(trial.params)}
        row |= {f"params_{key}": trial.params.get(key) for key in keys}
        row |= {name: trial.user_attrs.get(name) for name in USER_COLUMNS}
        rows.append(row)
    columns = ["number", "state", "value", "params", *(f"params_{k}" for k in keys), *USER_COLUMNS]
    return pd.DataFrame(rows, columns=columns)


def sweep_result(study: "Study", spec: SweepSpec) -> SweepResult:
    from optuna.trial import TrialState

    frame = trials_frame(study.get_trials(deepcopy=False), list(spec.space))
    if not study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        return SweepResult(spec.study_name, None, None, None, frame, study)
    best = study.best_trial
    config = None
    if isinstance(spec.trials, ConfigTrials):
        config = spec.trials.config_for(
            best.number, trial_name(spec.study_name, best.number), best.params
        )
    assert best.value is not None
    chosen = BestTrial(
        number=best.number,
        params=dict(best.params),
        value=best.value,
        checkpoint_dir=best.user_attrs.get("checkpoint_dir"),
        config=config,
    )
    return SweepResult(spec.study_name, chosen.params, chosen.value, chosen, frame, study)


def config_study(config_name: str) -> str:
    """The study a stored sweep of a config continues by default."""
    return f"{config_name}-sweep"
