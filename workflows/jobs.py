"""Jobs of your own training function on every rank: ``launch(fn, *args, **kwargs)``.

>>> from workflows import launch
>>> def loop(ctx, lr):
...     ...  # torch.distributed is initialized: build, wrap in DDP, train, ctx.report(loss=...)
...     return ctx.rank
>>> result = launch(loop, 0.1, world_size=2)
>>> result.results
[0, 1]

One call is a sequence of attempts. Each attempt forms a fresh process-group generation over
the chosen workers and runs ``fn(ctx, *args, **kwargs)`` once per rank. When a worker is lost,
killed or hangs, the attempt's ranks let go of the group and the next attempt starts from the
newest complete checkpoint (``ctx.restore``); an exception raised by ``fn`` itself is raised
here at once, never retried. The built-in trainer (``workflows.train``) runs on this same path.
"""

import contextlib
import logging
import math
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import CodeType, TracebackType
from typing import Any

import cloudpickle
from distributed import Client
from pydantic import ValidationError

from workers import live_recovery
from workers.checkpoint import latest_good_checkpoint
from workers.collection_shard import CollectionPlan
from workers.live_recovery import LiveSource
from workers.rank_context import RankJob, RankOutcome, run_pickled
from workers.remote_traceback import rebuilt_traceback
from workflows.cluster import TrainingCluster, start_cluster
from workflows.code_shipping import ship_code
from workflows.collections import prepared_data
from workflows.config import ConfigError, one_line
from workflows.events import EventHandler, EventRelay
from workflows.failure_policy import Decision, FailurePolicy
from workflows.interrupts import DroppedInterrupts
from workflows.launcher import (
    GroupFormationError,
    Heartbeats,
    LaunchConfig,
    LaunchError,
    ProcessGroup,
    RankFailed,
    admit,
    hold_workers,
    run_bounded,
)
from workflows.monitoring import EVENT_PREFIX, HEARTBEAT_PREFIX, keep_training_metrics
from workflows.tracking import Tracker, TrackingConfig

logger = logging.getLogger(__name__)
DYNAMIC_CODE = "<dynamic-code>"  # cloudpickle's file name for code that travels by value


