"""Training metrics on the scheduler: a SchedulerPlugin that listens to the ranks' Dask events
and serves the latest figures of every job as Prometheus gauges at the dashboard's ``/metrics``.
"""

import logging
import threading
import time
import weakref
from typing import Any

from distributed import Scheduler, SchedulerPlugin

from workers.compat.distributed_private import dashboard_page_template
from workers.records import (
    AdmittedRecord,
    BaseRecord,
    EpochRecord,
    HeartbeatRecord,
    MalformedRecord,
    OutputRecord,
    QueuedRecord,
    ReportRecord,
    ResizedRecord,
    StartRecord,
    Topic,
    TrialRecord,
    WorldRecord,
    parse_record,
)
from workflows.observe.dashboard import (
    ROUTE,
    TrainingPage,
    add_to_navigation,
    training_page_url,
)

logger = logging.getLogger(__name__)

# Three kinds of topics, under prefixes none of which begins another: a name the user gives (a
# job's, a study's) cannot carry its topic into another kind (a job named "sweep-a" was read as
# a sweep's trials, one named "heartbeat-a" as heartbeats). Each record's model says which kind
# of topic it travels on (workers/records.py, ``TOPIC``); one that arrives on another is refused.
TOPIC_ROOT = "dask-train-"
# Job J's records (reports, epochs, resizes) travel on EVENT_PREFIX + J.
EVENT_PREFIX = TOPIC_ROOT + "job-"
# Each rank's heartbeat (step, samples/s) for job J travels on HEARTBEAT_PREFIX + J.
HEARTBEAT_PREFIX = TOPIC_ROOT + "heartbeat-"
# A sweep's trials (workflows/sweeps/sweep.py) travel on SWEEP_PREFIX + the study's name.
SWEEP_PREFIX = TOPIC_ROOT + "sweep-"
TOPIC_PREFIXES: dict[Topic, str] = {
    "job": EVENT_PREFIX,
    "heartbeat": HEARTBEAT_PREFIX,
    "sweep": SWEEP_PREFIX,
}
PLUGIN_NAME = "dask-train-metrics"
KEEP_JOBS = 20  # a long-lived scheduler keeps the series of this many recent jobs
KEEP_EPOCHS = 1000  # and this many epoch records of each, for the Training page's curves

# (metric, record field, help)
GAUGES = (
    ("dask_train_epoch", "epoch", "Last finished epoch"),
    ("dask_train_step", "step", "Optimizer steps taken"),
    ("dask_train_loss", "loss", "Training loss (mean over all ranks)"),
    ("dask_train_accuracy", "accuracy", "Training accuracy (all ranks)"),
    ("dask_train_val_loss", "val_loss", "Validation loss"),
    ("dask_train_val_accuracy", "val_accuracy", "Validation accuracy"),
    # Regression's figures (workers/losses.py), for a job whose loss is mse or l1.
    ("dask_train_mse", "mse", "Training mean squared error (all ranks)"),
    ("dask_train_mae", "mae", "Training mean absolute error (all ranks)"),
    ("dask_train_r2", "r2", "Training coefficient of determination R^2 (all ranks)"),
    ("dask_train_val_mse", "val_mse", "Validation mean squared error"),
    ("dask_train_val_mae", "val_mae", "Validation mean absolute error"),
    ("dask_train_val_r2", "val_r2", "Validation coefficient of determination R^2"),
    ("dask_train_samples_per_second", "samples_per_s", "Training samples per second, all ranks"),
    ("dask_train_learning_rate", "lr", "Current learning rate"),
    ("dask_train_world_size", "world_size", "Ranks in the job"),
    (
        "dask_train_job_world_size",
        "world_size",
        "Ranks the job runs on now; changes as an elastic job resizes",
    ),
    ("dask_train_job_resizes", "resizes", "Resizes of the job so far (an elastic job's)"),
    ("dask_train_recoveries", "recoveries", "Restarts from a checkpoint after a failure"),
)
# One gauge per rank, from each rank's last heartbeat: (metric, the job state's field, help).
RANK_GAUGES = (
    (
        "dask_train_rank_samples_per_second",
        "ranks",
        "Training samples per second of one rank (its last heartbeat)",
    ),
    (
        "dask_train_rank_peak_memory_bytes",
        "memory",
        "Peak memory of one rank since it started (its last heartbeat): CUDA's allocator "
        "peak on a GPU, the growth of the process's peak resident set on a CPU",
    ),
)


