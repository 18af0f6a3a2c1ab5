"""Train from a client: config → cluster → process group → rank loops → result.

>>> from workflows import train
>>> result = train("workflows/configs/digits_ddp.toml")
"""

import contextlib
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from distributed import Client
from distributed.scheduler import KilledWorker

from workers.checkpoint import latest_good_checkpoint
from workers.train import STAGED, RankResult, TrainJob, run_rank
from workflows.cluster import TrainingCluster, live_workers, start_cluster
from workflows.config import ConfigError, RunConfig, load_config
from workflows.launcher import (
    GroupFormationError,
    Heartbeats,
    LaunchError,
    ProcessGroup,
    RankFailed,
    RankHung,
    select_workers,
)
from workflows.monitoring import EVENT_PREFIX, HEARTBEAT_PREFIX, TrainingMetrics
from workflows.planner import resolve_split_points
from workflows.preprocess import StoreManifest, prepare_store
from workflows.tracking import Tracker

logger = logging.getLogger(__name__)
EventHandler = Callable[[dict[str, Any]], None]


@dataclass
class TrainResult:
    """What a finished job hands back to the client."""

    name: str
    strategy: str
    world_size: int
    history: list[dict[str, float]]
    samples_per_s: float
    steady_samples_per_s: float
    wall_s: float
    first_step_s: float
    store: StoreManifest
    state_dict: dict[str, torch.Tensor] = field(repr=False)
    split_points: tuple[str, ...] | None = None  # where staged strategies cut the model
    recoveries: list[dict[str, Any]] = field(default_factory=list)  # one per restart

    @property
    def final(self) -> dict[str, float]:
        return self.history[-1]


class TrainingFailed(RuntimeError):
    """The run failed more often than ``launch.max_failures`` allows."""


@dataclass
class Recovery:
    """One restart: what failed, and the checkpoint the next attempt continued from."""

    failure: str
    detected_at: float
    resumed_from_step: int
    redo_s: float  # training since that checkpoint, done again
    restart_s: float | None = None  # from detection to the resumed run's first step

    def finish(self, *, first_step_at: float) -> None:
        self.restart_s = max(0.0, first_step_at - self.detected_at)

    def describe(self) -> str:
        return f"{self.failure}; resuming from step {self.resumed_from_step}"

    def summary(self) -> dict[str, Any]:
        return {
            "failure": self.failure,
            "detected_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.detected_at)),
            "detected_at_s": self.detected_at,
            "resumed_from_step": self.resumed_from_step,
            "seconds_lost": self.redo_s + (self.restart_s or 0.0),
        }


@dataclass
class Failure:
    message: str
    detected_at: float
    attempt_started_at: float

    def recovered_at(self, resume: tuple[Path, dict[str, Any]] | None) -> Recovery:
        saved_at = resume[1]["written_at"] if resume else self.attempt_started_at
        return Recovery(
            failure=self.message,
            detected_at=self.detected_at,
            resumed_from_step=resume[1]["step"] if resume else 0,
            redo_s=max(0.0, self.detected_at - max(saved_at, self.attempt_started_at)),
        )


def _recoverable(error: Exception) -> bool:
    """Worker loss, hangs, rendezvous and communication failures are worth a restart; a rank
    that raised a plain bug (a ValueError, a damaged checkpoint) would only fail again."""
    if isinstance(error, GroupFormationError | RankHung) or error.__cause__ is None:
        return True
    return isinstance(error.__cause__, RuntimeError | OSError | TimeoutError | KilledWorker)


def print_progress(record: dict[str, Any]) -> None:
    """The seed article's epoch line, plus validation and throughput."""
    if record.get("kind") == "epoch":
        print(format_epoch(record), flush=True)


def format_epoch(r: dict[str, Any]) -> str:
    return (
        f"Epoch [{r['epoch']}/{r['epochs']}], Loss: {r['loss']:.4f}, Acc: {r['accuracy']:.4f}, "
        f"Val Loss: {r['val_loss']:.4f}, Val Acc: {r['val_accuracy']:.4f}, "
        f"{r['samples_per_s']:.0f} samples/s"
    )


