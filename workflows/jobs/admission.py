"""Admission to a shared cluster: which job holds which workers, and who waits for them.

A Dask cluster is shared: notebooks, scheduled runs, batch inference and sweep trials ask for
workers at once. The queue lives on the scheduler (:class:`WorkerQueue`, a scheduler plugin),
so every client sees the same one. A job asks for ``minimum`` workers of its selection (up to
``maximum``, for elastic jobs such as batch inference); it gets them when they are free and no
job that asked earlier still waits for any of them (first come, first served, with no job ever
overtaking an earlier one on a worker that job could use). A worker is held by at most one job:
one rank of one job per worker, and on a GPU worker that rank owns the GPU.

Holding survives only a live client. Each hold is a lease the client renews
(:class:`Admission` does it from a thread); the scheduler drops the holds of a client that
disconnects at once, and of one that stops renewing (a frozen notebook) after ``lease_s``. A
dropped hold first tears the job's worker plugins down (which stops its ranks), then frees its
workers.

On an adaptive deployment the workers that waiting jobs need count in the scheduler's adaptive
target, so the cluster grows for them; a fixed job's workers are never chosen to be retired.

Elastic jobs (``Request.elastic``: ``launch.world_size = "min:max"``) hold between ``minimum``
and ``maximum`` workers. Workers nobody waits for go to running elastic jobs below their
maximum; a waiting job that free workers cannot serve asks elastic jobs of no higher priority
for those above their minimum (``yielding``); a held worker that closes gracefully is marked
``retiring``. The job's holder follows its entry (``watch``), stops its ranks at their next
step boundary, and gives the workers back by asking again (``request``). Waiting jobs are served
by priority, then first come, first served. A worker a job cannot use (it failed to prepare
for the job) is handed back (``hand_back``): freed for others, and not granted to that job again
while its process lives.
"""

import asyncio
import contextlib
import logging
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from distributed import Client, Scheduler, SchedulerPlugin, Status

from workers.compat.distributed_private import raise_adaptive_target
from workers.spec.launch import WorkerSelection
from workflows.observe.monitoring import QUEUE_PLUGIN_NAME

if TYPE_CHECKING:
    from distributed.scheduler import WorkerState


logger = logging.getLogger(__name__)

# A worker on its way out is granted to nobody.
LEAVING = frozenset({Status.closing_gracefully, Status.closing, Status.closed})
EXPIRY_CHECK_S = 0.5  # how often the scheduler looks for leases that ran out
TEARDOWN_TIMEOUT_S = 30.0  # a dropped job's worker plugins get this long to let go
LONG_POLL_S = 1.0  # one wait on the scheduler; the client checks its own bounds in between
# Every call to the queue is bounded: a scheduler that does not answer (gone, or too busy) is an
# error, never a hang. Giving workers back is bounded tighter: the scheduler also frees them when
# the client goes away, so a release that cannot get through only waits for that.
SCHEDULER_CALL_TIMEOUT_S = 30.0
RELEASE_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class Request:
    """What a job asks the queue for; made on the client, checked there."""

    job_id: str
    name: str
    client: str
    minimum: int
    maximum: int
    selection: WorkerSelection
    lease_s: float = 20.0
    # Worker plugins of the job, removed when its holder goes away without releasing.
    plugins: tuple[str, ...] = ()
    # The most workers the cluster can ever have, where the client knows it (a local cluster
    # it started, or its adaptive maximum): a job needing more fails at once.
    capacity: int | None = None
    # Served before jobs of lower priority; may shrink elastic jobs of lower or equal priority.
    priority: int = 0
    # The holder resizes while it runs (an elastic launch): it grows into workers that become
    # free, and gives back those above its minimum at its next step boundary. Otherwise it
    # keeps what it was granted (up to ``maximum``) until it releases them.
    elastic: bool = False

    def __post_init__(self) -> None:
        if not 1 <= self.minimum <= self.maximum:
            raise ValueError(f"a job needs 1 <= minimum <= maximum workers, got {self}")
        if self.lease_s <= 0:
            raise ValueError(f"launch.lease_s: must be positive, got {self.lease_s}")

    @property
    def world_size(self) -> int:
        """A fixed job's number of ranks, as its request decided it (one size: ``minimum`` is
        ``maximum``; see `workflows.jobs.launcher.requested_ranks`)."""
        if self.elastic or self.minimum != self.maximum:
            raise ValueError(
                f"job {self.job_id}: {self.minimum}:{self.maximum} workers is a range, not one "
                "world size"
            )
        return self.minimum

    def eligible(self, worker: Any) -> bool:
        """Whether a scheduler's WorkerState may hold one of this job's ranks."""
        return self.selection.matches({"resources": worker.resources, "name": worker.name})