def sweep_topic(study_name: str) -> str:
    """The Dask event topic of a sweep's trials (a job's are its ``JobSpec``'s)."""
    return SWEEP_PREFIX + study_name


def read_topic(topic: str) -> tuple[Topic, str] | None:
    """The kind of one of our topics and whose it is (a job's id, a study's name), or None for
    anyone else's topic. No prefix begins another: at most one matches."""
    for kind, prefix in TOPIC_PREFIXES.items():
        if topic.startswith(prefix):
            return kind, topic.removeprefix(prefix)
    return None


class TrainingMetrics(SchedulerPlugin):
    """Keeps the latest record of each job (an event topic) and exports it to Prometheus.

    Every event on our topics is read as a typed record (``workers/records.py``); one of no
    known shape, or on the wrong kind of topic, is logged (a warning once per topic and kind)
    and skipped: a client of another version must not break the scheduler's page.
    """

    name = PLUGIN_NAME
    idempotent = True  # registering again (the next job) keeps the one already running

    def __init__(self) -> None:
        self.jobs: dict[str, dict[str, Any]] = {}
        self.sweeps: dict[str, dict[int, dict[str, Any]]] = {}  # study -> trial number -> record
        self._lock = threading.Lock()
        # The last (topic, kind) pairs warned about, oldest first: one warning each.
        self._refused: dict[tuple[str, str], None] = {}

    def __getstate__(self) -> dict[str, Any]:
        # The plugin travels to the scheduler pickled, and locks do not: it gets a new one.
        state = self.__dict__.copy()
        del state["_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    async def start(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        _exporter.add(self)
        # The Training page, on the scheduler's web server next to the dashboard's pages.
        application = getattr(scheduler, "http_application", None)
        if application is not None:
            # Under the dashboard's navigation bar, which then lists the page too.
            page = {"snapshot": self.page, "navigation": dashboard_page_template(scheduler)}
            application.add_handlers(".*$", [(ROUTE, TrainingPage, page)])
            add_to_navigation(scheduler)

    async def close(self) -> None:
        _exporter.discard(self)

    def log_event(self, topic: str, msg: Any) -> None:
        where = read_topic(topic) if isinstance(topic, str) else None
        if where is None:
            return  # the scheduler's own topics, and other libraries'
        kind_of_topic, owner = where
        try:
            record = parse_record(msg)
        except MalformedRecord as error:
            self._refuse(topic, msg, str(error))
            return
        if kind_of_topic != record.TOPIC:
            self._refuse(topic, msg, f"a {record.kind!r} record belongs on a {record.TOPIC} topic")
            return
        if isinstance(record, TrialRecord):
            self._record_trial(owner, record)
        elif isinstance(record, QueuedRecord | AdmittedRecord):
            return  # the page and /metrics show the queue itself (workflows/jobs/admission.py)
        else:
            self._record_job(owner, record)

    def _refuse(self, topic: str, msg: Any, why: str) -> None:
        """Log a refused event: a warning the first time a topic has one of its kind, then
        quietly (a client of another version would refuse every step)."""
        kind = str(msg.get("kind")) if isinstance(msg, dict) else type(msg).__name__
        with self._lock:
            first = (topic, kind) not in self._refused
            self._refused[topic, kind] = None
            if len(self._refused) > KEEP_JOBS:
                del self._refused[next(iter(self._refused))]
        level = logging.WARNING if first else logging.DEBUG
        logger.log(level, "event on %s skipped: %s", topic, why)

    def _record_job(self, job: str, record: BaseRecord) -> None:
        with self._lock:
            if job not in self.jobs and len(self.jobs) >= KEEP_JOBS:
                del self.jobs[next(iter(self.jobs))]  # the oldest job's series go
            state = self.jobs.setdefault(job, {})
            state["last_seen"] = time.time()  # where the page's world-size line ends
            match record:
                case HeartbeatRecord():
                    if record.samples_per_s is not None:
                        state.setdefault("ranks", {})[record.rank] = record.samples_per_s
                    if record.peak_memory_bytes is not None:
                        state.setdefault("memory", {})[record.rank] = record.peak_memory_bytes
                case ReportRecord():
                    # A rank function's own metrics (ctx.report): rank 0's make the page's
                    # curves; the gauges keep the job's strategy and world size, not a rank's.
                    if record.rank == 0:
                        reports = state.setdefault("reports", [])
                        reports.append(_numbers(record.to_event()))
                        del reports[:-KEEP_EPOCHS]
                    metrics = _numbers(record.metrics)
                    state.update({k: v for k, v in metrics.items() if k not in _KEPT})
                    state.setdefault("strategy", "launch")
                case WorldRecord() | ResizedRecord():
                    _record_world(state, record)
                case StartRecord():
                    fields = _scalars(record)
                    # A point of the controller's ("world", "resized") came first.
                    if any(point["kind"] != record.kind for point in state.get("world", [])):
                        del fields["world_size"]  # the controller's records say it, in order
                    else:
                        _record_world(state, record)
                    state.update(fields)
                case EpochRecord():
                    state.update(_scalars(record))
                    history = state.setdefault("history", [])
                    if not any(r.get("epoch") == record.epoch for r in history):
                        history.append(record.to_event())
                    del history[:-KEEP_EPOCHS]
                case OutputRecord():
                    pass  # a script's lines are the client's to show
                case _:
                    # Steps, recoveries, failed checkpoints, a kind added later: their figures
                    # are the job's latest (GAUGES names those /metrics exports).
                    state.update(_scalars(record))

    def _record_trial(self, sweep: str, record: TrialRecord) -> None:
        with self._lock:
            if sweep not in self.sweeps and len(self.sweeps) >= KEEP_JOBS:
                del self.sweeps[next(iter(self.sweeps))]
            self.sweeps.setdefault(sweep, {})[record.number] = record.to_event()

    def queue(self) -> dict[str, list[dict[str, Any]]]:
        """The jobs holding workers and those waiting for them, on this scheduler."""
        return queue_snapshot(self.scheduler)

    def page(self) -> dict[str, Any]:
        """What the Training page shows: the jobs, the queue and the sweeps' trials."""
        with self._lock:
            sweeps = {name: dict(trials) for name, trials in self.sweeps.items()}
        return {"jobs": self.snapshot(), "queue": self.queue(), "sweeps": sweeps}

    def snapshot(self) -> dict[str, dict[str, Any]]:
        with self._lock:
            return {
                job: {
                    **state,
                    "ranks": dict(state.get("ranks", {})),
                    "memory": dict(state.get("memory", {})),
                    "history": list(state.get("history", [])),
                    "reports": list(state.get("reports", [])),
                    "world": list(state.get("world", [])),
                }
                for job, state in self.jobs.items()
            }


# What a job's state keeps beside its latest figures: a rank's metric of the same name
# (ctx.report(world=ctx.world_size)) replaced the world-size series, and /metrics failed for
# every job on the scheduler.
_KEPT = frozenset({"ranks", "memory", "history", "reports", "world", "last_seen"})


def _numbers(fields: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in fields.items() if isinstance(v, int | float)}


def _scalars(record: BaseRecord) -> dict[str, Any]:
    """A record's numbers and strings by name: what the page's facts and the gauges read (not
    its kind, nor the worker Dask adds to a rank's)."""
    event = record.to_event()
    return {
        k: v
        for k, v in event.items()
        if k not in ("kind", "worker") and isinstance(v, int | float | str)
    }


def _record_world(state: dict[str, Any], record: WorldRecord | ResizedRecord | StartRecord) -> None:
    """A job's world size from a "world", "resized" or "start" record: the gauges' value now
    and a point of the page's world-size line (the record's time, else its arrival's), marked
    by its cause ("formed" for a group's first)."""
    resized = isinstance(record, ResizedRecord)
    at = None if isinstance(record, StartRecord) else record.at
    point: dict[str, Any] = {
        "kind": record.kind,
        "at": at if at is not None else time.time(),
        "world_size": record.after if resized else record.world_size,
        "cause": record.cause if resized else "formed",
    }
    if resized:
        optional = {"step": record.step, "pause_s": record.pause_s}
        optional["redone_steps"] = record.redone_steps
        point["from"] = record.before
        point.update({k: v for k, v in optional.items() if v is not None})
        state["resizes"] = state.get("resizes", 0) + 1
    state.setdefault("resizes", 0)
    world = state.setdefault("world", [])
    world.append(point)
    world.sort(key=lambda p: p["at"])  # the client's and the ranks' records may cross
    del world[:-KEEP_EPOCHS]
    state["world_size"] = world[-1]["world_size"]


class _Exporter:
    """The one Prometheus collector of this process.

    prometheus_client's registry is global, and one process may hold several schedulers (two
    LocalClusters in a notebook, a test session): each scheduler's plugin joins this exporter,
    which registers once and reports the jobs of all of them (job names are unique).
    """

    def __init__(self) -> None:
        self._plugins: weakref.WeakSet[TrainingMetrics] = weakref.WeakSet()
        self._registered = False

    def add(self, plugin: TrainingMetrics) -> None:
        self._plugins.add(plugin)
        if not self._registered:
            try:
                from prometheus_client import REGISTRY
            except ImportError:  # the dashboard then simply has no training gauges
                return
            REGISTRY.register(self)
            self._registered = True

    def discard(self, plugin: TrainingMetrics) -> None:
        self._plugins.discard(plugin)

    def collect(self):  # the prometheus_client Collector protocol
        from prometheus_client.core import GaugeMetricFamily

        jobs: dict[str, dict[str, Any]] = {}
        queued = held = 0
        for plugin in list(self._plugins):
            jobs.update(plugin.snapshot())
            queue = plugin.queue()
            queued += len(queue["queued"])
            held += sum(job["workers"] for job in queue["holding"])
        yield GaugeMetricFamily(
            "dask_train_queued_jobs", "Jobs waiting in the queue for workers", value=queued
        )
        yield GaugeMetricFamily(
            "dask_train_held_workers", "Workers held by running jobs", value=held
        )
        for metric, field, help_text in GAUGES:
            family = GaugeMetricFamily(metric, help_text, labels=["job", "strategy"])
            for job, state in jobs.items():
                if isinstance(state.get(field), int | float):
                    family.add_metric([job, str(state.get("strategy", ""))], float(state[field]))
            yield family
        for metric, field, help_text in RANK_GAUGES:
            family = GaugeMetricFamily(metric, help_text, labels=["job", "strategy", "rank"])
            for job, state in jobs.items():
                for rank, value in sorted(state[field].items()):
                    family.add_metric([job, str(state.get("strategy", "")), str(rank)], value)
            yield family


_exporter = _Exporter()


# The name the job queue's scheduler plugin (workflows/jobs/admission.py) registers under: the
# page reads the queue from it, without importing the job machinery that sits above this.
QUEUE_PLUGIN_NAME = "dask-train-queue"


def queue_snapshot(dask_scheduler: Scheduler) -> dict[str, list[dict[str, Any]]]:
    """The jobs holding workers and those waiting (run on the scheduler)."""
    queue = dask_scheduler.plugins.get(QUEUE_PLUGIN_NAME)
    if queue is None:
        return {"holding": [], "queued": []}
    return {"holding": queue.holders(), "queued": queue.queued()}


def keep_training_metrics(client: Any) -> None:
    """Make ``client``'s scheduler keep the latest figures of every job, for ``/metrics`` and
    the Training page; a scheduler that keeps them already goes on as it was."""
    client.register_plugin(TrainingMetrics(), name=TrainingMetrics.name)


def serve_training_page(client: Any) -> str | None:
    """Serve the Training page on ``client``'s scheduler from now on (otherwise the first
    training job does) and return its URL, or None when the scheduler has no dashboard."""
    keep_training_metrics(client)
    link = client.dashboard_link
    return training_page_url(link) if link else None
