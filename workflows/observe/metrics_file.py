"""``metrics.jsonl``: a job's records, one a line as they travelled, each step once.

Written by ``dask-train run``'s run directory (the built-in trainer's step and epoch records,
``workflows/runs/run_directory.py``) and by ``dask-train launch --output`` (a function's
``ctx.report`` records, ``workflows/jobs/script_launch.py``): the one rule of both. Where the
job continues from an earlier step than it reached (a recovery, a resumed run, a resize from an
older checkpoint), the records of the steps after it are dropped (``events.redone``, the rule
``LaunchResult.metrics`` follows), and the records of those steps trained again, those of the
parameters that survive, take their place as they come.
"""

import json
import os
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any, NamedTuple, Self, TextIO

from workers.records import (
    Record,
    RecoveryRecord,
    ReportRecord,
    ResizedRecord,
    ResumedRecord,
    parse_record,
)
from workflows.observe.events import TRAINER_KINDS, redone


class _Entry(NamedTuple):
    """What a line says of the step it records: a trainer's record is one per step, a report
    one of any number a rank sent in its attempt (None for the trainer's, which has none)."""

    key: tuple[Any, ...]
    step: int
    attempt: int | None


class MetricsFile:
    """Appends a job's records to ``path``; a record that says the job continues from an
    earlier step rewrites the file without the records it supersedes, replaced whole
    (:func:`write_atomically`): a reader, or a run killed mid-rewrite, finds the lines before
    or after, never a truncated file. Use in ``with`` (or :meth:`open`, :meth:`close`): records
    before or after are not written. ``kinds``: the kinds of record it keeps (default every
    kind); the records of the others still say what is redone.

    A report's step is its ``step`` field (``ctx.report(step=...)``); a report without one is
    kept as it is. Of the reports of a rank's step, those of the newest attempt are kept (its
    state is the one that goes on), whatever order they arrive in; a rank's reports of one step
    in one attempt (a loss, then an accuracy) are all kept.
    """

    def __init__(self, path: Path, kinds: Collection[str] | None = None) -> None:
        self.path, self.kinds = path, kinds
        self._file: TextIO | None = None
        # Steps a resize trained again, (after, through): its record comes after the new
        # world's first step, so each redone trainer record replaces the first as it comes.
        self._redo_windows: list[tuple[int, int]] = []
        # Of each rank's report step written here, the newest attempt that reported it.
        self._newest: dict[tuple[Any, ...], int] = {}
        self._attempt = -1  # the newest attempt a report came from
        # (the newest attempt then, the step continued from) at each continuation: a report of
        # those attempts that arrives after it, of a later step, is of a step done again.
        self._continued: list[tuple[int, int]] = []

    def open(self) -> Self:
        """Start writing: records are appended from here on."""
        self._file = self.path.open("a", buffering=1)
        return self

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> Self:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def append(self, record: dict[str, Any], typed: Record | None = None) -> None:
        """Write ``record`` (``typed``: the same, parsed, if the caller has it), and drop what
        it says is redone."""
        if self._file is None:
            return
        typed = typed if typed is not None else parse_record(record)
        match typed:
            case ResumedRecord(step=step) | RecoveryRecord(resumed_from_step=step):
                self._continued.append((self._attempt, step))
                self._drop(lambda entry, _: redone(entry.step, step))
            case ResizedRecord(step=step, redone_steps=int(again)) if again > 0:
                # Sent once the new world's first step is done: its first records are here.
                self._redo_windows.append((step, step + again))
                self._drop(self._replaced)
        if self.kinds is not None and typed.kind not in self.kinds:
            return
        entry = _entry(record)
        if isinstance(typed, ReportRecord) and entry is not None and not self._report_kept(entry):
            return
        self._file.write(json.dumps(record) + "\n")  # as it travelled
        if entry is not None and self._resized_again(entry):
            self._drop(self._replaced)

    def _report_kept(self, entry: _Entry) -> bool:
        """Whether a report is the newest of its rank's step, dropping an older attempt's."""
        attempt = entry.attempt
        assert attempt is not None
        self._attempt = max(self._attempt, attempt)
        if any(attempt <= then and redone(entry.step, step) for then, step in self._continued):
            return False  # late: an attempt the job went back from, after this step
        newest = self._newest.get(entry.key)
        if newest is not None and newest > attempt:
            return False
        if newest is not None and newest < attempt:
            self._drop(lambda other, _: other.key == entry.key and (other.attempt or 0) < attempt)
        self._newest[entry.key] = attempt
        return True

    def _resized_again(self, entry: _Entry) -> bool:
        """A trainer's record of a step a resize trained again (a report's attempt says)."""
        return entry.attempt is None and any(
            low < entry.step <= high for low, high in self._redo_windows
        )

    def _replaced(self, entry: _Entry, again: bool) -> bool:
        """A trainer's record of a step a resize trained again, whose redone record came
        since."""
        return again and self._resized_again(entry)

    def _drop(self, superseded: Callable[[_Entry, bool], bool]) -> None:
        """Rewrite the file without the records that ``superseded`` says are no longer the
        job's, given each and whether one of its kind and step came after it."""
        assert self._file is not None
        self._file.close()
        self._file = None  # an interrupt here leaves it closed, not half open
        lines = self.path.read_text().splitlines(keepends=True)
        kept: list[str] = []
        later: set[tuple[Any, ...]] = set()
        for line in reversed(lines):
            entry = _entry(_parsed(line))
            if entry is not None:
                if superseded(entry, entry.key in later):
                    continue
                later.add(entry.key)
            kept.append(line)
        if len(kept) < len(lines):
            write_atomically(self.path, "".join(reversed(kept)))
        self._file = self.path.open("a", buffering=1)


def write_atomically(path: Path, text: str) -> None:
    """Replace ``path`` whole: a reader, or a run resumed after an interruption mid-write,
    finds the old content or the new, never a truncated file."""
    partial = path.with_name(f".{path.name}.partial")
    with partial.open("w") as file:
        file.write(text)
        file.flush()
        os.fsync(file.fileno())
    os.replace(partial, path)


def _entry(record: dict[str, Any] | None) -> _Entry | None:
    """The step a line records, if it is one of a step: a trainer's, or a report of one."""
    if record is None or not _is_int(record.get("step")):
        return None
    step, kind = record["step"], record.get("kind")
    if kind in TRAINER_KINDS:
        return _Entry((kind, step), step, None)
    if kind == "report" and _is_int(record.get("rank")) and _is_int(record.get("attempt")):
        return _Entry((kind, record["rank"], step), step, record["attempt"])
    return None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _parsed(line: str) -> dict[str, Any] | None:
    """A line's record; None for one that is not (a line cut by a kill)."""
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None