@dataclass
class _Entry:
    request: Request
    arrived: float
    lease_until: float
    granted: list[str] = field(default_factory=list)
    granted_at: float | None = None
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    draining: bool = False  # its holder went away; its plugins are being torn down
    teardown: "asyncio.Future[None] | None" = None
    # An elastic job's workers it is asked to give up at its next step boundary: for a queued
    # job (yielded), or because the worker is closing gracefully (retired).
    yielding: set[str] = field(default_factory=set)
    retiring: set[str] = field(default_factory=set)
    retired: set[str] = field(default_factory=set)  # left while retiring: not failures
    version: int = 0  # raised at every change its holder must act on
    # An elastic job can use a worker beyond its world only by resizing: its holder says so
    # (``resizes``) once its ranks passed a step boundary, or at once for a script, which
    # restarts. Until then it is neither given free workers nor asked for its own.
    resizes: bool = False
    # Workers handed back because they failed to prepare for the job: never granted to it
    # again while their process lives. Asked again, a live worker fails the same way (its
    # environment does not change: a library it cannot load, a store it cannot reach) after up
    # to launch.init_timeout_s each time, while held idle; one that restarts is a fresh process
    # that may succeed (`remove_worker` forgets it), and other jobs may use it meanwhile.
    refused: set[str] = field(default_factory=set)

    def changed_now(self) -> None:
        self.version += 1
        self.changed.set()

    @property
    def waiting(self) -> bool:
        return not self.draining and len(self.granted) < self.request.minimum


