"""A job's control loop on the client, as a state machine.

    queued -> forming -> running -> done
                 ^  ^ |     ^ |
                 |  | v     | +-> preparing -+   (workers join: they get ready, the job trains on)
                 |  preparing +-------<-------+
                 |          +-> resizing ---+    (an elastic job's world changes)
                 |          +-> recovering -+    (a worker lost, a rank hung)
                 +--------------------------+
                            +-> stopping -> failed

Each pass through ``forming`` is one generation of the process group, over the workers the job
holds then; ``running`` ends in one of four ways, each handled by one method: every rank
returned (``done``), every rank stopped at the same step boundary for a resize (``resizing``),
a failure worth another attempt (``recovering``), or one that is not (``failed``). Each state is
an object holding its own data (``resizing`` its `Resize`, ``recovering`` its `Failure`,
``preparing`` its newcomers, ``done`` the ranks' outcomes), as Ray Train v2's controller states
do. Failures are typed where they are caught (``workflows/jobs/launcher.py``: `WorkerLost`,
`RankHung`, `RankFailed` with the training code's own exception), and the decision is the
`workflows.jobs.failure_policy.FailurePolicy`'s that the controller is given; whether the world may
change, and why it does, is its `workflows.jobs.scaling_policy` policy's. Every state change is a
`Transition`; every resize a record of kind ``resized`` to ``on_event``, the run directory and
the Training page.

An elastic job (``launch.world_size = "min:max"``) resizes without redoing a step: a watcher
thread follows the job's entry in the scheduler's queue (`workflows.jobs.admission.WorkerQueue`)
and, when workers join, a queued job needs some back, or a held worker closes gracefully, asks
the ranks to stop at their next step boundary (`workers.elastic`); the next generation, on the
new set of workers, receives the state from a live rank.

Before the ranks stop for workers that joined, the job keeps training while each newcomer gets
ready (``preparing``: torch and the job's code imported, the rank-0 worker's store reached;
`workers.preparation`); the ranks stop only once every newcomer answered, and one that failed
to prepare is left out of the job (and said so in the log), not waited for, and handed back to
the queue, which grants it to the job no more while its process lives. A first
generation's workers that never ran a rank are prepared the same way before the group forms.
"""

import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path
from types import CodeType, TracebackType
from typing import Any, ClassVar, Protocol

import cloudpickle
from distributed import Client

from workers import elastic, live_recovery, preparation
from workers.checkpoint import latest_good_checkpoint
from workers.live_recovery import LiveSource
from workers.rank_context import RankJob, RankOutcome, forget_job, run_pickled
from workers.records import (
    AdmittedRecord,
    RecoveryRecord,
    ResizedRecord,
    ResumedRecord,
    WorldRecord,
)
from workers.remote_traceback import rebuilt_traceback
from workflows.cluster.training_cluster import live_workers
from workflows.jobs.admission import Admission
from workflows.jobs.code_shipping import ship_code
from workflows.jobs.failure_policy import Decision, FailurePolicy
from workflows.jobs.launcher import (
    GroupFormationError,
    Heartbeats,
    JobStopped,
    LaunchConfig,
    LaunchError,
    ProcessGroup,
    RankFailed,
    RankHung,
    RankWatch,
    WorkerLost,
    run_bounded,
)
from workflows.jobs.request import JobRequest
from workflows.jobs.scaling_policy import ScalingPolicy
from workflows.jobs.spec import JobSpec
from workflows.observe.events import EventRelay

logger = logging.getLogger(__name__)
DYNAMIC_CODE = "<dynamic-code>"  # cloudpickle's file name for code that travels by value
WATCH_POLL_S = 1.0  # one long poll of the queue by an elastic job's watcher
JOIN_SETTLE_S = 0.5  # after a worker joins, how long to wait for the rest of a scale-up
# One try of a resize request: a few bytes to each rank's worker, answered at once by a live
# one. Tries that none took are made again within launch.init_timeout_s.
RESIZE_TRY_S = 5.0


class TrainingFailed(RuntimeError):
    """The run failed more often than ``launch.max_failures`` allows, or the lost worker
    never came back."""


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