class TrainingFailed(RuntimeError):
    """The run failed more often than ``launch.max_failures`` allows, or the lost worker
    never came back."""


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
        attempts: 1, plus one per restart.
        outcomes: Each rank's outcome (return value and reports), in rank order.
        job_id: The job's label on ``/metrics`` and the Training page: ``<name>-<8 hex>``.
    """

    name: str
    world_size: int
    results: list[Any]  # each rank's return value, in rank order
    metrics: list[list[dict[str, Any]]]  # each rank's ctx.report records, every attempt's
    recoveries: list[dict[str, Any]]  # one per restart: what failed, the step resumed from
    wall_s: float  # from the call to the last rank's return
    first_step_s: float  # from the call to the first report or heartbeat of any rank
    attempts: int = 1
    outcomes: list[RankOutcome] = field(default_factory=list, repr=False)
    job_id: str = ""  # the job's label on /metrics and the Training page: <name>-<8 hex>


@dataclass
class Recovery:
    """One restart: what failed, and what the next attempt continued from: a surviving
    replica's kept state (``"replica"``), the newest checkpoint (``"checkpoint"``), or the
    beginning (``"start"``)."""

    failure: str
    detected_at: float
    resumed_from_step: int
    redo_s: float  # training since the state continued from, done again
    recovered_from: str = "checkpoint"
    restart_s: float | None = None  # from detection to the resumed attempt's first step

    def from_replica(self, source: LiveSource) -> None:
        self.recovered_from, self.resumed_from_step = "replica", source.step
        # Only the step in flight when the worker was lost is done again.
        self.redo_s = max(0.0, self.detected_at - source.done_at)

    def finish(self, *, first_step_at: float) -> None:
        self.restart_s = max(0.0, first_step_at - self.detected_at)

    def describe(self) -> str:
        if self.recovered_from == "replica":
            where = "a surviving replica's state"
        else:
            where = "the newest checkpoint" if self.recovered_from == "checkpoint" else "the start"
        return f"{self.failure}; resuming at step {self.resumed_from_step} from {where}"

    def summary(self) -> dict[str, Any]:
        return {
            "failure": self.failure,
            "detected_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.detected_at)),
            "detected_at_s": self.detected_at,
            "recovered_from": self.recovered_from,
            "resumed_from_step": self.resumed_from_step,
            "redo_s": self.redo_s,
            "restart_s": self.restart_s,
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
            recovered_from="checkpoint" if resume else "start",
        )


def launch(
    fn: Callable[..., Any],
    *args: Any,
    cluster: TrainingCluster | Client | None = None,
    world_size: int | None = None,
    name: str | None = None,
    checkpoint_dir: str | Path | None = None,
    keep_checkpoints: int = 3,
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
        world_size: How many ranks; default every eligible worker.
        name: The job's name (task keys, the Training page); default ``fn``'s name.
        checkpoint_dir: Where ``ctx.save`` writes and ``ctx.restore`` reads, a folder every
            worker reaches.
        keep_checkpoints: The newest checkpoints kept.
        on_event: Called with every record the ranks send (``ctx.report``, recoveries), in
            order, on a thread of its own.
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
    called_at = time.time()
    overrides = {
        "world_size": world_size,
        "max_failures": max_failures,
        "backend": backend,
        "workers": workers,
        "hang_timeout_s": hang_timeout_s,
        "first_step_timeout_s": first_step_timeout_s,
    }
    base = config.model_dump() if isinstance(config, LaunchConfig) else dict(config or {})
    try:
        settings = LaunchConfig.model_validate(
            base | {k: v for k, v in overrides.items() if v is not None}
        )
        tracked = TrackingConfig.model_validate(tracking or {})
    except ValidationError as error:  # one line naming the field, as a config file's would be
        raise ConfigError(one_line(error)) from None
    if keep_checkpoints < 1:
        raise ValueError(f"keep_checkpoints: {keep_checkpoints}; keep at least 1")
    if not callable(fn):
        raise TypeError(f"launch: fn must be callable, got {type(fn).__name__}")
    name = name or getattr(fn, "__name__", "launch")
    tracker = None
    if tracked.enabled:
        run = {"name": name, "launch": settings.model_dump(mode="json")}
        tracker = Tracker.open(tracked, run)
        on_event = tracker.wrap(on_event)
    owned = cluster is None
    # A Ctrl-C that Python drops in a finalizer while this waits is raised again.
    with DroppedInterrupts(), tracker.closing() if tracker else contextlib.nullcontext():
        if cluster is None:
            cluster = start_cluster()
        client = cluster.client if isinstance(cluster, TrainingCluster) else cluster
        try:
            # The collections go where the ranks will run: the job holds its workers first.
            hold = JobHold(client, settings, name=name, on_event=on_event, stop=stop)
            with (
                hold,
                prepared_data(client, data, settings, workers=hold.workers())
                if data is not None
                else contextlib.nullcontext() as prepared,
            ):
                result = launch_on(
                    client,
                    fn,
                    args,
                    kwargs,
                    settings=settings,
                    name=name,
                    checkpoint_dir=checkpoint_dir,
                    keep_checkpoints=keep_checkpoints,
                    on_event=on_event,
                    called_at=called_at,
                    data=prepared.plan if prepared is not None else None,
                    stop=stop,
                    hold=hold,
                )
        finally:
            if owned:
                cluster.close()
        if tracker is not None:
            summary = {"world_size": result.world_size, "recoveries": result.recoveries}
            tracker.finish({"strategy": "launch", **summary})
        return result


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
        self.client, self.settings, self.on_event = client, settings, on_event
        self.job_id = f"{name}-{uuid.uuid4().hex[:8]}"
        self.topic = EVENT_PREFIX + self.job_id
        # Until launch_on's relay exists, a record goes to the topic and on_event directly.
        self.emit: Callable[[dict[str, Any]], None] = self._emit_directly
        self.admission = admit(
            client, settings, job_id=self.job_id, name=name, on_queued=self._queued, stop=stop
        )

    def workers(self) -> list[str]:
        """The job's workers in rank order, waiting in the queue for them if need be."""
        return hold_workers(self.client, self.admission, self.settings.workers)

    def _queued(self, status: dict[str, Any]) -> None:
        # on_event handlers, the Training page and /metrics see the job waiting.
        self.emit({"kind": "queued", "job_id": self.job_id, **status})

    def _emit_directly(self, record: dict[str, Any]) -> None:
        self.client.log_event(self.topic, record)
        if self.on_event is not None:
            self.on_event(record)

    def __enter__(self) -> "JobHold":
        return self

    def __exit__(self, *exc: object) -> None:
        self.admission.release()


