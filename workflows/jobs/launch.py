"""Jobs of your own training function on every rank: ``launch(fn, *args, **kwargs)``.

>>> from workflows import launch
>>> def loop(ctx, lr):
...     ...  # torch.distributed is initialized: build, wrap in DDP, train, ctx.report(loss=...)
...     return ctx.rank
>>> result = launch(loop, 0.1, world_size=2)
>>> result.results
[0, 1]

One call is a sequence of generations (``workflows/jobs/controller.py``). Each forms a fresh
process group over the job's workers and runs ``fn(ctx, *args, **kwargs)`` once per rank. When
a worker is lost, killed or hangs, the ranks let go of the group and the next generation
continues from a surviving replica's state or the newest complete checkpoint
(``ctx.restore``); an elastic job's world also changes between two generations, at a step
boundary. An exception raised by ``fn`` itself is raised here at once, never retried. The
built-in trainer (``workflows.train``) runs on this same path.
"""

import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from distributed import Client
from pydantic import ValidationError

from workers.collection_shard import CollectionPlan
from workers.records import BaseRecord, QueuedRecord
from workers.spec.errors import ConfigError, one_line
from workers.spec.launch import LaunchConfig
from workers.spec.tracking import TrackingConfig
from workflows.cluster.training_cluster import TrainingCluster, start_cluster
from workflows.jobs.collections import check_fixed_world, prepared_data
from workflows.jobs.controller import Finished, JobController, TrainingFailed
from workflows.jobs.failure_policy import FailurePolicy
from workflows.jobs.interrupts import DroppedInterrupts
from workflows.jobs.launcher import admit, hold_workers
from workflows.jobs.request import JobRequest
from workflows.jobs.scaling_policy import scaling_policy
from workflows.jobs.spec import JobSpec
from workflows.observe.events import EventHandler, EventRelay
from workflows.observe.monitoring import keep_training_metrics
from workflows.observe.tracking import Tracker

logger = logging.getLogger(__name__)
__all__ = ["JobHold", "LaunchResult", "TrainingFailed", "launch", "launch_on"]


@dataclass
class LaunchResult:
    """What one ``launch`` hands back: every rank's return value and reports.

    Attributes:
        name: The job's name.
        world_size: The number of ranks.
        results: Each rank's return value, in rank order.
        metrics: Each rank's ``ctx.report`` records, every attempt's, in order.
        recoveries: One dict per restart: the failure, what it continued from
            (``recovered_from``: ``"replica"``, ``"checkpoint"``, ``"start"``), the step
            resumed from, the seconds lost (``redo_s``, ``restart_s``, ``seconds_lost``).
        wall_s: From the call to the last rank's return.
        first_step_s: From the call to the first report or heartbeat of any rank.
        attempts: 1, plus one per restart or resize (each is a generation of the group).
        job_id: The job's label on ``/metrics`` and the Training page: ``<name>-<8 hex>``.
        resizes: One dict per change of an elastic job's world (``resized`` records):
            ``from``, ``to``, ``step``, ``cause`` (``joined``, ``yielded``, ``retired``,
            ``lost``), ``pause_s`` (the last step before to the first step after) and
            ``redone_steps``.
    """

    name: str
    world_size: int
    results: list[Any]  # each rank's return value, in rank order
    metrics: list[list[dict[str, Any]]]  # each rank's ctx.report records, every attempt's
    recoveries: list[dict[str, Any]]  # one per restart: what failed, the step resumed from
    wall_s: float  # from the call to the last rank's return
    first_step_s: float  # from the call to the first report or heartbeat of any rank
    attempts: int = 1
    job_id: str = ""  # the job's label on /metrics and the Training page: <name>-<8 hex>
    resizes: list[dict[str, Any]] = field(default_factory=list)  # an elastic job's changes