@dataclass
class Resize:
    """One change of an elastic job's world: ``cause`` is ``joined`` (workers joined or were
    freed), ``yielded`` (a queued job needed them), ``retired`` (a worker closed gracefully)
    or ``lost`` (a worker died; the job went on without waiting for a replacement)."""

    cause: str
    before: int
    detected_at: float
    after: int = 0
    step: int = 0  # the step the new world continues from
    stopped_at: float = math.nan  # wall clock of that step on the ranks
    pause_s: float | None = None  # the last step before to the first step after
    redone_steps: int | None = 0  # steps finished before that the new world does again
    reached: int | None = None  # the step the ranks stopped at together (not after a loss)
    broadcast_s: float | None = None  # the pause's share broadcasting the state (a live rank's)

    def record(self) -> ResizedRecord:
        """The resize's record, as ``LaunchResult.resizes`` holds it (the job's topic gets it
        with the job's id)."""
        return ResizedRecord(
            before=self.before,
            after=self.after,
            step=self.step,
            cause=self.cause,
            pause_s=self.pause_s,
            redone_steps=self.redone_steps,
            at=self.detected_at,
            broadcast_s=self.broadcast_s,
        )


class ControllerState:
    """A state of a job's controller, holding the data of its own (as Ray Train v2's do): a
    resize its decision, a recovery its failure, a preparation its newcomers."""

    name: ClassVar[str]

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True, eq=False)
class Queued(ControllerState):
    """Waiting in the scheduler's queue for the job's workers."""

    name: ClassVar[str] = "queued"


@dataclass(frozen=True, eq=False)
class Forming(ControllerState):
    """A generation of the process group forms; ``after``: the state it follows, whose data
    (a failure to recover from, a resize to complete) the generation takes on."""

    after: ControllerState
    name: ClassVar[str] = "forming"


@dataclass(frozen=True, eq=False)
class Preparing(ControllerState):
    """``newcomers`` get ready for a rank of the job while it goes on ``during`` forming or
    running, the state it returns to."""

    newcomers: tuple[str, ...]
    during: ControllerState
    name: ClassVar[str] = "preparing"


@dataclass(frozen=True, eq=False)
class Running(ControllerState):
    """The generation's ``ranks`` run the job."""

    ranks: int
    name: ClassVar[str] = "running"


@dataclass(frozen=True, eq=False)
class Resizing(ControllerState):
    """Every rank stopped together (at a step boundary, or where it stood for a script) for
    ``resize``, which the next generation completes."""

    resize: Resize
    name: ClassVar[str] = "resizing"


@dataclass(frozen=True, eq=False)
class Recovering(ControllerState):
    """A ``failure`` worth another attempt. ``resize``: an elastic job's lost worker, whose
    world the next generation shrinks (or a replacement fills); ``rank_0_lost``: rank 0 went
    with its records in flight."""

    failure: Failure
    resize: Resize | None = None
    rank_0_lost: bool = False
    name: ClassVar[str] = "recovering"


@dataclass(frozen=True, eq=False)
class Stopping(ControllerState):
    """The job ends without another attempt; ``cause``: the exception's type."""

    cause: str
    name: ClassVar[str] = "stopping"


@dataclass(frozen=True, eq=False)
class Done(ControllerState):
    """Every rank returned: its ``outcomes``, in rank order."""

    outcomes: list[RankOutcome]
    name: ClassVar[str] = "done"


@dataclass(frozen=True, eq=False)
class Failed(ControllerState):
    """The job failed: ``error``, the start of its message."""

    error: str
    name: ClassVar[str] = "failed"


# Which state may follow which: anything else is a bug of the controller.
ALLOWED: dict[type[ControllerState], set[type[ControllerState]]] = {
    Queued: {Forming, Stopping},
    Forming: {Preparing, Running, Recovering, Stopping},
    # Newcomers prepare while the job trains on: its ranks may end meanwhile, any way they can.
    Preparing: {Forming, Running, Done, Resizing, Recovering, Stopping},
    Running: {Preparing, Done, Resizing, Recovering, Stopping},
    Resizing: {Forming, Stopping},
    Recovering: {Forming, Stopping},
    Stopping: {Failed},
    Done: set(),
    Failed: set(),
}


@dataclass(frozen=True)
class Transition:
    """One change of a job's state: to what, when (epoch seconds), and why."""

    state: ControllerState
    at: float
    reason: str = ""


@dataclass
class Finished:
    """What the controller hands back once the job is done."""

    outcomes: list[RankOutcome]
    recoveries: list[Recovery]
    resizes: list[Resize]
    attempts: int
    first_step_at: float
    transitions: list[Transition] = field(default_factory=list)
    resumed: ResumedRecord | None = None  # the earlier run's checkpoint it continued from