def launch_on(
    client: Client,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    settings: LaunchConfig,
    name: str,
    checkpoint_dir: str | Path | None,
    keep_checkpoints: int,
    on_event: EventHandler | None,
    called_at: float,
    final_records: Callable[[list[Any]], list[dict[str, Any]]] | None = None,
    retry_code_errors: bool = False,
    task_prefix: str = "launch",
    signing_key_file: str | None = None,
    data: CollectionPlan | None = None,
    stop: threading.Event | None = None,
    hold: JobHold | None = None,
) -> LaunchResult:
    """The attempts of one launch on a connected client (``launch`` and ``train`` use it).

    ``final_records`` picks, from the ranks' return values, records that ``on_event`` must
    receive even if their events were still in flight (the built-in trainer's epochs). The
    rank tasks are named ``<task_prefix>-<name>-<rank>-<generation>`` on the dashboard.
    ``hold``: the job's place in the queue, when the caller took it first (``JobHold``).
    """
    # Workers may run elsewhere: they get the checkpoint folder as an absolute path.
    directory = str(Path(checkpoint_dir).absolute()) if checkpoint_dir is not None else None
    keep_training_metrics(client)
    hold = hold or JobHold(client, settings, name=name, on_event=on_event, stop=stop)
    job_id, admission = hold.job_id, hold.admission
    events = EventRelay(client, hold.topic, on_event)
    hold.emit = events.emit
    heartbeat_topic = HEARTBEAT_PREFIX + job_id
    policy = FailurePolicy(settings.max_failures, retry_code_errors)
    recoveries: list[Recovery] = []
    failure: Failure | None = None
    workers: list[str] = []  # the ranks' workers of the latest attempt
    # The job's hold on its workers spans its attempts: a recovering job keeps its place.
    with events, hold:
        for attempt in range(settings.max_failures + 1):
            resume = latest_good_checkpoint(directory, signing_key_file) if directory else None
            if resume:
                # Records the checkpoint already holds were delivered by the run that wrote it.
                events.skip(resume[1].get("history", []))
            recovery = failure.recovered_at(resume) if failure is not None else None
            if recovery is not None:
                recoveries.append(recovery)
            attempt_started = time.time()
            heartbeats = Heartbeats()
            client.subscribe_topic(heartbeat_topic, heartbeats.record)
            try:
                with ProcessGroup(client, settings, admission=admission) as group:
                    assert group.spec is not None
                    workers = group.workers
                    if attempt == 0 and admission.queued_once:
                        events.emit(
                            {"kind": "admitted", "job_id": job_id, "waited_s": admission.waited_s}
                        )
                    source = None
                    if recovery is not None:
                        if settings.recovery == "replica":
                            source = _live_source(client, job_id, workers, resume, settings)
                        if source is not None:
                            recovery.from_replica(source)
                        logger.warning("recovery %d: %s", len(recoveries), recovery.describe())
                        # The dashboard counts them; on_event handlers see a "recovery" record.
                        events.emit(
                            {
                                "kind": "recovery",
                                "recoveries": len(recoveries),
                                **recovery.summary(),
                            }
                        )
                    job = RankJob(
                        fn=fn,
                        args=args,
                        kwargs=kwargs,
                        name=name,
                        generation=group.spec.generation,
                        attempt=attempt,
                        max_failures=settings.max_failures,
                        event_topic=events.topic,
                        heartbeat_topic=heartbeat_topic,
                        checkpoint_dir=directory,
                        keep_checkpoints=keep_checkpoints,
                        resume_from=str(resume[0]) if resume and source is None else None,
                        signing_key_file=signing_key_file,
                        data=data,
                        job_id=job_id,
                        live_source=source,
                    )
                    payload = cloudpickle.dumps(job)
                    if attempt == 0:
                        ship_code(client, payload)  # what the workers cannot import
                    outcomes: list[RankOutcome] = group.run(
                        run_pickled,
                        payload,
                        name=f"{task_prefix}-{name}",
                        heartbeats=heartbeats,
                        stop=stop,
                    )
                break
            except LaunchError as error:
                _forget_kept(client, job_id, workers)
                if failure is None:
                    raise  # the cluster cannot hold this run: a configuration error
                raise TrainingFailed(
                    f"{failure.message}; no replacement worker arrived: {error}"
                ) from error
            except (RankFailed, GroupFormationError) as error:
                try:
                    failure = _next_failure(error, attempt_started, policy, len(recoveries), fn)
                except BaseException:
                    _forget_kept(client, job_id, workers)
                    raise
            except Exception:  # a stop, a user's error: not Ctrl-C, which must not wait
                _forget_kept(client, job_id, workers)
                raise
            finally:
                client.unsubscribe_topic(heartbeat_topic)
    wall_s = time.time() - called_at
    # Ranks that never reported or beat have no first step (NaN): the first that did counts.
    reported = [o.first_report_at for o in outcomes if not math.isnan(o.first_report_at)]
    first_step_at = min(reported, default=math.nan)
    if recoveries:
        # The work lost includes the restart: until the resumed attempt's first step.
        recoveries[-1].finish(first_step_at=first_step_at)
    reports = [o.reports for o in outcomes]
    missed = [record for rank_reports in reports for record in rank_reports]
    if final_records is not None:
        missed = final_records([o.value for o in outcomes]) + missed
    events.deliver_missed(missed)
    earlier = events.reports_before(attempt, len(outcomes))
    return LaunchResult(
        name=name,
        world_size=len(outcomes),
        results=[o.value for o in outcomes],
        metrics=[before + now for before, now in zip(earlier, reports, strict=True)],
        recoveries=[r.summary() for r in recoveries],
        wall_s=wall_s,
        first_step_s=first_step_at - called_at,
        attempts=attempt + 1,
        outcomes=outcomes,
        job_id=job_id,
    )