def launch(
    fn: Callable[..., Any],
    *args: Any,
    cluster: TrainingCluster | Client | None = None,
    world_size: int | None = None,
    name: str | None = None,
    checkpoint_dir: str | Path | None = None,
    keep_checkpoints: int = 3,
    storage_options: dict[str, Any] | None = None,
    on_event: EventHandler | None = None,
    config: LaunchConfig | dict[str, Any] | None = None,
    max_failures: int | None = None,
    backend: str | None = None,
    workers: dict[str, Any] | None = None,
    hang_timeout_s: float | None = None,
    first_step_timeout_s: float | None = None,
    tracking: TrackingConfig | dict[str, Any] | None = None,
    data: Mapping[str, tuple[Any, Any]] | None = None,
    stop: threading.Event | None = None,
    **kwargs: Any,
) -> LaunchResult:
    """Call ``fn(ctx, *args, **kwargs)`` on every rank, the process group already formed.

    Args:
        fn: The rank function. Its first argument is the rank's `RankContext`; defined in a
            script or a notebook it travels by value, from a module the workers lack the
            module is uploaded to them.
        *args: Passed to ``fn`` after ``ctx``.
        cluster: A `TrainingCluster` or a Dask ``Client``; ``None`` starts a local cluster
            and closes it afterwards.
        world_size: How many ranks: an int, or ``(min, max)`` (``"min:max"``) for an elastic
            job, whose world grows and shrinks between them at ``ctx.step_done`` (see
            the Elastic jobs guide); default every eligible worker.
        name: The job's name (task keys, the Training page); default ``fn``'s name.
        checkpoint_dir: Where ``ctx.save`` writes and ``ctx.restore`` reads: a folder every
            worker reaches, or an fsspec URL (``s3://bucket/ckpt``).
        keep_checkpoints: The newest checkpoints kept.
        storage_options: ``checkpoint_dir``'s fsspec options (an endpoint, credentials);
            default: what fsspec finds in the environment.
        on_event: Called with every record the ranks send (``ctx.report``, recoveries), in
            order, on a thread of its own: each a plain dict with a ``"kind"`` (the fields of
            each kind: ``workers/records.py``; ``parse_record`` makes it typed).
        config: A `LaunchConfig` or a dict of its fields (the ``[launch]`` keys).
        max_failures: Overrides ``config.max_failures``: restarts before `TrainingFailed`.
        backend: Overrides ``config.backend`` (``"gloo"``, ``"nccl"``, ``"auto"``).
        workers: Overrides ``config.workers``, e.g. ``{"resources": {"GPU": 1}}``.
        hang_timeout_s: Overrides ``config.hang_timeout_s``.
        first_step_timeout_s: Overrides ``config.first_step_timeout_s``.
        tracking: A ``TrackingConfig`` or a dict of its fields: rank 0's reports also go to
            TensorBoard or MLflow.
        data: Split names (``"train"``, ``"val"``) to ``(X, y)`` Dask arrays or dataframes:
            persisted on the rank workers, assigned to ranks where they lie, read on a rank
            with ``ctx.shard(split, ...)``.
        stop: Setting this event ends the job: its ranks are stopped and `JobStopped` is
            raised.
        **kwargs: Passed to ``fn``.

    Returns:
        Every rank's return value and reports, the recoveries and the timings.

    Raises:
        TrainingFailed: More failures than ``max_failures`` allows, or a lost worker that
            never came back.
        LaunchError: The job cannot run as configured (too few workers, a backend the
            workers lack); the message names the field.
        JobStopped: ``stop`` was set.
        CodeNotShippable: ``fn`` needs a module that cannot be sent to the workers.
        ConfigError: A bad ``config``, ``tracking`` or setting keyword; the one-line message
            names the field.
        ValueError: A bad argument (``keep_checkpoints < 1``, a bad ``data`` collection).

    An exception raised by ``fn`` itself is raised here once, never retried, with the rank's
    traceback.

    Example:
        ```python
        def fn(ctx, scale):
            return ctx.rank * scale

        with start_cluster(n_workers=2) as cluster:
            print(launch(fn, 10, cluster=cluster).results)  # [0, 10]
        ```
    """
    request = JobRequest(
        fn=fn,
        settings=_settings(
            config,
            world_size=world_size,
            max_failures=max_failures,
            backend=backend,
            workers=workers,
            hang_timeout_s=hang_timeout_s,
            first_step_timeout_s=first_step_timeout_s,
        ),
        name=name or getattr(fn, "__name__", "launch"),
        args=args,
        kwargs=kwargs,
        checkpoint_dir=checkpoint_dir,
        keep_checkpoints=keep_checkpoints,
        storage_options=storage_options or {},
    )
    if data is not None:
        check_fixed_world(request.settings)
    tracker = _tracker(tracking, request)
    if tracker is not None:
        on_event = tracker.wrap(on_event)
    owned = cluster is None
    # A Ctrl-C that Python drops in a finalizer while this waits is raised again.
    with DroppedInterrupts(), tracker.closing() if tracker else contextlib.nullcontext():
        if cluster is None:
            cluster = start_cluster()
        client = cluster.client if isinstance(cluster, TrainingCluster) else cluster
        try:
            result = _launch_placed(client, request, data, on_event=on_event, stop=stop)
        finally:
            if owned:
                cluster.close()
        if tracker is not None:
            summary = {"world_size": result.world_size, "recoveries": result.recoveries}
            tracker.finish({"strategy": "launch", **summary})
        return result