class Hold(Protocol):
    """A job's place in the scheduler's queue, as the controller reads it
    (`workflows.jobs.launch.JobHold`): who the job is, its hold on workers, and its stop event."""

    client: Client
    spec: JobSpec
    admission: Admission
    stop: threading.Event | None


class JobController:
    """Runs one job's generations until it is done (see the module's text).

    ``request`` is what the job asks for, ``hold`` its place in the scheduler's queue
    (`workflows.jobs.launch.JobHold`), ``events`` its relay of records; ``job`` the `RankJob` every
    rank receives, whose generation-specific fields the controller fills in for each generation.
    """

    def __init__(
        self,
        request: JobRequest,
        *,
        hold: Hold,
        events: EventRelay,
        job: RankJob,
        failure_policy: FailurePolicy,
        scaling_policy: ScalingPolicy,
    ) -> None:
        self.request, self.events, self.job = request, events, job
        self.client, self.spec, self.admission = hold.client, hold.spec, hold.admission
        self.settings, self.stop = request.settings, hold.stop
        self.policy, self.scaling = failure_policy, scaling_policy
        # Ranks that pass step boundaries resize there; others (scripts) restart, as under
        # torchrun, from their own checkpoints.
        self.step_boundaries = request.step_boundaries
        self.state: ControllerState = Queued()
        self.transitions: list[Transition] = [Transition(self.state, time.time())]
        self.recoveries: list[Recovery] = []
        self.resizes: list[Resize] = []
        self.attempt = 0
        self.failures = 0  # those launch.max_failures bounds
        self.workers: list[str] = []  # the latest generation's, in rank order
        self.resumed: ResumedRecord | None = None
        # Whether the queue knows that this elastic job resizes when asked (admission.resizes).
        self.queue_told_it_resizes = False
        # Workers that failed to prepare for this job: left out of its generations (until the
        # queue took them back, `hand_back`).
        self.left_out: set[str] = set()
        self._code = cloudpickle.dumps(job)  # what a worker unpickles to import the job's code
        self._state_lock = threading.Lock()  # the elastic watcher moves to and from preparing

    # -- the loop ---------------------------------------------------------------------------

    def run(self) -> Finished:
        """Generations until every rank returned; raises what ends the job otherwise."""
        try:
            while not isinstance(self.state, Done):
                forming = Forming(after=self.state)
                self.move(forming)
                self.generation(forming.after)
        except BaseException as error:
            if isinstance(error, Exception):  # not Ctrl-C, which must not wait
                self._forget_kept()
            if not isinstance(self.state, Stopping):
                self.move(Stopping(type(error).__name__), type(error).__name__)
            self.move(Failed(str(error)[:200]), str(error)[:200])
            raise
        outcomes = self.state.outcomes
        reported = [o.first_report_at for o in outcomes if not math.isnan(o.first_report_at)]
        first_step_at = min(reported, default=math.nan)
        if self.recoveries:
            # The work lost includes the restart: until the resumed attempt's first step.
            self.recoveries[-1].finish(first_step_at=first_step_at)
        self._report_resize(first_step_at)
        return Finished(
            outcomes=outcomes,
            recoveries=self.recoveries,
            resizes=self.resizes,
            attempts=self.attempt,
            first_step_at=first_step_at,
            transitions=self.transitions,
            resumed=self.resumed,
        )

    def move(
        self, state: ControllerState, reason: str = "", *, only_after: Transition | None = None
    ) -> bool:
        """One state change, checked against ``ALLOWED`` and kept as a `Transition`;
        ``only_after``: made only when that is still the latest change (else False: the elastic
        watcher's way back from ``preparing`` after the ranks ended meanwhile)."""
        with self._state_lock:
            if only_after is not None and self.transitions[-1] is not only_after:
                return False
            if type(state) not in ALLOWED[type(self.state)]:
                raise RuntimeError(f"job {self.spec.job_id}: no way from {self.state} to {state}")
            self.state = state
            self.transitions.append(Transition(state, time.time(), reason))
        logger.debug("job %s: %s %s", self.spec.job_id, state, reason)
        return True

    def prepare(self, workers: list[str], *, master: tuple[str, int] | None) -> list[str]:
        """Get ``workers`` ready for a rank of this job (`workers.preparation`) while the job
        goes on, in state ``preparing``; returns those ready. One that failed or did not answer
        within ``launch.init_timeout_s`` is left out of the job's generations, and logged."""
        latest = self.transitions[-1]
        newcomers = Preparing(newcomers=tuple(workers), during=latest.state)
        if not workers or not self.move(newcomers, f"{len(workers)} workers", only_after=latest):
            return []
        preparing = self.transitions[-1]
        started = time.perf_counter()
        try:
            answers = run_bounded(
                self.client,
                preparation.prepare,
                self.spec.job_id,
                self._code,
                master,
                self.settings.init_timeout_s,
                workers=workers,
                timeout_s=self.settings.init_timeout_s,
            )
        except TimeoutError:
            answers = {}
        finally:
            self.move(newcomers.during, "prepared", only_after=preparing)
        ready = [w for w in workers if isinstance(answers.get(w), dict)]
        for worker in workers:
            if worker in ready:
                logger.info(
                    "job %s: worker %s ready in %.2f s (%s)",
                    self.spec.job_id,
                    worker,
                    time.perf_counter() - started,
                    ", ".join(f"{k} {v:.2f}" for k, v in answers[worker].items()),
                )
                continue
            why = answers.get(worker, f"no answer within {self.settings.init_timeout_s:g} s")
            if self.scaling.elastic:  # a fixed job's rank fails there, as it would have
                logger.warning(
                    "job %s: leaving worker %s out, it failed to prepare: %s",
                    self.spec.job_id,
                    worker,
                    why,
                )
                self.left_out.add(worker)
        return ready

    def hand_back(self, workers: Collection[str]) -> None:
        """Give the queue back ``workers``, left out of the job: a queued job (or another
        newcomer) takes them, where the job would hold them idle. The queue grants them to the
        job no more while their process lives (why: `workflows.jobs.admission`). One the queue
        could not be told of stays left out here, and is handed back as the next generation
        forms."""
        if not workers:
            return
        try:
            self.admission.hand_back(sorted(workers))
        except Exception as error:  # the scheduler busy or gone: the job goes on without them
            logger.warning("job %s: could not hand %s back: %s", self.spec.job_id, workers, error)
            return
        logger.info("job %s: handed %s back to the queue", self.spec.job_id, sorted(workers))
        self.left_out -= set(workers)

    def _prepare_cold(self, workers: list[str]) -> list[str]:
        """Before a generation forms: prepare those of ``workers`` that never ran a rank (a
        fresh process: a new worker, a lost one's replacement); the workers to form it on."""
        try:
            cold = run_bounded(
                self.client,
                preparation.is_cold,
                workers=workers,
                timeout_s=self.settings.init_timeout_s,
            )
        except TimeoutError:
            return workers  # the group's formation has its own bounds, and says who is missing
        # Not a paused worker (its memory past distributed.worker.memory.pause): Dask starts no
        # rank there, and the imports could only take it on to its nanny's kill.
        status = {w: identity.get("status") for w, identity in live_workers(self.client).items()}
        self.prepare(
            [w for w in workers if cold.get(w) is True and status.get(w) != "paused"], master=None
        )
        kept = [w for w in workers if w not in self.left_out]
        if len(kept) < self.admission.request.minimum:
            return workers  # too few without them: their ranks fail as they would have
        self.hand_back(set(self.left_out))  # and any the queue could not be told of before
        return kept

    def generation(self, after: ControllerState) -> None:
        """Form one generation over the held workers, run every rank, and decide what next;
        ``after``: the state it follows (a recovery's failure, a resize's decision)."""
        resume = self._resume_point()
        recovery = after.failure.recovered_at(resume) if isinstance(after, Recovering) else None
        if recovery is not None:
            self.recoveries.append(recovery)
        started = time.time()
        watch = _GenerationWatch()
        self.client.subscribe_topic(self.spec.heartbeat_topic, watch.heartbeats.record)
        try:
            if self.attempt == 0:
                # What the workers cannot import, before any of them prepares or runs a rank.
                ship_code(self.client, self._code)
            outcomes = self._form_and_run(resume, recovery, after, watch)
            self.attempt += 1
            self._ended(outcomes, watch.watcher, started)
        except LaunchError as error:
            if recovery is None and not self.resizes:
                raise  # the cluster cannot hold this run: a configuration error
            raise TrainingFailed(
                f"{recovery.failure if recovery else 'a resize'}; no replacement worker "
                f"arrived: {error}"
            ) from error
        except (RankFailed, GroupFormationError) as error:
            self.attempt += 1
            self._failed(error, started)
        except JobStopped:
            if not watch.restart.is_set() or (self.stop is not None and self.stop.is_set()):
                raise
            self.attempt += 1
            self._ended([None] * len(self.workers), watch.watcher, started, restarted=True)
        finally:
            if watch.watcher is not None:
                watch.watcher.close()
            self.client.unsubscribe_topic(self.spec.heartbeat_topic)
        self._report_resize(watch.heartbeats.first_step_at)

    def _resume_point(self) -> tuple[Path, dict[str, Any]] | None:
        """The newest complete checkpoint of the job's run, if it writes any."""
        request = self.request
        if not request.checkpoint_dir:
            return None
        resume = latest_good_checkpoint(
            request.checkpoint_dir,
            request.signing_key_file,
            request.storage_options,
            run_id=request.run_id,
        )
        if resume:
            # Records the checkpoint already holds were delivered by the run that wrote it.
            self.events.skip(resume[1].get("history", []))
        return resume

    def _form_and_run(
        self,
        resume: tuple[Path, dict[str, Any]] | None,
        recovery: Recovery | None,
        after: ControllerState,
        watch: "_GenerationWatch",
    ) -> list[RankOutcome | None]:
        """Form the generation's group, continue from ``resume`` or a live rank, and run every
        rank until each returned (or left gracefully: None)."""
        group = ProcessGroup(
            self.client,
            self.settings,
            admission=self.admission,
            step_boundaries=self.step_boundaries,
            leave_out=self.left_out,
            before_forming=self._prepare_cold,
        )
        with group:
            assert group.spec is not None
            self.workers = group.workers
            if self.attempt == 0:
                self._announce(resume)
            source = self._continue_from(resume, recovery, after)
            payload = cloudpickle.dumps(self._rank_job(group.spec.generation, resume, source))
            self.move(Running(ranks=len(group.workers)), f"{len(group.workers)} ranks")
            heartbeats = watch.heartbeats
            if self.scaling.elastic:
                watch.watcher = _Watcher(
                    self,
                    group.spec.generation,
                    group.workers,
                    watch.restart,
                    master=(group.spec.master_addr, group.spec.master_port),
                    stepped=lambda: heartbeats.first_step_at is not None,
                )
            outcomes = group.run(
                run_pickled,
                payload,
                name=f"{self.request.task_prefix}-{self.spec.name}",
                watch=RankWatch(
                    heartbeats=heartbeats,
                    stop=self.stop,
                    restart=watch.restart,
                    left_gracefully=watch.watcher.left_gracefully if watch.watcher else None,
                    on_poll=lambda: self._report_resize(heartbeats.first_step_at),
                ),
            )
            if watch.watcher is not None:
                watch.watcher.close()
        return outcomes

    def _announce(self, resume: tuple[Path, dict[str, Any]] | None) -> None:
        """The first generation's records: the job was admitted (if it waited), its world, and
        the earlier run's checkpoint it continues from."""
        if self.admission.queued_once:
            self.events.emit(
                AdmittedRecord(job_id=self.spec.job_id, waited_s=self.admission.waited_s)
            )
        self.events.emit(WorldRecord(job_id=self.spec.job_id, world_size=len(self.workers)))
        if resume:  # an earlier run's checkpoint
            self.resumed = ResumedRecord(
                job_id=self.spec.job_id, step=resume[1]["step"], checkpoint=str(resume[0])
            )
            self.events.emit(self.resumed)

    # -- one decision each ------------------------------------------------------------------

    def _ended(
        self,
        outcomes: list[RankOutcome | None],
        watcher: "_Watcher | None",
        started: float,
        *,
        restarted: bool = False,
    ) -> None:
        """Every rank is back: done, or stopped together at a step boundary for a resize
        (``restarted``: stopped where they stood, for ranks without boundaries)."""
        stopped = [o for o in outcomes if o is not None and o.resized_at is not None]
        if not stopped and not restarted:
            missing = [rank for rank, o in enumerate(outcomes) if o is None]
            if missing:  # a rank's worker retired as the job ended: its return value is gone
                logger.warning("ranks %s retired as job %s ended", missing, self.spec.job_id)
            done = [
                o if o is not None else RankOutcome(rank=rank, value=None)
                for rank, o in enumerate(outcomes)
            ]
            self.move(Done(outcomes=done))
            return
        cause = (watcher.cause if watcher else None) or "retired"
        asked_at = watcher.asked_at if watcher else math.nan
        resize = Resize(
            cause=cause,
            before=len(outcomes),
            detected_at=asked_at if not math.isnan(asked_at) else time.time(),
            reached=max((o.resized_at for o in stopped if o.resized_at is not None), default=None),
        )
        where = "restarted" if restarted else f"at step {stopped[0].resized_at}"
        self.move(Resizing(resize), f"{cause} {where}")

    def _failed(self, error: RankFailed | GroupFormationError, started: float) -> None:
        """A failure: another attempt (``recovering``), or the exception that ends the job."""
        rank_0_lost = isinstance(error, WorkerLost | RankHung) and error.rank == 0
        # An elastic job that loses a worker shrinks (or takes a replacement): a resize of
        # its world, not one of the failures launch.max_failures bounds.
        if self.scaling.elastic and isinstance(error, WorkerLost):
            logger.warning("job %s: %s; going on without it", self.spec.job_id, error)
            failure = Failure(str(error), error.detected_at, started)
        else:
            failure = _next_failure(error, started, self.policy, self.failures, self.request.fn)
            self.failures += 1
        resize = None
        if self.scaling.elastic:
            resize = Resize(cause="lost", before=len(self.workers), detected_at=failure.detected_at)
        self.move(Recovering(failure, resize, rank_0_lost), failure.message[:200])

    def _continue_from(
        self,
        resume: tuple[Path, dict[str, Any]] | None,
        recovery: Recovery | None,
        after: ControllerState,
    ) -> LiveSource | None:
        """The live rank the new generation receives its state from, if any; the records of
        the recovery or the resize (``after``'s) this generation completes."""
        resize = after.resize if isinstance(after, Resizing | Recovering) else None
        source = None
        reached: int | None = None
        wanted = recovery is not None or resize is not None
        if wanted and (self.settings.recovery == "replica" or recovery is None):
            source, reached = _live_source(
                self.client, self.spec.job_id, self.workers, resume, self.settings
            )
        if recovery is not None:
            if source is not None:
                recovery.from_replica(source)
            logger.warning("recovery %d: %s", len(self.recoveries), recovery.describe())
            # The dashboard counts them; on_event handlers see a "recovery" record.
            self.events.emit(RecoveryRecord(recoveries=len(self.recoveries), **recovery.summary()))
        if wanted and self.attempt > 0:
            # Each step once in the ranks' reports, rank 0's whatever worker was lost.
            continued = source.step if source is not None else resume[1]["step"] if resume else 0
            rank_0_lost = isinstance(after, Recovering) and after.rank_0_lost
            self.events.continued_from(self.attempt - 1, continued, rank_0_lost=rank_0_lost)
        if resize is not None:
            self._complete(resize, resume, source, reached)
        return source

    def _complete(
        self,
        resize: Resize,
        resume: tuple[Path, dict[str, Any]] | None,
        source: LiveSource | None,
        reached: int | None,
    ) -> None:
        """``resize``'s new world formed: from which step it continues, and what it redoes."""
        resize.after = len(self.workers)
        if resize.after == resize.before and resize.cause == "lost":
            return  # a replacement arrived: a recovery, not a resize
        if source is not None:
            resize.step, resize.stopped_at = source.step, source.done_at
        else:  # sharded: the checkpoint the ranks wrote as they stopped, or an older one
            # (the pause then counts from when the resize was asked: a step at most early)
            resize.step = resume[1]["step"] if resume else 0
        if resize.reached is not None:
            reached = resize.reached
        resize.redone_steps = max(0, reached - resize.step) if reached is not None else None
        self.resizes.append(resize)
        logger.warning(
            "job %s resized %d -> %d (%s) at step %d",
            self.spec.job_id,
            resize.before,
            resize.after,
            resize.cause,
            resize.step,
        )

    def _report_resize(self, first_step_at: float | None) -> None:
        """The newest resize's record goes out once the new world's first step is done (its
        pause); until then its ``pause_s`` is None."""
        resize = self.resizes[-1] if self.resizes else None
        if resize is None or resize.pause_s is not None:
            return
        if first_step_at is None or math.isnan(first_step_at):
            return
        start = resize.stopped_at if not math.isnan(resize.stopped_at) else resize.detected_at
        resize.pause_s = max(0.0, first_step_at - start)
        if not math.isnan(resize.stopped_at):  # a live rank's state, broadcast in the new group
            resize.broadcast_s = self._broadcast_s()
        self.events.emit(resize.record().model_copy(update={"job_id": self.spec.job_id}))

    def _broadcast_s(self) -> float | None:
        """The latest generation's broadcast of a live rank's state, as the last of its ranks
        to reach it spent in it (`live_recovery.received_s`); None if a rank cannot say."""
        with contextlib.suppress(Exception):  # a figure of the record, never worth failing for
            answers = run_bounded(
                self.client,
                live_recovery.received_s,
                self.spec.job_id,
                workers=self.workers,
                timeout_s=RESIZE_TRY_S,
            )
            received = [a for a in answers.values() if isinstance(a, float)]
            if received and len(received) == len(self.workers):
                return min(received)
        return None

    def _rank_job(
        self, generation: str, resume: tuple[Path, dict[str, Any]] | None, source: LiveSource | None
    ) -> RankJob:
        from dataclasses import replace

        return replace(
            self.job,
            generation=generation,
            attempt=self.attempt,
            resume_from=str(resume[0]) if resume and source is None else None,
            live_source=source,
            elastic=self.scaling.elastic,
        )

    def _forget_kept(self) -> None:
        """The job ends without another attempt: its ranks' workers drop the states they kept,
        and the trained pieces that ranks which finished left for the client."""
        if not self.workers:
            return
        with contextlib.suppress(Exception):
            run_bounded(
                self.client, forget_job, self.spec.job_id, workers=self.workers, timeout_s=5.0
            )


