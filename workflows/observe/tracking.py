"""Experiment tracking the ecosystem's way: TensorBoard event files and MLflow runs.

The trackers live on the client and consume the same metrics records ``on_event`` receives
(the ranks already send them there), so the ranks never write tracking files::

    [tracking]
    tensorboard = "runs/tb"                  # event files for `tensorboard --logdir runs/`
    mlflow_uri = "sqlite:///runs/mlflow.db"  # or http(s)://host:5000
    experiment = "digits"                    # default: the config's name

TensorBoard tags: ``train/<metric>``, ``val/<metric>``, ``perf/samples_per_s``, ``lr`` and
``report/<name>`` (the rank API's ``ctx.report``), against the global optimizer step. MLflow
metrics keep the names of ``metrics.jsonl`` (``loss``, ``val_accuracy``, ...).
"""

import contextlib
import logging
import math
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Self

from workers.records import (
    EpochRecord,
    Record,
    RecoveryRecord,
    ReportRecord,
    StartRecord,
    StepRecord,
    parse_record,
)
from workers.spec.secrets import redact
from workers.spec.tracking import TrackingConfig
from workflows.observe.metrics_file import write_atomically

logger = logging.getLogger(__name__)
# In a run directory: the MLflow run it logs to, which a resumed run goes on logging to.
MLFLOW_RUN_ID = "mlflow_run_id"
EventHandler = Callable[[dict[str, Any]], None]

# Where a record stands and where it came from (a ctx.report's rank, attempt, sequence number and
# wall-clock time), not what was measured.
_POSITION = frozenset(
    {"kind", "epoch", "epochs", "step", "total_steps", "rank", "attempt", "seq", "time"}
    | {"reported_by_rank"}  # who stood in for a lost rank 0 (workflows/observe/events.py)
)
# Epoch-record metrics that are neither training nor validation figures.
_TENSORBOARD_TAGS = {"samples_per_s": "perf/samples_per_s", "lr": "lr"}
# MLflow refuses longer parameter values.
_MAX_PARAM = 6000


class TrackingError(RuntimeError):
    """A tracking store that cannot be opened; the message names the field."""


def kept_mlflow_run_id(run_dir: Path) -> str | None:
    """The MLflow run that a start of the run in ``run_dir`` logged to, if any."""
    kept = run_dir / MLFLOW_RUN_ID
    return kept.read_text().strip() or None if kept.is_file() else None


def flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """``{"training": {"epochs": 3}}`` → ``{"training.epochs": "3"}``: MLflow's params."""
    flat: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(flatten(value, f"{name}."))
        else:  # by value too: a secret in any field is masked (workers/spec/secrets.py)
            flat[name] = redact(str(value))[:_MAX_PARAM]
    return flat


def _numbers(record: Mapping[str, Any]) -> dict[str, float]:
    """The measured figures of a record (bools and non-finite values are no metrics)."""
    return {
        key: float(value)
        for key, value in record.items()
        if key not in _POSITION
        and isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
    }


class _Metrics:
    """What a record means as (name, value, step) points, shared by both sinks."""

    def __init__(self) -> None:
        self._reports: dict[int, int] = {}  # per rank: reports seen, the step when none given

    def points(self, record: Record) -> tuple[int | None, dict[str, float]]:
        """(step, {metrics.jsonl name: value}) of a record; rank API metrics keep their names."""
        match record:
            case StepRecord() | EpochRecord():
                return record.step, _numbers(record.to_event())
            case ReportRecord(rank=rank):
                count = self._reports[rank] = self._reports.get(rank, 0) + 1
                if rank != 0:  # rank 0 speaks for the job, as in metrics.jsonl
                    return None, {}
                step = record.metrics.get("step")
                return step if isinstance(step, int) else count, _numbers(record.metrics)
        return None, {}


def tensorboard_tag(kind: str, name: str) -> str:
    """The stable TensorBoard tag of a metric: ``val_loss`` → ``val/loss``."""
    if kind == "report":
        return f"report/{name}"
    if name in _TENSORBOARD_TAGS:
        return _TENSORBOARD_TAGS[name]
    if name.startswith("val_"):
        return f"val/{name.removeprefix('val_')}"
    return f"train/{name}"