def _launch_placed(
    client: Client,
    request: JobRequest,
    data: Mapping[str, tuple[Any, Any]] | None,
    *,
    on_event: EventHandler | None,
    stop: threading.Event | None,
) -> LaunchResult:
    """``launch_on``, ``data`` placed first where the ranks will run: the job holds its workers
    before its collections go to them."""
    hold = JobHold(client, request.settings, name=request.name, on_event=on_event, stop=stop)
    with (
        hold,
        prepared_data(client, data, hold.world_size, workers=hold.workers())
        if data is not None
        else contextlib.nullcontext() as prepared,
    ):
        plan = prepared.plan if prepared is not None else None
        return launch_on(client, request, on_event=on_event, data=plan, hold=hold)


def _settings(config: LaunchConfig | dict[str, Any] | None, **overrides: Any) -> LaunchConfig:
    """``config`` with the keywords given (not None) over it; a bad field is a one-line
    ConfigError naming it, as a config file's would be."""
    base = config.model_dump() if isinstance(config, LaunchConfig) else dict(config or {})
    try:
        return LaunchConfig.model_validate(
            base | {k: v for k, v in overrides.items() if v is not None}
        )
    except ValidationError as error:
        raise ConfigError(one_line(error)) from None


def _tracker(
    tracking: TrackingConfig | dict[str, Any] | None, request: JobRequest
) -> Tracker | None:
    """The TensorBoard or MLflow run rank 0's reports also go to, if ``tracking`` asks."""
    try:
        tracked = TrackingConfig.model_validate(tracking or {})
    except ValidationError as error:
        raise ConfigError(one_line(error)) from None
    if not tracked.enabled:
        return None
    run = {"name": request.name, "launch": request.settings.model_dump(mode="json")}
    return Tracker.open(tracked, run)