def _live_source(
    client: Client,
    job_id: str,
    workers: list[str],
    resume: tuple[Path, dict[str, Any]] | None,
    settings: LaunchConfig,
) -> LiveSource | None:
    """The surviving rank whose kept state is newest, if it is at least as new as the
    checkpoint; None: continue from the checkpoint (or the start)."""
    try:
        answers = run_bounded(
            client, live_recovery.held, job_id, workers=workers, timeout_s=settings.init_timeout_s
        )
    except TimeoutError:
        return None
    held = [a if isinstance(a := answers.get(w), dict) else None for w in workers]
    return live_recovery.choose_source(held, checkpoint_step=resume[1]["step"] if resume else None)


def _forget_kept(client: Client, job_id: str, workers: list[str]) -> None:
    """The job ends without another attempt: its ranks' workers drop the states they kept."""
    if not workers:
        return
    with contextlib.suppress(Exception):
        run_bounded(client, live_recovery.forget, job_id, workers=workers, timeout_s=5.0)


def _next_failure(
    error: RankFailed | GroupFormationError,
    attempt_started: float,
    policy: FailurePolicy,
    recoveries: int,
    fn: Callable[..., Any],
) -> Failure:
    """The failure to recover from, or the exception that ends the launch."""
    infrastructure = getattr(error, "infrastructure", True)
    decision = policy.decide(infrastructure=infrastructure, failures_so_far=recoveries)
    user_error = error.error if isinstance(error, RankFailed) and not infrastructure else None
    if decision is Decision.RAISE and user_error is not None:
        # The training code's own exception, with its remote traceback: raised here.
        assert isinstance(error, RankFailed)
        retried = f"after {recoveries} restarts" if policy.retry_code_errors else "not retried"
        user_error.add_note(
            f"dask-train: raised by rank {error.rank} on worker {error.worker}; {retried} "
            "(an exception of the training code, not of the cluster)"
        )
        raise user_error.with_traceback(_with_source_files(user_error, fn)) from None
    if decision is Decision.RAISE:
        raise TrainingFailed(
            f"{error} (at {time.strftime('%H:%M:%S')}); giving up after {recoveries} "
            f"recoveries (launch.max_failures = {policy.max_failures})"
        ) from error
    logger.warning("attempt failed, restarting: %s", error)
    return Failure(str(error), getattr(error, "detected_at", time.time()), attempt_started)


def _with_source_files(error: BaseException, fn: Callable[..., Any]) -> TracebackType | None:
    """``error``'s remote traceback with the user's file names back in it, and each frame's
    ``^^^^`` markers where the rank had them.

    Functions defined in a script's ``__main__`` or a notebook travel by value, and cloudpickle
    names their code ``<dynamic-code>`` (line numbers stay right); the client still has the
    code, so each such frame gets the file of the function of that name here.
    """
    files = _code_files(fn)

    def file_of(file: str, function: str) -> str:
        return files.get(function, file) if file == DYNAMIC_CODE else file

    return rebuilt_traceback(error, file_of)


def _code_files(fn: Callable[..., Any]) -> dict[str, str]:
    """Function name -> source file, for ``fn`` and what its module defines."""
    files: dict[str, str] = {}
    roots = [fn, *getattr(fn, "__globals__", {}).values()]
    seen: set[int] = set()
    stack = [getattr(r, "__code__", None) for r in roots]
    for root in roots:  # methods of classes defined next to fn
        if isinstance(root, type):
            stack += [getattr(v, "__code__", None) for v in vars(root).values()]
    while stack:
        code = stack.pop()
        if not isinstance(code, CodeType) or id(code) in seen:
            continue
        seen.add(id(code))
        files.setdefault(code.co_name, code.co_filename)
        stack += [c for c in code.co_consts if isinstance(c, CodeType)]
    return files