class WorkerQueue(SchedulerPlugin):
    """The scheduler's record of held workers and waiting jobs (see the module's text)."""

    name = QUEUE_PLUGIN_NAME
    idempotent = True  # every job registers it; the first registration stays

    def __init__(self) -> None:
        self.entries: dict[str, _Entry] = {}  # in order of arrival

    async def start(self, scheduler: Scheduler) -> None:
        from tornado.ioloop import PeriodicCallback

        self.scheduler = scheduler
        self._expiry = PeriodicCallback(self._expire, EXPIRY_CHECK_S * 1000)
        self._expiry.start()
        # cluster.adapt() asks the scheduler how many workers it wants: the jobs' demand is a
        # floor under that (held workers are kept from retiring below).
        raise_adaptive_target(scheduler, self.demand)

    async def close(self) -> None:
        self._expiry.stop()

    # -- what clients call (through the functions below, with Client.run_on_scheduler) -----

    def request(self, request: Request) -> dict[str, Any]:
        entry = self.entries.get(request.job_id)
        now = time.monotonic()
        if entry is None:
            entry = _Entry(request, arrived=time.time(), lease_until=now + request.lease_s)
            self.entries[request.job_id] = entry
        else:  # asking again (after losing a worker) keeps the job's place in the line
            entry.request, entry.lease_until = request, now + request.lease_s
            # A new attempt: the workers it was asked to give up are given up now, and what
            # left gracefully before is no longer news.
            leaving = entry.yielding | entry.retiring
            entry.granted = [w for w in entry.granted if w not in leaving]
            entry.yielding, entry.retired = set(), set()
        self._grant()
        return self.status(request.job_id)

    async def wait(self, job_id: str, timeout_s: float) -> dict[str, Any]:
        entry = self.entries.get(job_id)
        if entry is not None and entry.waiting:
            entry.changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(entry.changed.wait(), timeout_s)
        return self.status(job_id)

    async def watch(self, job_id: str, version: int, timeout_s: float) -> dict[str, Any]:
        """The job's status once its version differs from ``version`` (a worker granted,
        asked back, retiring), or after ``timeout_s``."""
        entry = self.entries.get(job_id)
        if entry is not None and entry.version == version:
            entry.changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(entry.changed.wait(), timeout_s)
        return self.status(job_id)

    def resizes(self, job_id: str) -> None:
        """The job's ranks resize when asked (they passed a step boundary): from now on it may
        grow into free workers, and give back those above its minimum."""
        entry = self.entries.get(job_id)
        if entry is not None and not entry.resizes:
            entry.resizes = True
            self._grant()

    def hand_back(self, job_id: str, workers: list[str]) -> None:
        """The job cannot use ``workers`` (they failed to prepare for it): free them for other
        jobs, and grant them to this one no more while their process lives."""
        entry = self.entries.get(job_id)
        if entry is None or entry.draining:
            return
        entry.refused |= set(workers)
        entry.granted = [w for w in entry.granted if w not in entry.refused]
        entry.yielding -= entry.refused
        entry.retiring -= entry.refused
        entry.changed_now()
        self._grant()

    def renew(self, job_id: str) -> bool:
        entry = self.entries.get(job_id)
        if entry is None or entry.draining:
            return False
        entry.lease_until = time.monotonic() + entry.request.lease_s
        return True

    def release(self, job_id: str) -> None:
        entry = self.entries.get(job_id)
        if entry is None or entry.draining:  # a dropped hold frees its workers once torn down
            return
        del self.entries[job_id]
        self._grant()

    def status(self, job_id: str) -> dict[str, Any]:
        entry = self.entries.get(job_id)
        if entry is None:
            return {"known": False, "granted": [], "waiting": False}
        request = entry.request
        eligible = [w for w in self.scheduler.workers.values() if request.eligible(w)]
        ahead = [e for e in self.entries.values() if e is not entry and e.arrived < entry.arrived]
        return {
            "known": True,
            "granted": list(entry.granted),
            "waiting": entry.waiting,
            "lost": entry.draining,
            "eligible": len(eligible),
            "position": sum(e.waiting for e in ahead),
            "holders": self.holders({w.address for w in eligible}, exclude=job_id),
            "version": entry.version,
            "yielding": sorted(entry.yielding),
            "retiring": sorted(entry.retiring),
            "retired": sorted(entry.retired),
        }

    def holders(self, workers: set[str] | None = None, exclude: str = "") -> list[dict[str, Any]]:
        """The jobs holding workers (of ``workers``, if given): name, since when, how many."""
        return [
            {
                "job_id": job_id,
                "name": entry.request.name,
                "workers": len(entry.granted),
                "since": entry.granted_at,
            }
            for job_id, entry in self.entries.items()
            if entry.granted
            and job_id != exclude
            and (workers is None or set(entry.granted) & workers)
        ]

    def queued(self) -> list[dict[str, Any]]:
        """The jobs waiting, in the order they will be served."""
        return [
            {
                "job_id": job_id,
                "name": entry.request.name,
                "wanted": entry.request.minimum,
                "since": entry.arrived,
            }
            for job_id, entry in self._in_serving_order()
            if entry.waiting
        ]

    def _in_serving_order(self) -> list[tuple[str, "_Entry"]]:
        # Higher priority first; among equals, first come first served (dicts keep arrival).
        return sorted(self.entries.items(), key=lambda item: -item[1].request.priority)

    def demand(self) -> int:
        """Workers the jobs hold or wait for: what an adaptive cluster should have."""
        # An elastic job's workers above its minimum are the cluster's to take back.
        return sum(
            e.request.minimum if e.request.elastic else max(e.request.minimum, len(e.granted))
            for e in self.entries.values()
        )

    # -- granting ---------------------------------------------------------------------------

    def _grant(self) -> None:
        held = {w for entry in self.entries.values() for w in entry.granted}
        # In rank order, so that on an idle cluster a job gets the workers the launcher ranks
        # first (those its Dask collections were placed on); paused workers last: Dask starts
        # no task on one (its memory past distributed.worker.memory.pause), so a rank there
        # could not start (the launcher fails such a job, naming the worker).
        free = sorted(
            (
                w
                for w in self.scheduler.workers.values()
                if w.address not in held and w.status not in LEAVING
            ),
            key=lambda w: (w.status == Status.paused, rank_order(w.host, w.name, w.address)),
        )
        serving = [entry for _, entry in self._in_serving_order()]
        asked_back: dict[str, set[str]] = {}  # job id -> workers a waiting job needs from it
        for entry in serving:
            if not entry.waiting:
                continue
            usable = [w for w in free if self._usable(entry, w)]
            missing = entry.request.minimum - len(entry.granted)
            if len(usable) >= missing:
                room = entry.request.maximum - len(entry.granted)
                taken = [w.address for w in usable[:room]]
                entry.granted += taken
                entry.granted_at = entry.granted_at or time.time()
                entry.changed_now()
                free = [w for w in free if w.address not in taken]
                continue
            # Not enough free: elastic jobs above their minimum give up the rest at their
            # next step boundary, if together they can.
            offers = self._offers(entry, asked_back)
            if len(usable) + len(offers) >= missing:
                for job_id, address in offers[: missing - len(usable)]:
                    asked_back.setdefault(job_id, set()).add(address)
            # Nobody who asked later may take what this job could use: it would wait for
            # ever behind a stream of smaller jobs.
            free = [w for w in free if w not in usable]
        for job_id, entry in self.entries.items():
            wanted = asked_back.get(job_id, set())
            if wanted != entry.yielding:
                entry.yielding = wanted
                entry.changed_now()
        # What nobody waits for goes to running elastic jobs below their maximum that resize.
        for entry in serving:
            request = entry.request
            if entry.waiting or entry.draining or not request.elastic or entry.yielding:
                continue
            if not entry.resizes:  # it would hold the worker idle, never stopping to take it
                continue
            room = request.maximum - len(entry.granted)
            taken = [w.address for w in free if self._usable(entry, w)][: max(room, 0)]
            if taken:
                entry.granted += taken
                entry.changed_now()
                free = [w for w in free if w.address not in taken]

    def _offers(self, waiting: _Entry, asked_back: dict[str, set[str]]) -> list[tuple[str, str]]:
        """Workers running elastic jobs could give ``waiting``: each job's above its
        minimum, its highest ranks first, from jobs of no higher priority than the waiting
        one's; never a fixed-size job's."""
        offers = []
        for job_id, holder in self.entries.items():
            request = holder.request
            if (
                holder is waiting
                or holder.draining
                or holder.waiting
                or not request.elastic
                or not holder.resizes  # it would never stop to give one back
                or request.priority > waiting.request.priority
            ):
                continue
            promised = asked_back.get(job_id, set())
            spare = len(holder.granted) - len(holder.retiring) - request.minimum - len(promised)
            candidates = [
                w
                for w in reversed(holder.granted)
                if w not in promised
                and w not in holder.retiring
                and (ws := self.scheduler.workers.get(w)) is not None
                and self._usable(waiting, ws)
            ]
            offers += [(job_id, w) for w in candidates[: max(spare, 0)]]
        return offers

    @staticmethod
    def _usable(entry: _Entry, worker: "WorkerState") -> bool:
        """Whether ``entry``'s job may be granted ``worker``: of its selection, not refused."""
        return entry.request.eligible(worker) and worker.address not in entry.refused

    def add_worker(self, scheduler: Scheduler, worker: str) -> None:
        self._grant()

    def valid_workers_downscaling(
        self, scheduler: Scheduler, workers: list["WorkerState"]
    ) -> list["WorkerState"]:
        """The workers ``cluster.adapt()`` may retire: free ones, and an elastic job's above
        its minimum, if it resizes (it hands their ranks off at its next step boundary as they
        close)."""
        allowed = []
        spare = {
            job_id: len(e.granted) - len(e.retiring) - e.request.minimum
            for job_id, e in self.entries.items()
            if e.request.elastic and e.resizes and not e.waiting and not e.draining
        }
        holder = {w: job_id for job_id, e in self.entries.items() for w in e.granted}
        for ws in workers:
            job_id = holder.get(ws.address)
            if job_id is None:
                allowed.append(ws)
            elif spare.get(job_id, 0) > 0:
                spare[job_id] -= 1
                allowed.append(ws)
        return allowed

    def log_event(self, topic: Any, msg: Any) -> None:
        """A held worker closing gracefully (retired, scaled down, closed on SIGTERM): its
        job is told, and hands the rank off before the worker goes."""
        if not isinstance(msg, dict) or msg.get("action") != "worker-status-change":
            return
        closing = msg.get("status") in ("closing_gracefully", "closing")
        for entry in self.entries.values():
            if topic in entry.granted and (topic in entry.retiring) != closing:
                if closing:
                    entry.retiring.add(topic)
                else:  # a retirement that was called off
                    entry.retiring.discard(topic)
                entry.changed_now()

    def remove_worker(self, scheduler: Scheduler, worker: str, **kwargs: Any) -> None:
        for entry in self.entries.values():
            entry.refused.discard(worker)  # back at this address, it is a fresh process
            if worker in entry.granted:
                entry.granted.remove(worker)  # the job asks again for its next attempt
                if worker in entry.retiring:
                    entry.retiring.discard(worker)
                    entry.retired.add(worker)
                entry.yielding.discard(worker)
                entry.changed_now()
        self._grant()

    def remove_client(self, scheduler: Scheduler, client: str) -> None:
        for entry in list(self.entries.values()):
            if entry.request.client == client and not entry.draining:
                self._drop(entry, f"its client {client} disconnected")

    def _expire(self) -> None:
        now = time.monotonic()
        for entry in list(self.entries.values()):
            if entry.lease_until < now and not entry.draining:
                self._drop(entry, f"its lease ran out ({entry.request.lease_s:g} s unrenewed)")

    def _drop(self, entry: _Entry, reason: str) -> None:
        request = entry.request
        logger.warning(
            "dask-train: dropping job %s's hold on %s: %s", request.job_id, entry.granted, reason
        )
        entry.draining = True
        entry.changed.set()
        entry.teardown = asyncio.ensure_future(self._tear_down(entry))

    async def _tear_down(self, entry: _Entry) -> None:
        # The workers go back to the pool only once the job's ranks have let go of them.
        try:
            for name in entry.request.plugins:
                if name in self.scheduler.worker_plugins:
                    with contextlib.suppress(Exception):
                        await asyncio.wait_for(
                            self.scheduler.unregister_worker_plugin(None, name), TEARDOWN_TIMEOUT_S
                        )
        finally:
            if self.entries.get(entry.request.job_id) is entry:
                del self.entries[entry.request.job_id]
            self._grant()


