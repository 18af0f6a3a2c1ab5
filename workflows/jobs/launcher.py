"""Client side of the process group: hold workers, assign ranks, bootstrap, run, shut down.

:class:`ProcessGroup` is a lifecycle object. ``start`` gets W workers from the scheduler's
queue (``workflows/jobs/admission.py``: on a shared cluster it waits for them), gives them ranks
0..W-1 (workers on one host consecutive), finds a free port on the rank-0 worker and registers
one generation of the job's :class:`~workers.process_group.ProcessGroupPlugin`; ``run`` submits
one task per rank and watches them with bounded waits; ``shutdown`` leaves the group, and after
a failure restarts the rank workers that do not let go, so that no thread stays stuck in a
collective.
"""

import asyncio
import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from typing import Any, Protocol, Self

from distributed import Client, Future
from distributed.comm import CommClosedError, get_address_host

from workers.compat.distributed_private import worker_process_pid
from workers.futures import wait_futures
from workers.process_group import (
    ProcessGroupPlugin,
    ProcessGroupSpec,
    describe_worker,
    plugin_name,
    release_generation,
    running_tasks,
)
from workers.spec.launch import LaunchConfig, WorkerSelection
from workflows.cluster.training_cluster import live_workers, most_workers
from workflows.jobs.admission import (
    Admission,
    AdmissionStopped,
    HoldLost,
    QueueTimeout,
    Request,
    TooFewWorkers,
    Waits,
    rank_order,
)
from workflows.jobs.failure_policy import Cause, cause_of
from workflows.jobs.spec import JobSpec

logger = logging.getLogger(__name__)
RELEASE_POLL_S = 0.05
# A job stopped for good waits this long for a stopped rank to let go; one still busy then,
# writing no checkpoint, waits where the stop and its shut-down connections cannot reach it (in
# gloo's wait for a send posted before its connection went, seen in 8 stops of 166), and its
# worker is restarted now rather than at launch.release_timeout_s. A rank that lets go does so
# in well under a second (the stop lands at its next line of Python).
STOPPED_RANK_GRACE_S = 3.0
PROBE_MIN_S = 1.0  # the least a worker is given to answer before it counts as stopped
RESULT_POLL_S = 1.0  # how often a finished rank's result, still on its way, asks for its worker


class Stop(Protocol):
    """What ends a running job when set: a ``threading.Event``."""

    def is_set(self) -> bool: ...


class LaunchError(RuntimeError):
    """The group cannot be formed as configured (too few workers, a backend the workers lack);
    the message names the field to change."""


class GroupFormationError(RuntimeError):
    """The ranks did not all join (rendezvous timeout, unreachable peers): a failed run, not a
    configuration error."""


class RankFailed(RuntimeError):
    """A rank's task raised, or its worker left the cluster.

    ``infrastructure`` tells a lost worker or a communication failure (worth another attempt)
    from an exception raised by the training code (``error``, with its remote traceback).

    Attributes:
        rank: The rank that failed.
        worker: Its worker's address.
        infrastructure: True for a lost worker or a communication failure.
        error: The exception the training code raised, if it raised one.
        detected_at: When the launcher saw the failure (epoch seconds).
    """

    def __init__(
        self,
        message: str,
        *,
        rank: int,
        worker: str,
        infrastructure: bool = True,
        error: BaseException | None = None,
        cause: Cause | None = None,
    ) -> None:
        super().__init__(message)
        self.rank, self.worker = rank, worker
        self.infrastructure, self.error = infrastructure, error
        # What the error's type told (Cause.UNSURE: a plain RuntimeError or a script's exit,
        # decided by whether the job's workers still answer); None: the launcher saw it, no
        # rank raised it.
        self.cause = cause
        self.detected_at = time.time()  # before the clean-up, which can take seconds


class WorkerLost(RankFailed):
    """A rank's worker left the cluster (killed, out of memory, its host gone)."""


class RankHung(RankFailed):
    """A rank stopped making progress (a stopped process, a deadlocked collective).

    ``stuck``: the silent ranks' workers that did not answer either (a stopped process); the
    others wait in a collective for them and let go of the group in place.
    """

    def __init__(self, message: str, *, rank: int, worker: str, stuck: Iterable[str]) -> None:
        super().__init__(message, rank=rank, worker=worker)
        self.stuck = list(stuck)


class JobStopped(RuntimeError):
    """The caller asked the job to stop (its ``stop`` event was set: a pruned sweep trial);
    its ranks were released. Neither a failure to recover from nor an error of the code.

    ``for_good``: no attempt follows; False where only this attempt stops (an elastic
    script's restart for a resize), whose ranks keep what they hold for the next."""

    def __init__(self, message: str, *, for_good: bool = True) -> None:
        super().__init__(message)
        self.for_good = for_good