class JobHold:
    """A job's id and its place in the scheduler's queue, made before anything of the job
    runs. ``launch_on`` makes one; work that must know the job's workers first (placing its
    Dask collections where its ranks will run) makes it and calls ``workers()``."""

    def __init__(
        self,
        client: Client,
        settings: LaunchConfig,
        *,
        name: str,
        on_event: EventHandler | None = None,
        stop: threading.Event | None = None,
    ) -> None:
        self.client, self.settings, self.on_event, self.stop = client, settings, on_event, stop
        self.spec = JobSpec.mint(name)
        # Until launch_on's relay exists, a record goes to the topic and on_event directly.
        self.emit: Callable[[BaseRecord], None] = self._emit_directly
        self.admission = admit(
            client, settings, job_id=self.spec.job_id, name=name, on_queued=self._queued, stop=stop
        )

    @property
    def world_size(self) -> int:
        """A fixed job's number of ranks: its request to the queue decided it."""
        return self.admission.request.world_size

    def workers(self) -> list[str]:
        """The job's workers in rank order, waiting in the queue for them if need be."""
        return hold_workers(self.client, self.admission, self.settings.workers)

    def _queued(self, status: dict[str, Any]) -> None:
        # on_event handlers, the Training page and /metrics see the job waiting.
        queued = QueuedRecord(
            job_id=self.spec.job_id,
            position=status["position"],
            eligible=status["eligible"],
            holders=status["holders"],
        )
        self.emit(queued)

    def _emit_directly(self, record: BaseRecord) -> None:
        data = record.to_event()
        self.client.log_event(self.spec.event_topic, data)
        if self.on_event is not None:
            self.on_event(data)

    def __enter__(self) -> "JobHold":
        return self

    def __exit__(self, *exc: object) -> None:
        self.admission.release()


def launch_on(
    client: Client,
    request: JobRequest,
    *,
    on_event: EventHandler | None = None,
    data: CollectionPlan | None = None,
    stop: threading.Event | None = None,
    hold: JobHold | None = None,
) -> LaunchResult:
    """The generations of one job on a connected client (``launch``, ``train`` and
    ``dask-train launch`` use it): the job's `workflows.jobs.controller.JobController` runs them.

    ``data``: the job's Dask collections, placed on its workers. ``hold``: the job's place in
    the queue, when the caller took it first (``JobHold``; it was given ``stop`` then).
    """
    keep_training_metrics(client)
    hold = hold or JobHold(
        client, request.settings, name=request.name, on_event=on_event, stop=stop
    )
    events = EventRelay(client, hold.spec.event_topic, on_event)
    hold.emit = events.emit
    # The job's hold on its workers spans its generations: a recovering job keeps its place.
    with events, hold:
        controller = JobController(
            request,
            hold=hold,
            events=events,
            job=request.rank_job(hold.spec, data),
            failure_policy=FailurePolicy(
                request.settings.max_failures, retry_code_errors=request.retry_code_errors
            ),
            scaling_policy=scaling_policy(hold.admission.request),
        )
        finished = controller.run()
    return _launch_result(request, hold.spec, finished, events, ended_at=time.time())


def _launch_result(
    request: JobRequest, spec: JobSpec, finished: Finished, events: EventRelay, *, ended_at: float
) -> LaunchResult:
    """The job's result, once every record in flight reached ``on_event``."""
    if finished.resumed is not None and math.isnan(finished.first_step_at):
        # The ranks found the checkpoint at the end of their work: a run that had finished.
        logger.warning(
            "%s trained no step: it resumed at step %d from %s, where the run had already "
            "finished; give launch a new checkpoint folder to train again",
            request.name,
            finished.resumed.step,
            finished.resumed.checkpoint,
        )
    outcomes = finished.outcomes
    reports = [o.reports for o in outcomes]
    missed = [record for rank_reports in reports for record in rank_reports]
    if request.final_records is not None:
        missed = request.final_records([o.value for o in outcomes]) + missed
    events.deliver_missed(missed)
    earlier = events.reports_before(finished.attempts - 1, len(outcomes))
    return LaunchResult(
        name=request.name,
        world_size=len(outcomes),
        results=[o.value for o in outcomes],
        metrics=[before + now for before, now in zip(earlier, reports, strict=True)],
        recoveries=[r.summary() for r in finished.recoveries],
        wall_s=ended_at - request.called_at,
        first_step_s=finished.first_step_at - request.called_at,
        attempts=finished.attempts,
        job_id=spec.job_id,
        resizes=[r.record().to_event() for r in finished.resizes],
    )
