"""Training metrics on the scheduler: a SchedulerPlugin that listens to the ranks' Dask events
and serves the latest figures of every job as Prometheus gauges at the dashboard's ``/metrics``.
"""

import threading
import time
import weakref
from typing import Any

from distributed import Scheduler, SchedulerPlugin

from workers.compat.distributed_private import dashboard_page_template
from workflows.dashboard import (
    ROUTE,
    TrainingPage,
    add_to_navigation,
    training_page_url,
)
from workflows.events import REPORT_BOOKKEEPING

# Three kinds of topics, under prefixes none of which begins another: a name the user gives (a
# job's, a study's) cannot carry its topic into another kind (a job named "sweep-a" was read as
# a sweep's trials, one named "heartbeat-a" as heartbeats).
TOPIC_ROOT = "dask-train-"
# Job J's records (reports, epochs, resizes) travel on EVENT_PREFIX + J.
EVENT_PREFIX = TOPIC_ROOT + "job-"
# Each rank's heartbeat (step, samples/s) for job J travels on HEARTBEAT_PREFIX + J.
HEARTBEAT_PREFIX = TOPIC_ROOT + "heartbeat-"
# A sweep's trials (workflows/sweep.py) travel on SWEEP_PREFIX + the study's name.
SWEEP_PREFIX = TOPIC_ROOT + "sweep-"
# The client's records of a job's wait for workers: the queue itself (workflows/admission.py)
# is what the page and /metrics show, not these.
QUEUE_KINDS = frozenset({"queued", "admitted"})
# The records that say how many ranks a job runs on: the controller's when the job's first group
# forms ("world") and at each change of an elastic job ("resized"), and the built-in trainer's
# "start" (alone, before any controller's, for a job that sends none).
WORLD_KINDS = frozenset({"world", "resized"})
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


class TrainingMetrics(SchedulerPlugin):
    """Keeps the latest record of each job (an event topic) and exports it to Prometheus."""

    name = PLUGIN_NAME
    idempotent = True  # registering again (the next job) keeps the one already running

    def __init__(self) -> None:
        self.jobs: dict[str, dict[str, Any]] = {}
        self.sweeps: dict[str, dict[int, dict[str, Any]]] = {}  # study -> trial number -> record

    async def start(self, scheduler: Scheduler) -> None:
        # Created here, in the scheduler: the plugin travels there pickled, and locks do not.
        self._lock = threading.Lock()
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
        if not isinstance(msg, dict):
            return
        if topic.startswith(SWEEP_PREFIX):
            self._record_trial(topic.removeprefix(SWEEP_PREFIX), msg)
            return
        heartbeat = topic.startswith(HEARTBEAT_PREFIX)
        if not (heartbeat or topic.startswith(EVENT_PREFIX)) or msg.get("kind") in QUEUE_KINDS:
            return
        job = topic.removeprefix(HEARTBEAT_PREFIX if heartbeat else EVENT_PREFIX)
        with self._lock:
            if job not in self.jobs and len(self.jobs) >= KEEP_JOBS:
                del self.jobs[next(iter(self.jobs))]  # the oldest job's series go
            state = self.jobs.setdefault(job, {})
            state["last_seen"] = time.time()  # where the page's world-size line ends
            if heartbeat:
                if isinstance(msg.get("samples_per_s"), int | float):
                    ranks = state.setdefault("ranks", {})
                    ranks[int(msg["rank"])] = float(msg["samples_per_s"])
                if isinstance(msg.get("peak_memory_bytes"), int):
                    state.setdefault("memory", {})[int(msg["rank"])] = msg["peak_memory_bytes"]
                return
            if msg.get("kind") == "report":
                # A rank function's own metrics (ctx.report): rank 0's make the page's curves;
                # the gauges keep the job's strategy and world size, not a rank's fields.
                if msg.get("rank") == 0:
                    reports = state.setdefault("reports", [])
                    reports.append({k: v for k, v in msg.items() if isinstance(v, int | float)})
                    del reports[:-KEEP_EPOCHS]
                fields = {k: v for k, v in msg.items() if k not in REPORT_BOOKKEEPING}
                state.update({k: v for k, v in fields.items() if isinstance(v, int | float)})
                state.setdefault("strategy", "launch")
                return
            if msg.get("kind") in WORLD_KINDS:
                _record_world(state, msg)
                return
            fields = {k: v for k, v in msg.items() if isinstance(v, int | float | str)}
            if msg.get("kind") == "start" and isinstance(msg.get("world_size"), int):
                if any(point["kind"] in WORLD_KINDS for point in state.get("world", [])):
                    del fields["world_size"]  # the controller's records say it, in order
                else:
                    _record_world(state, msg)
            state.update(fields)
            if msg.get("kind") == "epoch":
                history = state.setdefault("history", [])
                if not any(r.get("epoch") == msg.get("epoch") for r in history):
                    history.append(dict(msg))
                del history[:-KEEP_EPOCHS]

    def _record_trial(self, sweep: str, msg: dict[str, Any]) -> None:
        if not isinstance(msg.get("number"), int):
            return
        with self._lock:
            if sweep not in self.sweeps and len(self.sweeps) >= KEEP_JOBS:
                del self.sweeps[next(iter(self.sweeps))]
            self.sweeps.setdefault(sweep, {})[msg["number"]] = dict(msg)

    def queue(self) -> dict[str, list[dict[str, Any]]]:
        """The jobs holding workers and those waiting for them, on this scheduler."""
        from workflows.admission import queue_snapshot

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


def _record_world(state: dict[str, Any], msg: dict[str, Any]) -> None:
    """A job's world size from a "world", "resized" or "start" record: the gauges' value now
    and a point of the page's world-size line (the record's time, else its arrival's)."""
    kind = msg["kind"]
    size = msg.get("to") if kind == "resized" else msg.get("world_size")
    if not isinstance(size, int):
        return
    at = msg.get("at")
    point = {
        "kind": kind,
        "at": float(at) if isinstance(at, int | float) else time.time(),
        "world_size": size,
    }
    if kind == "resized":
        fields = ("from", "step", "cause", "pause_s", "redone_steps")
        point.update({k: msg[k] for k in fields if isinstance(msg.get(k), int | float | str)})
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