class Heartbeats:
    """The ranks' latest sign of progress, fed by their Dask events.

    ``record`` is a topic handler: it runs on the client's event loop, so it only stores.
    """

    def __init__(self) -> None:
        self._seen: dict[int, tuple[float, int, int]] = {}  # rank -> (when, step, first step)
        self.first_step_at: float | None = None  # wall clock of any rank's first step_done

    def record(self, event: tuple[float, dict[str, Any]]) -> None:
        rank, step = int(event[1]["rank"]), int(event[1]["step"])
        stepped = event[1].get("first_step_at")
        if stepped is not None:
            self.first_step_at = min(self.first_step_at or stepped, stepped)
        first = self._seen.get(rank, (0.0, step, step))[2]
        self._seen[rank] = (time.monotonic(), step, first)

    def silent_ranks(
        self, ranks: int, *, since: float, hang_timeout_s: float, first_step_timeout_s: float
    ) -> list[tuple[int, float]]:
        """The ranks past their bound, each with the seconds it has been silent."""
        now = time.monotonic()
        silent = []
        for rank in range(ranks):
            when, step, first = self._seen.get(rank, (since, -1, -1))
            # Before its first step a rank may load data and warm up for a long time.
            if step == first and now - since > first_step_timeout_s:
                silent.append((rank, now - since))
            elif step != first and now - when > hang_timeout_s:
                silent.append((rank, now - when))
        return silent


@dataclass(frozen=True)
class RankWatch:
    """What ``ProcessGroup.run`` watches its ranks for, besides their ends.

    ``heartbeats``: the ranks' signs of progress, for the hang bounds. ``stop``: set, the job
    stops for good (`JobStopped`); ``restart``: set, this attempt's ranks stop (an elastic
    script's resize). ``left_gracefully(worker)``: whether a worker that left the cluster was
    retired (an elastic job's rank hands off at its step boundary as its worker closes); such a
    rank is no failure, its result is None and the others run on. ``on_poll`` is called at
    every look at the ranks.
    """

    heartbeats: Heartbeats | None = None
    stop: "Stop | None" = None
    restart: "Stop | None" = None
    left_gracefully: Callable[[str], bool] | None = None
    on_poll: Callable[[], None] | None = None