@dataclass
class _GenerationWatch:
    """One generation's watch on its ranks: their heartbeats, the event that stops every rank
    at once (an elastic script's resize), and an elastic job's watcher of the queue."""

    heartbeats: Heartbeats = field(default_factory=Heartbeats)
    restart: threading.Event = field(default_factory=threading.Event)
    watcher: "_Watcher | None" = None


class _Watcher:
    """An elastic job's eye on its entry in the scheduler's queue while a generation runs:
    when workers join, a queued job needs some back, or a held one closes gracefully, it asks
    the ranks to stop at their next step boundary."""

    def __init__(
        self,
        controller: JobController,
        generation: str,
        workers: list[str],
        restart: threading.Event,
        *,
        master: tuple[str, int],
        stepped: Callable[[], bool],
    ) -> None:
        self.controller, self.generation, self.workers = controller, generation, workers
        self.restart, self.master = restart, master
        self.stepped = stepped  # whether a rank of this generation passed a step boundary
        self.prepared: set[str] = set()  # newcomers ready for this job's next generation
        self._asked: set[str] = set()  # newcomers asked to prepare, ready or not
        self.cause: str | None = None
        self.asked_at = math.nan
        self.retired: set[str] = set()
        self._done = threading.Event()
        self._thread = threading.Thread(
            target=self._follow, name=f"dask-train-elastic-{generation}", daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        self._done.set()

    def left_gracefully(self, worker: str) -> bool:
        """Whether ``worker``, gone from the cluster, was retired (asked the queue: its
        status change came before its removal)."""
        if worker in self.retired:
            return True
        with contextlib.suppress(Exception):
            status = self.controller.admission.status()
            self.retired |= set(status.get("retired", [])) | set(status.get("retiring", []))
        if worker in self.retired:
            self._ask("retired")
            return True
        return False

    def _follow(self) -> None:
        version = -1
        admission = self.controller.admission
        while not self._done.is_set():
            try:
                self._tell_the_queue_it_resizes()
                status = admission.watch(version, WATCH_POLL_S)
                version = status["version"] if status.get("known") else version
                cause = self._cause(status)
                if cause == "joined":
                    # Workers of one scale-up join over a second or so: one resize for all.
                    if self._done.wait(JOIN_SETTLE_S):
                        return
                    cause = self._cause(status := admission.status())
                    if cause == "joined" and not self._newcomers_ready(status):
                        continue  # none of them could prepare: the job goes on as it is
            except Exception as error:  # the scheduler is busy or gone: the ranks will tell
                logger.info("elastic watcher of %s: %s", self.controller.spec.job_id, error)
                self._done.wait(WATCH_POLL_S)
                continue
            if not status.get("known") or self._done.is_set():
                return
            if cause is not None:
                self._ask(cause)

    def _tell_the_queue_it_resizes(self) -> None:
        """Once a rank passed a step boundary (a script at once: it restarts to resize), the
        queue may grow the job into free workers and ask it for its own; a job whose code never
        calls ``step_done`` would hold them idle, and keep a queued job waiting for them."""
        controller = self.controller
        if controller.queue_told_it_resizes:
            return
        if controller.step_boundaries and not self.stepped():
            return
        controller.admission.resizes()
        controller.queue_told_it_resizes = True

    def _cause(self, status: dict[str, Any]) -> str | None:
        """Why the queue's view of the job calls for a resize now, if it does: the job's
        scaling policy's answer."""
        if not status.get("known"):
            return None
        self.retired |= set(status["retired"]) | set(status["retiring"])
        return self.controller.scaling.resize_cause(status, self.workers, self._newcomers(status))

    def _newcomers(self, status: dict[str, Any]) -> set[str]:
        return set(status["granted"]) - set(self.workers) - self.controller.left_out

    def _newcomers_ready(self, status: dict[str, Any]) -> bool:
        """Prepare the workers that joined (and those that join meanwhile) while the ranks
        train on; whether any is ready."""
        while not self._done.is_set():
            waiting = sorted(self._newcomers(status) - self._asked)
            if not waiting:
                break
            self._asked |= set(waiting)
            self.prepared |= set(self.controller.prepare(waiting, master=self.master))
            self.controller.hand_back(set(waiting) & self.controller.left_out)
            status = self.controller.admission.status()
        return bool(self.prepared & self._newcomers(status))

    def _ask(self, cause: str) -> None:
        if self.cause is not None:
            return
        self.cause, self.asked_at = cause, time.time()
        logger.info("job %s: resizing (%s)", self.controller.spec.job_id, cause)
        if not self.controller.step_boundaries:
            self.restart.set()  # torchrun's way: every rank stops, and starts again
            return
        self._request_resize(cause)

    def _request_resize(self, cause: str) -> None:
        """Ask the ranks' workers to stop at the next boundary. One that takes it is enough
        (the ranks' votes are summed: all stop together); a try that none took (their workers
        busy, a connection failing) is made again, until ``launch.init_timeout_s`` has passed.
        Unasked, the job would never give back what a queued job waits for."""
        controller = self.controller
        deadline = time.monotonic() + controller.settings.init_timeout_s
        pause = 0.1
        # The ranks that stay are asked: a retiring worker's process is closing, may answer
        # late or never, and the call waits for every worker it asks (measured: a SIGTERM'd
        # stock `dask worker` held a graceful leave's request 5 s in 2 of 4 runs).
        asked = [w for w in self.workers if w not in self.retired] or self.workers
        while True:
            left = deadline - time.monotonic()
            try:
                answers = run_bounded(
                    controller.client,
                    elastic.request_resize,
                    self.generation,
                    cause,
                    workers=asked,
                    timeout_s=max(min(RESIZE_TRY_S, left), 0.1),
                )
                if not answers or True in answers.values():
                    return  # taken, or every rank's worker is gone: nobody left to ask
                why = "; ".join(f"{w}: {a!r}" for w, a in answers.items())
            except Exception as error:  # no answer in time, a connection failing
                why = f"{type(error).__name__}: {error}"
            left = deadline - time.monotonic()
            if left <= 0 or self._done.is_set():
                logger.warning(
                    "job %s: no rank took the resize request within %g s (%s)",
                    controller.spec.job_id,
                    controller.settings.init_timeout_s,
                    why,
                )
                return
            logger.info("job %s: resize request not taken (%s); again", controller.spec.job_id, why)
            self._done.wait(min(pause, left))
            pause = min(2 * pause, 1.0)


def _live_source(
    client: Client,
    job_id: str,
    workers: list[str],
    resume: tuple[Path, dict[str, Any]] | None,
    settings: LaunchConfig,
) -> tuple[LiveSource | None, int | None]:
    """The rank whose kept state is newest, if it is at least as new as the checkpoint (None:
    continue from the checkpoint or the start), and the newest step any rank kept."""
    try:
        answers = run_bounded(
            client, live_recovery.held, job_id, workers=workers, timeout_s=settings.init_timeout_s
        )
    except TimeoutError:
        return None, None
    held = [a if isinstance(a := answers.get(w), dict) else None for w in workers]
    steps = [h["step"] for h in held if h is not None]
    source = live_recovery.choose_source(
        held, checkpoint_step=resume[1]["step"] if resume else None
    )
    return source, max(steps, default=None)


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