class _TensorBoard:
    def __init__(self, folder: str, resume_step: int | None = None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.folder = folder
        # A resumed run redoes the steps after its checkpoint: TensorBoard drops what the
        # interrupted run logged past it, so each step keeps one point.
        purge = None if resume_step is None else resume_step + 1
        self.writer = SummaryWriter(log_dir=folder, purge_step=purge)

    def log(self, kind: str, step: int, metrics: dict[str, float]) -> None:
        for name, value in metrics.items():
            self.writer.add_scalar(tensorboard_tag(kind, name), value, global_step=step)
        if kind == "epoch":
            self.writer.flush()  # an epoch is worth seeing in TensorBoard at once

    def tags(self, values: dict[str, str]) -> None:
        """Run facts (strategy, world size) as one text entry."""
        text = "\n".join(f"- {key}: {value}" for key, value in values.items())
        self.writer.add_text("run", text)

    def close(self) -> None:
        self.writer.close()


class _MLflow:
    """One MLflow run, through MlflowClient (no global active-run state to leak)."""

    def __init__(self, uri: str, experiment: str, run_name: str, run_id: str | None = None) -> None:
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=uri)
        if run_id is not None:
            # Resumed: the same run goes on (a deleted or foreign id is an error, not a new run).
            self.run_id = self.client.get_run(run_id).info.run_id
            self.client.update_run(self.run_id, status="RUNNING")
            self.resumed = True
            return
        found = self.client.get_experiment_by_name(experiment)
        if found is not None:
            experiment_id = found.experiment_id
        else:
            location = None
            if uri.startswith("sqlite:///"):
                # Artifacts beside the database, not in whatever folder the run started from.
                database = Path(uri.removeprefix("sqlite:///"))
                location = (database.parent.absolute() / "artifacts").as_uri()
            experiment_id = self.client.create_experiment(experiment, artifact_location=location)
        self.run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id
        self.resumed = False

    def params(self, params: dict[str, str]) -> None:
        from mlflow.entities import Param

        if self.resumed:
            # MLflow refuses to change a logged param: a resumed run keeps the first values.
            held = self.client.get_run(self.run_id).data.params
            changed = sorted(k for k, v in params.items() if k in held and held[k] != v)
            if changed:
                logger.warning("MLflow run %s keeps its first params for %s", self.run_id, changed)
            params = {k: v for k, v in params.items() if k not in held}
        items = [Param(key, value) for key, value in params.items()]
        for start in range(0, len(items), 100):  # MLflow's batch limit
            self.client.log_batch(self.run_id, params=items[start : start + 100])

    def log(self, kind: str, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = _millis()
        batch = [Metric(name, value, now, step) for name, value in metrics.items()]
        self.client.log_batch(self.run_id, metrics=batch)

    def tags(self, values: dict[str, str]) -> None:
        for key, value in values.items():
            self.client.set_tag(self.run_id, key, value)

    def artifacts(self, paths: list[Path]) -> None:
        for path in paths:
            if path.is_dir():
                self.client.log_artifacts(self.run_id, str(path), artifact_path=path.name)
            elif path.exists():
                self.client.log_artifact(self.run_id, str(path))

    def close(self, status: str) -> None:
        self.client.set_terminated(self.run_id, status=status)


def _millis() -> int:
    return int(time.time() * 1000)


class Tracker:
    """The client-side sink: TensorBoard and/or MLflow, fed with metrics records.

    A failing tracker never fails the training it watches: the first error of a sink is logged
    as a warning and that sink stops.
    """

    def __init__(
        self,
        *,
        tensorboard: _TensorBoard | None = None,
        mlflow: _MLflow | None = None,
    ) -> None:
        self._sinks: dict[str, Any] = {}
        if tensorboard is not None:
            self._sinks["tensorboard"] = tensorboard
        if mlflow is not None:
            self._sinks["mlflow"] = mlflow
        self._mlflow = mlflow
        self._metrics = _Metrics()
        self._facts: dict[str, str] = {}
        self._closed = False

    @classmethod
    def open(
        cls,
        config: TrackingConfig,
        run_config: Mapping[str, Any],
        *,
        run_dir: Path | None = None,
        resume: bool = False,
        resume_step: int | None = None,
        run_name: str | None = None,
    ) -> "Tracker":
        """Open the sinks ``config`` names; ``run_config`` is the resolved config as a dict
        (MLflow's params). ``run_dir``, a run directory, names the MLflow run after its folder
        and keeps the run's id there (``mlflow_run_id``): with ``resume``, the MLflow run it
        keeps is continued. ``resume_step`` is the checkpoint's step a resumed run starts from.
        """
        name = str(run_config.get("name", "run"))
        tensorboard = None
        if config.tensorboard:
            tensorboard = _TensorBoard(config.tensorboard, resume_step)
        mlflow = None
        if config.mlflow_uri:
            resumed = kept_mlflow_run_id(run_dir) if run_dir and resume else None
            try:
                mlflow = _MLflow(
                    config.mlflow_uri,
                    config.experiment or name,
                    run_name or (run_dir.name if run_dir else name),
                    resumed,
                )
                mlflow.params(flatten(run_config))
            except Exception as error:
                if tensorboard is not None:
                    tensorboard.close()
                raise TrackingError(
                    f"tracking.mlflow_uri: could not open an MLflow run at {config.mlflow_uri}: "
                    f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
                ) from error
            if run_dir is not None:
                write_atomically(run_dir / MLFLOW_RUN_ID, mlflow.run_id + "\n")
        return cls(tensorboard=tensorboard, mlflow=mlflow)

    @property
    def mlflow_run_id(self) -> str | None:
        return self._mlflow.run_id if self._mlflow is not None else None

    def _each(self, action: Callable[[Any], None]) -> None:
        for name, sink in list(self._sinks.items()):
            try:
                action(sink)
            except Exception as error:
                logger.warning("%s tracking stopped: %s: %s", name, type(error).__name__, error)
                del self._sinks[name]

    def record(self, record: dict[str, Any]) -> None:
        """Log one metrics record (an ``on_event`` handler)."""
        typed = parse_record(record)
        match typed:
            case StartRecord():
                self._tag(strategy=typed.strategy, world_size=typed.world_size)
            case RecoveryRecord():
                self._tag(recoveries=typed.recoveries)
            case _:
                step, metrics = self._metrics.points(typed)
                if step is not None and metrics:
                    self._each(lambda sink: sink.log(typed.kind, step, metrics))

    def _tag(self, **values: Any) -> None:
        values = {k: redact(str(v)) for k, v in values.items() if v is not None}
        self._facts.update(values)
        self._each(lambda sink: sink.tags(values) if isinstance(sink, _MLflow) else None)

    def wrap(self, on_event: EventHandler | None) -> EventHandler:
        """An ``on_event`` that records here first, then calls ``on_event``."""

        def handler(record: dict[str, Any]) -> None:
            self.record(record)
            if on_event is not None:
                on_event(record)

        return handler

    def finish(self, summary: Mapping[str, Any], artifacts: Sequence[Path] = ()) -> None:
        """The run succeeded: its summary facts become tags, ``artifacts`` go to MLflow."""
        recoveries = summary.get("recoveries")
        self._tag(
            strategy=summary.get("strategy"),
            world_size=summary.get("world_size"),
            recoveries=len(recoveries) if isinstance(recoveries, list) else recoveries,
        )
        if "tensorboard" in self._sinks:
            self._sinks["tensorboard"].tags(self._facts)
        paths = [Path(p) for p in artifacts]
        self._each(lambda sink: sink.artifacts(paths) if isinstance(sink, _MLflow) else None)
        self.close("FINISHED")

    def finish_result(self, result: Any) -> None:
        """Finish from a ``TrainResult`` (the Python API, which has no run directory): the final
        parameters go to MLflow as ``model.pt`` and a summary as ``summary.json``."""
        import json

        import torch

        summary = {
            "name": result.name,
            "strategy": result.strategy,
            "world_size": result.world_size,
            "epochs": len(result.history),
            "final": {k: v for k, v in result.final.items() if k != "kind"},
            "samples_per_s": result.steady_samples_per_s,
            "wall_s": result.wall_s,
            "recoveries": result.recoveries,
        }
        if self._mlflow is None or "mlflow" not in self._sinks:
            self.finish(summary)
            return
        with tempfile.TemporaryDirectory(prefix="dask-train-") as folder:
            model, written = Path(folder) / "model.pt", Path(folder) / "summary.json"
            torch.save(result.state_dict, model)
            written.write_text(json.dumps(summary, indent=2) + "\n")
            self.finish(summary, [model, written])

    def close(self, status: str = "FAILED") -> None:
        """Close the sinks; an MLflow run not finished by :meth:`finish` ends as ``status``."""
        if self._closed:
            return
        self._closed = True
        self._each(lambda sink: sink.close(status) if isinstance(sink, _MLflow) else sink.close())

    @contextlib.contextmanager
    def closing(self) -> Iterator[Self]:
        """Close on the way out: an interrupted run's MLflow run is KILLED, a failed one FAILED
        (a resumed run reopens it)."""
        try:
            yield self
        except KeyboardInterrupt:
            self.close("KILLED")
            raise
        finally:
            self.close("FAILED")


def track_prediction(
    config: TrackingConfig,
    run_config: Mapping[str, Any],
    summary: Mapping[str, Any],
    artifacts: Sequence[Path],
    *,
    name: str,
    training_run_id: str | None = None,
) -> str | None:
    """Log a finished batch inference as an MLflow run of its own (``<name>-predict``): its
    figures as metrics, its metrics file, confusion matrix and summary as artifacts, and the
    training run it scored with as a tag. Returns the run id; None without MLflow tracking or
    when the store cannot be reached (the predictions are written already: a warning, no
    failure)."""
    if not config.mlflow_uri:
        return None
    mlflow_only = TrackingConfig(mlflow_uri=config.mlflow_uri, experiment=config.experiment)
    try:
        tracker = Tracker.open(mlflow_only, run_config, run_name=f"{name}-predict")
    except TrackingError as error:
        logger.warning("prediction not tracked: %s", error)
        return None
    with tracker.closing():
        tracker._tag(kind="predict", training_run_id=training_run_id)
        figures = _numbers({k: summary.get(k) for k in ("accuracy", "images_per_s", "seconds")})
        tracker._each(lambda sink: sink.log("predict", 0, figures))
        tracker.finish(summary, artifacts)
    return tracker.mlflow_run_id


__all__ = [
    "Tracker",
    "TrackingConfig",
    "TrackingError",
    "flatten",
    "tensorboard_tag",
    "track_prediction",
]