class ProcessGroup:
    """One generation of a torch.distributed process group over Dask workers.

    The lower-level piece under `launch`, which most code never needs.

    Args:
        client: The Dask client.
        config: The `LaunchConfig`; default all defaults.
        admission: The job's hold on workers (``launch`` keeps one across its attempts);
            without one, the group asks the scheduler's queue for its workers itself, under a
            job id of its own, and gives them back at ``shutdown``.
        step_boundaries: Whether the ranks pass step boundaries (``ctx.step_done``): an
            elastic job's rank whose worker closes gracefully then hands off at the next one.
            Scripts have none: theirs stop at once.
        leave_out: Held workers not to give a rank (they failed to prepare for the job), as
            long as enough others are held.
        before_forming: Called with the workers about to form the group (to prepare them);
            returns those to form it on.
    """

    def __init__(
        self,
        client: Client,
        config: LaunchConfig | None = None,
        *,
        admission: Admission | None = None,
        step_boundaries: bool = True,
        leave_out: Collection[str] = (),
        before_forming: Callable[[list[str]], list[str]] | None = None,
    ) -> None:
        self.client = client
        self.config = config or LaunchConfig()
        self.step_boundaries = step_boundaries
        self.leave_out, self.before_forming = leave_out, before_forming
        self.spec: ProcessGroupSpec | None = None
        self._departed: set[int] = set()  # ranks whose workers left gracefully
        self._left_gracefully: Callable[[str], bool] | None = None
        self._owns_admission = admission is None
        self.admission = admission or admit(
            client, self.config, job_id=JobSpec.mint("group").job_id, name="process-group"
        )

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> Self:
        try:
            return self._start()
        except BaseException:
            if self._owns_admission:  # a group that never formed holds no workers
                self.admission.release()
            raise

    def _start(self) -> Self:
        config = self.config
        workers = self._hold_workers()
        kept = [w for w in workers if w not in self.leave_out]
        if len(kept) >= self.admission.request.minimum:
            workers = kept
        if self.before_forming is not None:
            workers = self.before_forming(workers)
        described = self.client.run(describe_worker, config.socket_ifname, workers=workers)
        backend = _resolve_backend(config.backend, {w: described[w] for w in workers})
        _check_interfaces(config.socket_ifname, {w: described[w] for w in workers})
        hosts = [get_address_host(address) for address in workers]
        spec = ProcessGroupSpec(
            generation=uuid.uuid4().hex[:12],
            ranks={address: rank for rank, address in enumerate(workers)},
            local_ranks={address: hosts[:i].count(hosts[i]) for i, address in enumerate(workers)},
            hosts=dict(zip(workers, hosts, strict=True)),
            worker_ids={address: str(described[address]["worker_id"]) for address in workers},
            # Where the peers reach rank 0: what they reach its worker at, unless told otherwise.
            master_addr=(
                config.master_addr or described[workers[0]].get("ifname_address") or hosts[0]
            ),
            master_port=int(described[workers[0]]["free_port"]),
            backend=backend,
            init_timeout_s=config.init_timeout_s,
            collective_timeout_s=config.collective_timeout_s,
            socket_ifname=config.socket_ifname,
            job_id=self.admission.request.job_id,
            elastic=config.elastic and self.step_boundaries,
            leave_timeout_s=config.leave_timeout_s,
        )
        started = time.perf_counter()
        self.spec = spec
        # For the message of a worker its nanny kills for memory: the launcher's first look at
        # the workers may come after the kill (a clean clone's run lost the limit that way).
        self._memory_limits = {w: described[w].get("memory_limit") for w in workers}
        try:
            # Registering under the job's name replaces (and tears down) its earlier generation.
            self.client.register_plugin(ProcessGroupPlugin(spec), name=spec.plugin_name)
        except Exception as error:
            # A failed rendezvous leaves torch.distributed's global state half-made in the
            # workers that got furthest; only a fresh process is sure to be clean.
            self.shutdown(abort=True)
            raise GroupFormationError(f"could not form the process group: {error}") from error
        logger.info(
            "process group %s: %d ranks, %s, master %s:%d, formed in %.2f s",
            spec.generation,
            spec.world_size,
            backend,
            spec.master_addr,
            spec.master_port,
            time.perf_counter() - started,
        )
        return self

    def shutdown(
        self, *, abort: bool = False, stuck: Iterable[str] = (), for_good: bool = False
    ) -> None:
        """Leave the group. ``abort`` (after a failure, or to stop a job) first makes every rank
        let go of it: ranks still running are stopped, finished ones leave, which ends their
        peers' pending collectives; only a worker that does not let go within
        ``launch.release_timeout_s``, and the ``stuck`` ones (a stopped process cannot answer),
        are restarted. Restarting survivors was the old way and cost each ~4 s. ``for_good``
        (Ctrl-C, the caller's stop: no attempt follows, so no survivor's memory is needed)
        waits that long only for ranks writing a checkpoint; one busy otherwise is restarted
        after ``STOPPED_RANK_GRACE_S``."""
        if self.spec is None:
            if self._owns_admission:
                self.admission.release()
            return
        spec, self.spec = self.spec, None
        if abort:
            self._release(spec, stuck=set(stuck), for_good=for_good)
        # Restarted workers are new processes: the spec's worker ids keep them out of the group,
        # whatever address they come back at. Unregistering tears the group down on the rest.
        try:
            self.client.unregister_worker_plugin(spec.plugin_name)
        except ValueError:
            pass  # nothing registered any more
        except CommClosedError as error:
            # The teardown reached a worker that had just been killed (the scheduler names
            # the dead process in its broadcast until it notices): its plugin went with it.
            logger.info(
                "process group %s: teardown missed a killed worker: %s", spec.generation, error
            )
        if self._owns_admission:
            self.admission.release()

    def _release(self, spec: ProcessGroupSpec, *, stuck: set[str], for_good: bool) -> None:
        alive = set(self._alive_workers())
        pending = [a for a in spec.ranks if a in alive and a not in stuck]
        restart = [a for a in spec.ranks if a in alive and a in stuck]
        if restart:
            # Killed before the others are released: a survivor may be waiting on a stuck
            # rank in a collective of its own, not the training's, such as the checkpoint
            # write in flight, which the stuck rank's exit ends at once (measured: a worker
            # stopped mid-write held its peer 12 s, launch.release_timeout_s x
            # STOP_WAIT_SHARE, before it was released). A stopped process cannot close
            # itself: its nanny kills it, and starts another.
            killed = self._kill_now(restart, "they stopped answering")
            restart = [w for w in restart if w not in killed]
        stopped_at = time.monotonic()
        deadline = stopped_at + self.config.release_timeout_s
        asked_to_kill: set[str] = set()  # once: a worker without a nanny waits for the deadline
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                answers = run_bounded(
                    self.client,
                    release_generation,
                    spec.generation,
                    True,
                    workers=pending,
                    timeout_s=left,
                )
            except TimeoutError:
                break  # one of them does not answer: restart them
            # A worker that left meanwhile is not in the answers: it holds nothing any more.
            pending = [
                a for a in pending if isinstance(answers.get(a), dict) and answers[a]["busy"]
            ]
            if for_good and time.monotonic() - stopped_at >= STOPPED_RANK_GRACE_S:
                unreachable = [
                    a for a in pending if not answers[a]["writing"] and a not in asked_to_kill
                ]
                asked_to_kill.update(unreachable)
                if unreachable:
                    why = (
                        f"stopped {time.monotonic() - stopped_at:.0f} s ago, they write no "
                        "checkpoint and have not let go of the group"
                    )
                    # Expected after a Ctrl-C (a rank waiting in gloo may not see its stop),
                    # and not the user's to act on: not on the terminal, unless --verbose.
                    killed = self._kill_now(unreachable, why, level=logging.INFO)
                    pending = [a for a in pending if a not in killed]
            if pending:
                time.sleep(RELEASE_POLL_S)
        restart += pending
        if restart:
            logger.warning("restarting rank workers %s: they did not let go of the group", restart)
            self.client.restart_workers(restart, timeout=60, raise_for_error=False)

    def _kill_now(self, workers: list[str], why: str, level: int = logging.WARNING) -> list[str]:
        """Kill ``workers`` through their nannies and wait until the scheduler saw them go;
        returns those killed (a worker without a nanny is left to the restart)."""
        logger.log(level, "killing rank workers %s: %s", workers, why)
        # Each worker process has a directory of its own; its replacement may come back at the
        # same address (a fixed --worker-port). The scheduler's "id" of a worker is its name.
        alive = live_workers(self.client)
        directories = {w: alive[w].get("local_directory") for w in workers if w in alive}
        killed = _kill_through_nannies(self.client, workers)
        self._await_departure(killed, directories)
        return killed

    def _await_departure(self, killed: list[str], directories: dict[str, object]) -> None:
        """Until the scheduler has seen the killed processes go (their plugins' teardown, a
        broadcast, would fail on them: the scheduler logs an error, and asyncio a "Future
        exception was never retrieved", onto the terminal of a local cluster's CLI),
        ``launch.release_timeout_s`` at most."""
        deadline = time.monotonic() + self.config.release_timeout_s
        while killed and time.monotonic() < deadline:
            alive = live_workers(self.client)
            killed = [
                w
                for w in killed
                if w in alive and alive[w].get("local_directory") == directories.get(w)
            ]
            if killed:
                time.sleep(RELEASE_POLL_S / 5)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, exc_type: object, exc: object, *_: object) -> None:
        stuck = exc.stuck if isinstance(exc, RankHung) else []
        for_good = isinstance(exc, KeyboardInterrupt) or (
            isinstance(exc, JobStopped) and exc.for_good
        )
        self.shutdown(abort=exc_type is not None, stuck=stuck, for_good=for_good)

    # -- running ---------------------------------------------------------------------------

    @property
    def workers(self) -> list[str]:
        """Worker addresses in rank order."""
        if self.spec is None:
            raise LaunchError("the process group is not started")
        return sorted(self.spec.ranks, key=self.spec.ranks.__getitem__)

    def run(
        self,
        function: Callable[..., Any],
        *args: Any,
        name: str = "rank",
        timeout_s: float | None = None,
        watch: RankWatch = RankWatch(),
    ) -> list[Any]:
        """Run ``function(*args)`` once on every rank and return the results in rank order.

        Returns when every rank finished; raises :class:`RankFailed` for the root cause as
        soon as one rank raised or its worker left the cluster, and ``TimeoutError`` after
        ``timeout_s``, and :class:`JobStopped` once ``watch.stop`` is set (for good), or
        ``watch.restart`` (this attempt only); see `RankWatch`.
        """
        assert self.spec is not None, "start() first"
        futures = [
            self.client.submit(
                function,
                *args,
                key=f"{name}-{rank}-{self.spec.generation}",
                workers=[address],
                allow_other_workers=False,
                pure=False,
            )
            for rank, address in enumerate(self.workers)
        ]
        self._departed: set[int] = set()
        self._left_gracefully = watch.left_gracefully
        self._identities: dict[str, dict] = {}  # the workers as the last look saw them
        self._paused_since: dict[int, float] = {}
        self._started: set[int] = set()
        try:
            self._watch(futures, timeout_s, watch)
            return [
                None if rank in self._departed else self._result(rank, future)
                for rank, future in enumerate(futures)
            ]
        finally:
            # All of them, the finished too: their results would otherwise stay in the
            # workers' memory until the client's garbage collector frees the futures (the
            # suppressed timeouts of the polling wait hold them in reference cycles), and the
            # next job would see that memory freed during its run (a peak 45 MiB too low).
            self.client.cancel(futures)

    def _watch(self, futures: list[Future], timeout_s: float | None, watch: RankWatch) -> None:
        submitted = time.monotonic()
        deadline = None if timeout_s is None else submitted + timeout_s
        pending = list(futures)
        while pending:
            with contextlib.suppress(TimeoutError):
                wait_futures(
                    pending, timeout_s=self.config.poll_interval_s, return_when="FIRST_COMPLETED"
                )
            # Which are done, then how they ended: a rank that fails between the two looks is
            # still pending here, and caught on the next round. The other order let a rank
            # that failed just after the look at failures pass as done, and its exception
            # reach the caller as the training code's, past the restarts (seen once in a CI
            # run of --max-restarts: the script's exit 5 was not restarted).
            undone = [rank for rank, future in enumerate(futures) if not future.done()]
            failure = self._failure(futures)
            if failure is not None:
                raise self._root_cause(futures, failure)
            # Those not done before the look, but for ranks whose workers left gracefully in it.
            pending = [futures[rank] for rank in undone if rank not in self._departed]
            if not pending:
                return
            unstartable = self._unstartable(futures, undone)
            if unstartable is not None:
                raise unstartable
            if watch.on_poll is not None:
                watch.on_poll()
            if watch.stop is not None and watch.stop.is_set():
                raise JobStopped("the job was asked to stop")
            if watch.restart is not None and watch.restart.is_set():
                raise JobStopped("the ranks stop for a resize", for_good=False)
            silent = (
                watch.heartbeats.silent_ranks(
                    len(futures),
                    since=submitted,
                    hang_timeout_s=self.config.hang_timeout_s,
                    first_step_timeout_s=self.config.first_step_timeout_s,
                )
                if watch.heartbeats
                else []
            )
            if silent:
                raise self._hung(silent)
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"the job did not finish within {timeout_s:g} s")

    def _result(self, rank: int, future: Future) -> Any:
        """A finished rank's result, fetched from its worker while the worker lives."""
        address = self.workers[rank]
        return fetch_from_worker(
            self.client,
            future,
            worker=address,
            lost=lambda: WorkerLost(
                f"rank {rank}'s worker {address} left the cluster before its result "
                "reached the client",
                rank=rank,
                worker=address,
            ),
        )

    def _failure(self, futures: list[Future]) -> RankFailed | None:
        """The first failure in sight: a rank that raised, or a worker that left."""
        failures = []
        for rank, future in enumerate(futures):
            if rank in self._departed:
                continue
            if future.status == "error":
                failures.append(self._raised(rank, future))
            elif future.status == "cancelled":
                failures.append(
                    RankFailed(
                        f"rank {rank}'s task was cancelled", rank=rank, worker=self.workers[rank]
                    )
                )
        if any(not f.infrastructure for f in failures):
            return next(f for f in failures if not f.infrastructure)
        if any(not future.done() for future in futures) or failures:
            alive = self._identities = self._alive_workers()
            for rank, address in enumerate(self.workers):
                if address in alive or rank in self._departed:
                    continue
                graceful = self._left_gracefully
                if graceful is not None and not futures[rank].done() and graceful(address):
                    # Retired: its rank stops at the step boundary with the others.
                    logger.info("rank %d's worker %s left gracefully", rank, address)
                    self._departed.add(rank)
                    continue
                why = _killed_for_memory(self.client, address, self._memory_limits.get(address))
                return WorkerLost(
                    f"rank {rank}'s worker {address} left the cluster{why}",
                    rank=rank,
                    worker=address,
                )
        return failures[0] if failures else None

    def _unstartable(self, futures: list[Future], undone: list[int]) -> LaunchError | None:
        """A rank whose task cannot start: Dask starts no task on a paused worker (its memory
        past ``distributed.worker.memory.pause``), and the rank's peers would wait for it in
        their first collective for its whole timeout, then fail as if their own code had raised.
        A pause that lifts within ``launch.paused_worker_timeout_s`` is waited out; a rank
        that runs on a worker paused by its own memory is not in question. Reads the workers'
        states from the look :meth:`_failure` just took."""
        now = time.monotonic()
        identities = self._identities
        paused = [
            rank
            for rank in undone
            if rank not in self._started
            and identities.get(self.workers[rank], {}).get("status") == "paused"
        ]
        self._paused_since = {rank: self._paused_since.get(rank, now) for rank in paused}
        overdue = [
            rank
            for rank, since in self._paused_since.items()
            if now - since >= self.config.paused_worker_timeout_s
        ]
        if not overdue:
            return None
        try:
            running = run_bounded(
                self.client,
                running_tasks,
                workers=[self.workers[rank] for rank in overdue],
                timeout_s=PROBE_MIN_S,
            )
        except TimeoutError:
            return None  # a worker that does not answer is the hang check's to find
        for rank in overdue:
            address = self.workers[rank]
            keys = running.get(address)
            if not isinstance(keys, list):
                continue  # gone: the next look finds it lost
            if str(futures[rank].key) in keys or futures[rank].done():
                self._started.add(rank)  # running, or it ran and ended since the look
                continue
            identity = identities[address]
            memory = identity.get("metrics", {}).get("memory")
            limit = identity.get("memory_limit")
            held = (
                f", its process at {memory / 2**30:.2f} GiB of its {limit / 2**30:.2f} GiB limit"
                if memory and limit
                else ""
            )
            return LaunchError(
                f"rank {rank} cannot start: its worker {address} has been paused for "
                f"{now - self._paused_since[rank]:.0f} s{held}, past "
                "distributed.worker.memory.pause, and Dask starts no task on a paused worker; "
                "free what holds that worker's memory, or give the workers more "
                "(cluster.memory_limit); launch.paused_worker_timeout_s = "
                f"{self.config.paused_worker_timeout_s:g}"
            )
        return None

    def _root_cause(self, futures: list[Future], first: RankFailed) -> RankFailed:
        """A communication error is often the echo of another rank's failure (its peer died, or
        raised and left): look a little longer for an error of the training code, or a lost
        worker, before blaming the network. A plain ``RuntimeError`` (gloo's for a lost peer,
        torch's for the code's mistakes) or a script's non-zero exit is the code's when every
        worker of the job answers."""
        if not first.infrastructure or isinstance(first, WorkerLost):
            return first
        deadline = time.monotonic() + self.config.settle_s
        while True:
            found = self._failure(futures)
            if found is not None and (not found.infrastructure or isinstance(found, WorkerLost)):
                return found
            cut_off = self._cut_off(futures)
            if cut_off is not None:
                return cut_off
            if first.cause is Cause.UNSURE and self._all_answer():
                # Nobody is gone: no peer's loss explains it, so the code raised it.
                first.infrastructure = False
                return first
            if time.monotonic() >= deadline:
                return first
            with contextlib.suppress(TimeoutError):
                pending = [f for f in futures if not f.done()]
                if pending:
                    wait_futures(
                        pending, timeout_s=RELEASE_POLL_S * 2, return_when="FIRST_COMPLETED"
                    )
                else:
                    time.sleep(RELEASE_POLL_S)

    def _cut_off(self, futures: list[Future]) -> WorkerLost | None:
        """A rank whose worker left gracefully but went before the rank handed off at a step
        boundary (its task never finished): the peers' communication error is its loss. A
        deployment that retires a worker and then kills its process at once does that
        (dask-jobqueue's scale-down SIGKILLs the batch job right after ``retire_workers``)."""
        alive = self._alive_workers() if self._departed else {}
        for rank in sorted(self._departed):
            if not futures[rank].done() and self.workers[rank] not in alive:
                return WorkerLost(
                    f"rank {rank}'s worker {self.workers[rank]} left before its rank handed "
                    "off at a step boundary",
                    rank=rank,
                    worker=self.workers[rank],
                )
        return None

    def _all_answer(self) -> bool:
        """Whether every worker of the job is in the cluster and answers (a SIGKILLed one is
        refused at once, a stopped one is given ``PROBE_MIN_S``)."""
        workers = [w for rank, w in enumerate(self.workers) if rank not in self._departed]
        if not set(workers) <= set(self._alive_workers()):
            return False
        return len(answering_workers(self.client, workers, timeout_s=PROBE_MIN_S)) == len(workers)

    def _hung(self, silent: list[tuple[int, float]]) -> RankHung:
        """The hang, blamed on the silent ranks whose workers do not answer either: a rank
        waiting in a collective for a stopped peer is silent too, but its worker answers."""
        workers = [self.workers[rank] for rank, _ in silent]
        # At least a second: with settle_s = 0 every live worker would count as stopped.
        bound = max(self.config.settle_s, PROBE_MIN_S)
        answering = answering_workers(self.client, workers, timeout_s=bound)
        stuck = [(r, s) for r, s in silent if self.workers[r] not in answering] or silent[:1]
        rank, seconds = stuck[0]
        return RankHung(
            f"rank {rank} on worker {self.workers[rank]} made no progress for "
            f"{seconds:.0f} s (launch.hang_timeout_s = {self.config.hang_timeout_s:g})",
            rank=rank,
            worker=self.workers[rank],
            stuck=[self.workers[r] for r, _ in stuck if self.workers[r] not in answering],
        )

    def _raised(self, rank: int, future: Future) -> RankFailed:
        error = future.exception()
        traceback = future.traceback()
        if error is not None and traceback is not None:
            error = error.with_traceback(traceback)
        cause = cause_of(error)
        return RankFailed(
            f"rank {rank} on worker {self.workers[rank]} failed: {type(error).__name__}: {error}",
            rank=rank,
            worker=self.workers[rank],
            infrastructure=cause is not Cause.CODE,
            error=error,
            cause=cause,
        )

    # -- choosing workers -------------------------------------------------------------------

    def _alive_workers(self) -> dict[str, dict]:
        """The scheduler's workers now: address -> identity (``status``, ``memory_limit``,
        ``metrics``)."""
        return live_workers(self.client)

    def _hold_workers(self) -> list[str]:
        return hold_workers(self.client, self.admission, self.config.workers)