def train(
    config: RunConfig | str | Path | dict[str, Any],
    *,
    cluster: TrainingCluster | Client | None = None,
    on_event: EventHandler | None = print_progress,
    tracker: Tracker | None = None,
) -> TrainResult:
    """Train ``config`` on ``cluster`` (or on a local cluster started and closed here).

    ``on_event`` receives each rank-0 metrics record (epoch ends, and steps when
    ``training.log_every_steps`` is set) while the job runs. The records also go to
    ``tracker``, or, without one, to the TensorBoard folder and MLflow run that
    ``config.tracking`` names (opened and finished here).
    """
    if not isinstance(config, RunConfig):
        config = load_config(config)
    owned_tracker = tracker is None and config.tracking.enabled
    if owned_tracker:
        tracker = Tracker.open(config.tracking, config.model_dump(mode="json"))
    handler = on_event if tracker is None else tracker.wrap(on_event)
    with tracker.closing() if owned_tracker else contextlib.nullcontext():
        owned = cluster is None
        if cluster is None:
            cluster = start_cluster(config.cluster)
        client = cluster.client if isinstance(cluster, TrainingCluster) else cluster
        try:
            result = _train_on(client, config, handler)
        finally:
            if owned:
                cluster.close()
        if owned_tracker:
            tracker.finish_result(result)
        return result


def _train_on(client: Client, config: RunConfig, on_event: EventHandler | None) -> TrainResult:
    # Resolve the world size before anything starts, so a batch that does not split is a
    # config error rather than a failed job.
    world_size = config.world_size or max(
        1, len(select_workers(live_workers(client), config.launch.workers))
    )
    config.check_batch(world_size)
    # Preprocess on the same cluster first, unless a complete store for these inputs exists.
    data = config.data.resolved()
    manifest = prepare_store(client, data, seed=config.training.seed)
    pipeline = None
    if config.training.strategy in STAGED:
        # Cut once on the client, so every rank holds the same stages.
        points = resolve_split_points(
            client, config, world_size=world_size, num_classes=manifest.num_classes
        )
        pipeline = config.pipeline.model_copy(update={"split_points": points})
    launch = config.launch.model_copy(update={"world_size": world_size})
    # The scheduler keeps the latest figures of every job for the dashboard's /metrics.
    client.register_plugin(TrainingMetrics(), name=TrainingMetrics.name)
    topic = f"{EVENT_PREFIX}{config.name}-{uuid.uuid4().hex[:8]}"
    events = _EventRelay(client, topic, on_event)
    # Workers may run elsewhere: they get the checkpoint folder as an absolute path.
    checkpoints = config.checkpoint.directory
    if checkpoints:
        checkpoints = str(Path(checkpoints).absolute())
    checkpointing = config.checkpoint.model_copy(update={"directory": checkpoints})
    submitted_at = time.time()
    started = time.perf_counter()
    recoveries: list[Recovery] = []
    failure: Failure | None = None
    with events:
        # One attempt per process-group generation: a failed attempt's ranks are restarted,
        # and the next one continues from the newest good checkpoint.
        while True:
            resume = None
            if checkpoints and config.checkpoint.resume == "auto":
                resume = latest_good_checkpoint(checkpoints)
            if resume:
                # Epochs the checkpoint already holds were delivered by the run that wrote it.
                events.skip(resume[1]["history"])
            if failure is not None:
                recoveries.append(failure.recovered_at(resume))
                logger.warning("recovery %d: %s", len(recoveries), recoveries[-1].describe())
                # The dashboard counts them; on_event handlers see a "recovery" record.
                client.log_event(
                    topic,
                    {"kind": "recovery", "recoveries": len(recoveries), **recoveries[-1].summary()},
                )
            attempt_started = time.time()
            heartbeats = Heartbeats()
            heartbeat_topic = HEARTBEAT_PREFIX + topic.removeprefix(EVENT_PREFIX)
            client.subscribe_topic(heartbeat_topic, heartbeats.record)
            try:
                with ProcessGroup(client, launch) as group:
                    assert group.spec is not None
                    job = TrainJob(
                        data=data,
                        model=config.model,
                        training=config.training,
                        generation=group.spec.generation,
                        event_topic=events.topic,
                        pipeline=pipeline,
                        checkpoint=checkpointing if checkpoints else None,
                        resume_from=str(resume[0]) if resume else None,
                        heartbeat_topic=heartbeat_topic,
                    )
                    results: list[RankResult] = group.run(
                        run_rank, job, name=f"train-{config.name}", heartbeats=heartbeats
                    )
                break
            except LaunchError as error:
                if failure is None:
                    raise  # the cluster cannot hold this run: a configuration error
                # After a failure: the lost worker did not come back in time.
                raise TrainingFailed(
                    f"{failure.message}; no replacement worker arrived: {error}"
                ) from error
            except (RankFailed, GroupFormationError) as error:
                if not _recoverable(error):
                    raise
                detected_at = getattr(error, "detected_at", time.time())
                failure = Failure(str(error), detected_at, attempt_started)
                if len(recoveries) >= launch.max_failures:
                    raise TrainingFailed(
                        f"{error} (at {time.strftime('%H:%M:%S')}); giving up after "
                        f"{len(recoveries)} recoveries (launch.max_failures = "
                        f"{launch.max_failures})"
                    ) from error
                logger.warning("attempt failed, restarting from the last checkpoint: %s", error)
            finally:
                client.unsubscribe_topic(heartbeat_topic)
    wall_s = time.perf_counter() - started
    if recoveries:
        # The work lost includes the restart: until the resumed run's first step.
        recoveries[-1].finish(first_step_at=min(r.first_step_at for r in results))
    rank0 = results[0]
    events.deliver_missed(rank0.history)
    # Staged strategies hand back one stage per rank; together they are the whole model.
    state_dict: dict[str, torch.Tensor] = {}
    for result in results:
        state_dict.update(result.state_dict or {})
    return TrainResult(
        name=config.name,
        strategy=config.training.strategy,
        world_size=len(results),
        history=rank0.history,
        samples_per_s=rank0.samples_per_s,
        steady_samples_per_s=rank0.steady_samples_per_s,
        wall_s=wall_s,
        first_step_s=rank0.first_step_at - submitted_at,
        store=manifest,
        state_dict=state_dict,
        recoveries=[r.summary() for r in recoveries],
        split_points=None if pipeline is None else pipeline.split_points,
    )