def rank_order(host: str, name: object, address: str) -> tuple[Any, ...]:
    """Workers' rank order: by host, so that each host's workers get consecutive ranks, then
    by name in natural order (dask-cuda names workers by device id: 2 before 10)."""
    natural = [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", str(name))]
    return (host, natural, address)


# -- run on the scheduler with Client.run_on_scheduler ------------------------------------


def _queue(scheduler: Scheduler) -> WorkerQueue:
    return scheduler.plugins[QUEUE_PLUGIN_NAME]


async def _install_queue(dask_scheduler: Scheduler) -> None:
    # Client.register_plugin, with the bound every call to the queue has (see Admission._ask).
    await dask_scheduler.register_scheduler_plugin(
        WorkerQueue(), name=QUEUE_PLUGIN_NAME, idempotent=True
    )


def _request(request: Request, dask_scheduler: Scheduler) -> dict[str, Any]:
    return _queue(dask_scheduler).request(request)


async def _watch(
    job_id: str, version: int, timeout_s: float, dask_scheduler: Scheduler
) -> dict[str, Any]:
    return await _queue(dask_scheduler).watch(job_id, version, timeout_s)


def _status(job_id: str, dask_scheduler: Scheduler) -> dict[str, Any]:
    return _queue(dask_scheduler).status(job_id)


async def _wait(job_id: str, timeout_s: float, dask_scheduler: Scheduler) -> dict[str, Any]:
    queue = _queue(dask_scheduler)
    queue.renew(job_id)
    return await queue.wait(job_id, timeout_s)


def _resizes(job_id: str, dask_scheduler: Scheduler) -> None:
    _queue(dask_scheduler).resizes(job_id)


def _hand_back(job_id: str, workers: list[str], dask_scheduler: Scheduler) -> None:
    _queue(dask_scheduler).hand_back(job_id, workers)


def _renew(job_id: str, dask_scheduler: Scheduler) -> bool:
    return _queue(dask_scheduler).renew(job_id)


def _release(job_id: str, dask_scheduler: Scheduler) -> None:
    _queue(dask_scheduler).release(job_id)


# -- the client's side ------------------------------------------------------------------------


class AdmissionError(RuntimeError):
    """The job did not get its workers; the message says why and what to change."""


class QueueTimeout(AdmissionError):
    """The job waited ``launch.queue_timeout_s`` for its workers (or, after losing one,
    ``launch.worker_wait_s`` for a replacement)."""


class TooFewWorkers(AdmissionError):
    """The cluster has fewer eligible workers than the job needs, held or not."""


class HoldLost(AdmissionError):
    """The scheduler dropped the job's hold (its lease ran out)."""


class AdmissionStopped(AdmissionError):
    """The job's ``stop`` event was set while it waited."""


@dataclass(frozen=True)
class Waits:
    """How long a job's `Admission` waits: at most ``queue_timeout_s`` in the queue the first
    time (the setting named ``queue_field`` in its message), ``worker_wait_s`` for a lost
    worker's replacement, and ``call_timeout_s`` for each call to the scheduler (beyond what it
    waits there on purpose)."""

    queue_timeout_s: float
    worker_wait_s: float
    queue_field: str = "launch.queue_timeout_s"
    call_timeout_s: float = SCHEDULER_CALL_TIMEOUT_S


class Admission:
    """One job's place in the queue and hold on workers: a lifecycle object.

    ``hold()`` returns the job's workers, waiting in the queue for them when they are held by
    others (within ``waits``, see `Waits`); ``release()`` gives them back. While it holds
    workers, a thread renews the lease. ``on_queued(status)`` is called once, when the job
    first has to wait.
    """

    def __init__(
        self,
        client: Client,
        request: Request,
        waits: Waits,
        *,
        on_queued: Callable[[dict[str, Any]], None] | None = None,
        stop: threading.Event | None = None,
    ) -> None:
        self.client, self.request = client, request
        self.call_timeout_s = waits.call_timeout_s
        self.queue_field = waits.queue_field
        self.queue_timeout_s, self.worker_wait_s = waits.queue_timeout_s, waits.worker_wait_s
        self.on_queued, self.stop = on_queued, stop
        self.waited_s = 0.0
        self._held = False
        self._ended = threading.Event()
        self._renewer: threading.Thread | None = None
        self.queued_once = False

    def hold(self) -> list[str]:
        """The job's workers, at least ``minimum`` of them (waiting for them if need be)."""
        first = not self._held
        capacity = self.request.capacity
        if first and capacity is not None and self.request.minimum > capacity:
            raise TooFewWorkers(self._too_few(capacity, waited=False))
        if first:
            self._ask(_install_queue)
        try:
            # Held from the moment the request is sent: one that fails on the way (a scheduler
            # that answers too late) may still be applied there, and is given back all the same.
            self._held = True
            status = self._ask(_request, self.request)
            if first:
                self._start_renewing()
            if status["waiting"]:
                status = self._wait(status, first=first)
            return list(status["granted"])
        except BaseException:
            self.release()  # Ctrl-C, a timeout, a refusal: nothing stays on the scheduler
            raise

    def _wait(self, status: dict[str, Any], *, first: bool) -> dict[str, Any]:
        started = time.monotonic()
        bound = self.queue_timeout_s if first else self.worker_wait_s
        too_few_since: float | None = None
        while status["waiting"]:
            if status.get("lost"):
                raise HoldLost(f"job {self.request.job_id} lost its hold on the workers")
            now = time.monotonic()
            if status["eligible"] < self.request.minimum:
                # Not a queue: the cluster lacks the workers (still starting, or adapting).
                too_few_since = too_few_since or now
                if now - too_few_since > self.worker_wait_s:
                    raise TooFewWorkers(self._too_few(status["eligible"], waited=True))
            else:
                too_few_since = None
                if not self.queued_once:
                    self.queued_once = True
                    logger.warning(self.describe_wait(status))
                    if self.on_queued is not None:
                        self.on_queued(status)
            if self.stop is not None and self.stop.is_set():
                raise AdmissionStopped("the job was asked to stop while it waited for workers")
            left = bound - (now - started)
            if left <= 0 and too_few_since is None:
                raise QueueTimeout(self._timed_out(status, bound, first=first))
            poll_s = max(0.05, min(LONG_POLL_S, left))
            status = self._ask(_wait, self.request.job_id, poll_s, timeout_s=poll_s)
        self.waited_s += time.monotonic() - started
        return status

    def _ask(self, function: Callable[..., Any], *args: Any, timeout_s: float = 0.0) -> Any:
        """Call ``function`` on the scheduler; ``timeout_s`` is how long it may itself wait
        there, on top of the bound every call has."""
        bound = timeout_s + self.call_timeout_s
        try:
            return self.client.run_on_scheduler(function, *args, callback_timeout=bound)
        except TimeoutError as error:
            raise AdmissionError(
                f"the scheduler did not answer the queue ({function.__name__.strip('_')}) "
                f"within {bound:g} s; it is gone or overloaded"
            ) from error

    def status(self) -> dict[str, Any]:
        """The job's entry as the queue sees it now (granted, yielding, retiring, retired)."""
        return self._ask(_status, self.request.job_id)

    def resizes(self) -> None:
        """Tell the queue that the job's ranks resize when asked (an elastic job's ranks
        passed a step boundary): only then may it grow into free workers or be asked for its
        own."""
        self._ask(_resizes, self.request.job_id)

    def hand_back(self, workers: list[str]) -> None:
        """Give back ``workers`` the job cannot use (they failed to prepare for it): the queue
        frees them for other jobs and grants them to this one no more while their process
        lives."""
        self._ask(_hand_back, self.request.job_id, workers)

    def watch(self, version: int, timeout_s: float) -> dict[str, Any]:
        """The job's status once something its holder must act on changed since ``version``
        (a worker granted, asked back or retiring), or after ``timeout_s``."""
        return self._ask(_watch, self.request.job_id, version, timeout_s, timeout_s=timeout_s)

    def describe_wait(self, status: dict[str, Any]) -> str:
        """One line: what the job waits for, who holds it and who is ahead in the line."""
        reasons = []
        if status["holders"]:
            reasons.append(
                "held by "
                + ", ".join(
                    f"{h['name']} ({h['workers']} since {_clock(h['since'])})"
                    for h in status["holders"]
                )
            )
        if status["position"]:
            reasons.append(f"{status['position']} queued ahead")
        return (
            f"job {self.request.job_id} waits for {self.request.minimum} of "
            f"{status['eligible']} eligible workers" + "".join(f", {r}" for r in reasons)
        )

    def _too_few(self, have: int, *, waited: bool) -> str:
        wanted, selection = self.request.minimum, self.request.selection
        when = f"after waiting {self.worker_wait_s:g} s" if waited else "and can have no more"
        if selection.resources or selection.name_pattern is not None:
            return (
                f"launch.workers: {wanted} workers with {selection.describe()} are needed, but "
                f"{have} of the cluster's workers match {when} (change launch.workers or "
                "launch.world_size)"
            )
        return (
            f"launch.world_size: {wanted} workers are needed, but the cluster has {have} {when} "
            "(lower launch.world_size or add workers)"
        )

    def _timed_out(self, status: dict[str, Any], bound: float, *, first: bool) -> str:
        if not first:
            return (
                f"no replacement worker became free within launch.worker_wait_s = {bound:g} s "
                f"({len(status['granted'])} of {self.request.minimum} held)"
            )
        return (
            f"{self.queue_field}: job {self.request.job_id} waited {bound:g} s for "
            f"{self.request.minimum} workers; {self.describe_wait(status)}"
        )

    def _start_renewing(self) -> None:
        def renew() -> None:
            while not self._ended.wait(self.request.lease_s / 3):
                with contextlib.suppress(Exception):  # the scheduler may be restarting
                    if not self._ask(_renew, self.request.job_id):
                        logger.warning("job %s lost its hold on its workers", self.request.job_id)
                        return

        self._renewer = threading.Thread(target=renew, name="dask-train-lease", daemon=True)
        self._renewer.start()

    def release(self) -> None:
        """Give the workers back and leave the queue; safe to call twice."""
        self._ended.set()
        if self._held:
            self._held = False
            with contextlib.suppress(Exception):  # a closed client: the scheduler drops it
                self.client.run_on_scheduler(
                    _release,
                    self.request.job_id,
                    callback_timeout=min(RELEASE_TIMEOUT_S, self.call_timeout_s),
                )

    def __enter__(self) -> "Admission":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _clock(when: float | None) -> str:
    return time.strftime("%H:%M:%S", time.localtime(when)) if when else "now"