def _killed_for_memory(client: Client, address: str, limit: int | None) -> str:
    """``": its nanny restarted it ..."`` when the worker at ``address`` was restarted by its
    nanny past its memory ``limit`` (bytes; None: none known), from the
    ``worker-restart-memory`` event the nanny logs with the scheduler before it ends the
    process; else ``""``."""
    try:
        events = client.get_events("worker-restart-memory")
    except Exception:  # a cause to add to a message, never a failure of its own
        return ""
    rss = next((e.get("rss") for _, e in reversed(events) if e.get("worker") == address), None)
    if not rss:
        return ""
    of_limit = f", {rss / limit:.0%} of its {limit / 2**30:.2f} GiB limit" if limit else ""
    return (
        f": its nanny restarted it, its process at {rss / 2**30:.2f} GiB{of_limit} "
        "(distributed.worker.memory.terminate); give the workers more memory "
        "(cluster.memory_limit) or split the model (`dask-train plan` estimates a rank's peak)"
    )


def fetch_from_worker(
    client: Client, future: Future, *, worker: str, lost: Callable[[], Exception]
) -> Any:
    """The result of ``future``, finished on ``worker``, fetched from it as long as it lives
    (a result of gigabytes takes its time); ``lost()`` is raised if the worker leaves first
    (its nanny killed it past its memory limit): Dask would wait for the result forever, as
    the task may run on that worker alone.

    The fetch runs on a thread of its own: a ``result(timeout=...)`` that times out cancels
    the transfer under way, and the next would start it again from nothing. The job's end
    cancels the futures, which ends a fetch left waiting.

    Fetched from the worker directly where the client reaches it (Dask falls back to the
    scheduler where not): passed through the scheduler, a pickled result of 800 MB took
    another 1.5 GiB on its worker while it was sent (measured: 865 to 2,442 MiB RSS;
    directly, nothing)."""
    fetched: dict[str, Any] = {}

    def fetch() -> None:
        try:
            fetched["value"] = client.gather(future, direct=True)
        except BaseException as error:  # handed to the caller's thread
            fetched["error"] = error

    thread = threading.Thread(target=fetch, name=f"dask-train-fetch-{future.key}", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(RESULT_POLL_S)
        if thread.is_alive() and worker not in live_workers(client):
            raise lost()
    if "error" in fetched:
        raise fetched["error"]
    return fetched["value"]


def hold_workers(client: Client, admission: Admission, selection: WorkerSelection) -> list[str]:
    """The job's workers from the scheduler's queue (waiting for them), in rank order; the
    queue's refusals as the launcher's errors."""
    try:
        granted = admission.hold()
    except AdmissionStopped as error:
        raise JobStopped(str(error)) from None
    except (QueueTimeout, TooFewWorkers) as error:
        raise LaunchError(str(error)) from None
    except HoldLost as error:
        raise GroupFormationError(str(error)) from None
    info = live_workers(client)
    return select_workers({a: info[a] for a in granted if a in info}, selection)


def ranks_for(client: Client, config: LaunchConfig) -> int:
    """How many ranks a fixed job of ``config`` has, as :func:`requested_ranks` decides it
    (``train`` resolves its run's size with it before the job asks the queue)."""
    low, high = requested_ranks(client, config)
    if low != high:
        raise LaunchError(
            f"launch.world_size: the range {low}:{high} has no single size here; this path "
            "runs a fixed number of ranks"
        )
    return low


def requested_ranks(client: Client, config: LaunchConfig) -> tuple[int, int]:
    """The fewest and the most ranks a job of ``config`` runs on: ``config.world_range``, or
    every worker of its selection the cluster has now (at least one). The one place a job's
    size is decided: :func:`admit` puts it in the job's `Request` to the queue, whose
    ``world_size`` the job's other parts read (``JobHold.world_size``: where its Dask
    collections are placed)."""
    if config.world_range is not None:
        return config.world_range
    every = max(1, len(select_workers(live_workers(client), config.workers)))
    return every, every


def admit(
    client: Client,
    config: LaunchConfig,
    *,
    job_id: str,
    name: str,
    on_queued: Callable[[dict[str, Any]], None] | None = None,
    stop: threading.Event | None = None,
) -> Admission:
    """A job's place in the scheduler's queue: ``config.world_size`` workers of its selection
    (none: every eligible worker the cluster has now)."""
    low, high = requested_ranks(client, config)
    request = Request(
        job_id=job_id,
        name=name,
        client=client.id,
        minimum=low,
        maximum=high,
        priority=config.priority,
        elastic=config.elastic,
        selection=config.workers,
        lease_s=config.lease_s,
        plugins=(plugin_name(job_id),),
        capacity=None
        if config.workers.resources or config.workers.name_pattern
        else most_workers(client),
    )
    return Admission(
        client,
        request,
        Waits(queue_timeout_s=config.queue_timeout_s, worker_wait_s=config.worker_wait_s),
        on_queued=on_queued,
        stop=stop,
    )


def select_workers(info: dict[str, dict[str, Any]], selection: WorkerSelection) -> list[str]:
    """The eligible workers in rank order (``workflows.jobs.admission.rank_order``)."""
    eligible = [address for address, identity in info.items() if selection.matches(identity)]
    return sorted(
        eligible,
        key=lambda a: rank_order(
            info[a].get("host") or get_address_host(a), info[a].get("name"), a
        ),
    )


def _check_interfaces(ifname: str | None, described: dict[str, dict[str, Any]]) -> None:
    if ifname is None:
        return
    for address, description in described.items():
        missing = [name for name in ifname.split(",") if name not in description["interfaces"]]
        if missing:
            raise LaunchError(
                f"launch.socket_ifname: worker {address} has no interface {missing[0]!r} (it "
                f"has {', '.join(description['interfaces'])}); name one every chosen worker has"
            )


def _resolve_backend(requested: str, described: dict[str, dict[str, Any]]) -> str:
    without_gpu = [address for address, d in described.items() if not d["cuda_devices"]]
    if requested == "auto":
        return "gloo" if without_gpu else "nccl"
    if requested == "nccl" and without_gpu:
        raise LaunchError(
            f"launch.backend: nccl needs a GPU on every rank, but {len(without_gpu)} of the "
            f"chosen workers have none ({', '.join(without_gpu)}); use backend = 'gloo' or 'auto'"
        )
    return requested


def answering_workers(client: Client, workers: list[str], *, timeout_s: float) -> set[str]:
    """The workers among ``workers`` whose event loop answers within ``timeout_s``."""

    async def answers(worker: str) -> bool:
        try:
            # Called in the client's event loop, Client.run gives the coroutine to await.
            await asyncio.wait_for(client.run(_answer, workers=[worker]), timeout_s)
        except Exception:  # no answer in time, or gone
            return False
        return True

    async def all_of_them() -> list[bool]:
        return await asyncio.gather(*(answers(worker) for worker in workers))

    return {w for w, ok in zip(workers, client.sync(all_of_them), strict=True) if ok}


def _answer() -> bool:
    return True


def _kill_through_nannies(client: Client, workers: list[str]) -> list[str]:
    """SIGKILL the processes of ``workers`` from their nannies, which start new ones at once
    (a stopped process would spend Dask's 4 s grace before its restart); returns the workers
    killed. The others (no nanny to do it) are left for ``Client.restart_workers``."""
    try:
        done = client.run(_kill_worker_process, workers=workers, nanny=True, on_error="return")
    except Exception:
        return []
    return [w for w in workers if done.get(w) is True]


class _DeliberateKills(logging.Filter):
    """On a nanny's process: drops the nanny's "Restarting worker" warning for a worker process
    the launcher killed, which already logged why (a local cluster's nannies run in the CLI, so
    it reached the terminal of a Ctrl-C'd ``dask-train run``). One warning per kill, the next
    one, whichever nanny of the process says it (Dask's record does not name the worker), and
    only within ``EXPECTED_S``: a nanny that closes meanwhile says nothing, and a later restart
    of another cause must still be told."""

    RESTARTING = "Restarting worker"  # distributed.nanny's message as its process exits
    EXPECTED_S = 60.0  # the nanny notices the exit within a second or so

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()
        self._until: list[float] = []  # one deadline per kill not yet heard of

    def expect(self) -> None:
        with self._lock:
            if not self._until:
                logging.getLogger("distributed.nanny").addFilter(self)
            self._until.append(time.monotonic() + self.EXPECTED_S)

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith(self.RESTARTING):
            return True
        with self._lock:
            now = time.monotonic()
            self._until = [until for until in self._until if until > now]
            expected = bool(self._until)
            if expected:
                self._until.pop(0)
            if not self._until:
                logging.getLogger("distributed.nanny").removeFilter(self)
        return not expected


_deliberate_kills = _DeliberateKills()


def _kill_worker_process(dask_worker: Any) -> bool:
    """Run on a nanny: SIGKILL its worker process (its nanny then starts another)."""
    import os
    import signal

    pid = worker_process_pid(dask_worker)
    if pid is None:
        return False
    _deliberate_kills.expect()
    os.kill(pid, signal.SIGKILL)
    return True


def run_bounded(
    client: Client, function: Callable[..., Any], *args: Any, workers: list[str], timeout_s: float
) -> dict[str, Any]:
    """``Client.run`` on those of ``workers`` the scheduler still has, with a bound:
    ``TimeoutError`` when one does not answer in time (a stopped process); one that failed maps
    to its exception, one that left is absent from the answers.

    A gone worker is not asked: Dask retries its address for its connect timeout (30 s), so
    the call would wait out its whole bound (measured: a job that lost a worker failed 5.9 s
    after the loss, its controller waiting 5 s to tell the gone worker to drop what the job
    kept; 0.93 s without)."""
    alive = live_workers(client)
    present = [w for w in workers if w in alive]
    if not present:
        return {}

    async def call() -> dict[str, Any]:
        # In the client's event loop: Client.run gives the coroutine to await.
        return await client.run(function, *args, workers=present, on_error="return")

    return client.sync(asyncio.wait_for, call(), timeout_s)