class _EventRelay:
    """Forwards rank 0's Dask events to ``on_event`` while the job runs.

    Dask calls topic handlers on the client's event loop, which a LocalCluster's scheduler
    shares: a handler that blocks (a print to a slow pipe, a request to the dashboard) would
    stall the cluster. So records are handed to ``on_event`` from a thread of their own, in
    order. Events travel asynchronously and the last ones may still be in flight when the job
    returns; ``deliver_missed`` hands over the epoch records among them from the result, so each
    epoch record arrives exactly once.
    """

    _STOP = object()

    def __init__(self, client: Client, topic: str, on_event: EventHandler | None) -> None:
        self.client, self.topic, self.on_event = client, topic, on_event
        self._seen: set[tuple[Any, ...]] = set()
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._pump, name="dask-train-events", daemon=True)

    def _handle(self, event: tuple[float, dict[str, Any]]) -> None:
        self._queue.put(event[1])

    def _pump(self) -> None:
        while (record := self._queue.get()) is not self._STOP:
            self._deliver(record)

    def _deliver(self, record: dict[str, Any]) -> None:
        key = self._key(record)
        if key in self._seen:
            return
        self._seen.add(key)
        if self.on_event is not None:
            self.on_event(record)

    def skip(self, records: list[dict[str, Any]]) -> None:
        """Never deliver these records (a resumed run's earlier epochs)."""
        self._seen.update(self._key(record) for record in records)

    @staticmethod
    def _key(record: dict[str, Any]) -> tuple[Any, ...]:
        return (
            record.get("kind"),
            record.get("epoch"),
            record.get("step"),
            record.get("recoveries"),
        )

    def deliver_missed(self, records: list[dict[str, Any]]) -> None:
        """Call after leaving the context. If the handler is still busy after the bounded wait,
        the missed records are dropped rather than delivered concurrently."""
        if self._thread.is_alive():
            return
        for record in records:
            self._deliver(record)

    def __enter__(self) -> "_EventRelay":
        if self.on_event is not None:
            self._thread.start()
            self.client.subscribe_topic(self.topic, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.on_event is not None:
            self.client.unsubscribe_topic(self.topic)
            self._queue.put(self._STOP)
            self._thread.join(timeout=60)


__all__ = ["ConfigError", "TrainResult", "format_epoch", "print_progress", "train"]
