"""The ranks' records on the client: Dask events, handed to ``on_event`` in order, once each.

``on_event`` receives each record as the plain dict that travelled (``workers/records.py``
says each kind's fields): what ``print`` shows, what ``metrics.jsonl``, ``LaunchResult.metrics``
and ``TrainResult.history`` hold, and what every handler written so far reads. A handler that
wants the typed record calls ``workers.records.parse_record(record)``.
"""

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from distributed import Client

from workers.records import (
    BaseRecord,
    MalformedRecord,
    NumberedRecord,
    Record,
    ReportRecord,
    StepRecord,
    parse_record,
)

# Called with each record's dict (workers/records.py has the typed models).
EventHandler = Callable[[dict[str, Any]], None]
logger = logging.getLogger(__name__)
# How long a mended history waits for a surviving rank's record of a step rank 0 never sent:
# it left that rank before the loss was even seen, and is normally here already.
STAND_IN_WAIT_S = 1.0


class EventRelay:
    """Forwards a job's Dask events to ``on_event`` while the job runs.

    Dask calls topic handlers on the client's event loop, which a LocalCluster's scheduler
    shares: a handler that blocks (a print to a slow pipe, a request to the dashboard) would
    stall the cluster. So records are handed to ``on_event`` from a thread of their own, in
    order. Events travel asynchronously and the last ones may still be in flight when the job
    returns; ``deliver_missed`` hands over those records from the ranks' results, so each
    record arrives exactly once.

    Report records (``ctx.report``) of every rank are also kept, per attempt, so that the
    reports of an attempt that failed (whose results never came back) are not lost. A record
    of no known shape (``workers.records.parse_record`` refuses it) is logged and dropped.

    Every step the job finished appears once in each rank's reports (``continued_from``): an
    attempt's records of steps the next attempt does again are left out of
    ``reports_before``, and a step rank 0 never reported (its worker lost after its peers had
    finished the step, or its last records lost with it) gets a surviving rank's record of it.
    The built-in trainer's step and epoch records of steps done again reach ``on_event`` again
    (those that count: ``metrics.jsonl`` keeps them in place of the first, see ``redone``);
    its reporting rank sends the steps its lost predecessor never sent (workers/train.py
    ``RecentSteps``), which this relay passes on once, and only where rank 0 was lost.
    """

    _STOP = object()

    def __init__(self, client: Client, topic: str, on_event: EventHandler | None) -> None:
        self.client, self.topic, self.on_event = client, topic, on_event
        self.reports: dict[tuple[int, int], list[dict[str, Any]]] = {}  # (attempt, rank) ->
        self._redone_after: dict[int, int] = {}  # attempt -> the step the next one continued from
        self._rank_0_lost = False  # the attempt before the running one lost its rank 0
        self._seen: set[tuple[Any, ...]] = set()
        self._lock = threading.Lock()
        self._reported = threading.Condition(self._lock)
        # SimpleQueue, not Queue: Queue.put takes a lock in Python code, and the Ctrl-C or
        # SIGTERM of a CLI job (a KeyboardInterrupt, raised wherever the main thread is)
        # landing just after it was taken left it taken for good. The main thread then hung
        # on it in __exit__, putting _STOP (seen once: a queued CLI job, SIGTERM right after
        # its "queued" record, no exit in 60 s; a stress of Queue.put under interrupts leaves
        # its lock taken within the first few). SimpleQueue's put is one C call.
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._pump, name="dask-train-events", daemon=True)

    def _handle(self, event: tuple[float, dict[str, Any]]) -> None:
        data = event[1]
        record = self._read(data)
        if record is None:
            return
        if isinstance(record, StepRecord) and record.reported_by_rank is not None:
            with self._lock:
                if not self._rank_0_lost:
                    # Rank 0 lived: its own record of the step is here or on its way.
                    return
        if isinstance(record, ReportRecord):
            with self._lock:
                self.reports.setdefault((record.attempt, record.rank), []).append(data)
                self._reported.notify_all()
        if self.on_event is not None:
            self._queue.put((record, data))

    def _read(self, data: Any) -> Record | None:
        """The typed record of a job-topic event, or None (logged) for what is none."""
        try:
            record = parse_record(data)
        except MalformedRecord as error:
            logger.warning("%s: %s; dropped", self.topic, error)
            return None
        if record.TOPIC != "job":
            logger.warning("%s: a %s record on a job's topic; dropped", self.topic, record.kind)
            return None
        return record

    def _pump(self) -> None:
        while (item := self._queue.get()) is not self._STOP:
            self._deliver(*item)

    def _deliver(self, record: Record, data: dict[str, Any]) -> None:
        key = _key(record)
        with self._lock:
            if key in self._seen:
                return
            self._seen.add(key)
        if self.on_event is not None:
            try:
                self.on_event(data)
            except Exception:
                # A failing handler must not keep the records that follow from reaching it.
                logger.exception("on_event raised for a %s record", record.kind)

    def emit(self, record: BaseRecord) -> None:
        """A record of the client's own (queued, admitted, recovery): to the scheduler's topic
        for the dashboard, and to ``on_event`` at once: the topic's subscription may not have
        reached the scheduler yet, and the copy that comes back is dropped as seen."""
        data = record.to_event()
        self._handle((time.time(), data))
        self.client.log_event(self.topic, data)

    def skip(self, records: list[dict[str, Any]]) -> None:
        """Never deliver these records (a resumed run's earlier epochs)."""
        keys = []
        for data in records:
            # One of no known shape is never delivered anyway.
            with contextlib.suppress(MalformedRecord):
                keys.append(_key(parse_record(data)))
        with self._lock:
            self._seen.update(keys)

    def reports_before(self, attempt: int, ranks: int) -> list[list[dict[str, Any]]]:
        """Per rank, the reports that arrived from attempts before ``attempt``, in order,
        less those of steps a later attempt did again."""
        with self._lock:
            return [
                [
                    record
                    for earlier in range(attempt)
                    for record in sorted(self.reports.get((earlier, rank), []), key=_seq)
                    if not redone(_step(record), self._redone_after.get(earlier))
                ]
                for rank in range(ranks)
            ]

    def continued_from(self, attempt: int, step: int, *, rank_0_lost: bool) -> None:
        """The attempt after ``attempt`` continues from ``step``: ``attempt``'s reports of
        later steps are redone. When ``attempt``'s rank 0 was lost (its worker gone or
        stopped, with what it had not sent yet), the steps up to ``step`` it never reported get
        a surviving rank's record of the step (``reported_by_rank`` says whose), to
        ``on_event`` too; only for a rank 0 that reports its steps (``ctx.report(step=...)``),
        and waited for only where it reported each one."""
        with self._lock:
            self._redone_after[attempt] = step
            self._rank_0_lost = rank_0_lost
            # The trainer's records (one per step, not numbered per attempt) of steps done
            # again: the next attempt's are delivered, not dropped as seen.
            self._seen -= {
                key for key in self._seen if key[0] in TRAINER_KINDS and redone(key[2], step)
            }
            reported = {
                _step(r) for a in range(attempt + 1) for r in self.reports.get((a, 0), [])
            } - {None}
            if not rank_0_lost or not reported:
                return
            missing = set(range(max(reported) + 1, step + 1))
            each = max(reported) - 1 in reported  # step by step: the peers' are on their way
            deadline = time.monotonic() + (STAND_IN_WAIT_S if each else 0.0)
            while missing - set(self._stand_ins(attempt, missing)):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._reported.wait(left)
            stand_ins = self._stand_ins(attempt, missing)
            own = self.reports.get((attempt, 0), [])
            seq = max((_seq(r) for r in own), default=-1) + 1
            mended = []
            for offset, found in enumerate(sorted(stand_ins.items())):
                record = found[1] | {"rank": 0, "seq": seq + offset}
                mended.append(record | {"reported_by_rank": found[1]["rank"]})
            self.reports.setdefault((attempt, 0), []).extend(mended)
        for data in mended:
            logger.warning(
                "rank 0's record of step %s was lost with its worker; rank %s's stands in",
                data["step"],
                data["reported_by_rank"],
            )
            record = self._read(data)
            if record is not None and self.on_event is not None:
                self._queue.put((record, data))

    def _stand_ins(self, attempt: int, steps: set[int]) -> dict[int, dict[str, Any]]:
        """Of ``steps``, the record each has from the lowest surviving rank of ``attempt``."""
        found: dict[int, dict[str, Any]] = {}
        for (a, rank), records in sorted(self.reports.items()):
            if a != attempt or rank == 0:
                continue
            for record in records:
                if _step(record) in steps:
                    found.setdefault(int(record["step"]), record)
        return found

    def deliver_missed(self, records: list[dict[str, Any]]) -> None:
        """Call after leaving the context. If the handler is still busy after the bounded wait,
        the missed records are dropped rather than delivered concurrently."""
        if self.on_event is None or self._thread.is_alive():
            return
        for data in records:
            record = self._read(data)
            if record is not None:
                self._deliver(record, data)

    def __enter__(self) -> "EventRelay":
        if self.on_event is not None:
            self._thread.start()
        self.client.subscribe_topic(self.topic, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        self.client.unsubscribe_topic(self.topic)
        if self.on_event is not None:
            self._queue.put(self._STOP)
            self._thread.join(timeout=60)


# The built-in trainer's records of the steps it trained, one per step (workers/records.py).
TRAINER_KINDS = frozenset({"step", "epoch"})


def redone(step: int | None, continued_from: int | None) -> bool:
    """Whether a record of ``step`` is superseded: the job (an attempt after a failure or a
    resize, or a run resumed from a checkpoint) continued from ``continued_from``, an earlier
    step, so the parameters that survive were trained through ``step`` again (or never, if the
    run ends before it), and the record of the redone step is the run's, not this one.

    The one rule for what ``LaunchResult.metrics`` (``EventRelay.reports_before``) and
    ``metrics.jsonl``, of ``run`` and of ``launch --output`` (``metrics_file.MetricsFile``), keep.
    ``None``: a record of no step, or an attempt nothing continued from.
    """
    return step is not None and continued_from is not None and step > continued_from


def _key(record: Record) -> tuple[Any, ...]:
    """What tells a record that arrives twice (as an event, and in a rank's result)."""
    if isinstance(record, NumberedRecord):  # ctx.report, a script's output: numbered per rank
        return (record.kind, record.attempt, record.rank, record.seq)
    # The others by where they stand; a kind without one of these fields has None there.
    return (
        record.kind,
        getattr(record, "epoch", None),
        getattr(record, "step", None),
        getattr(record, "recoveries", None),
    )


def _seq(record: dict[str, Any]) -> int:
    return int(record["seq"])


def _step(record: dict[str, Any]) -> int | None:
    """The step a report is of (``ctx.report(step=...)``); None for one without."""
    step = record.get("step")
    return step if isinstance(step, int) and not isinstance(step, bool) else None
