"""Progress the ecosystem's way: a tqdm bar per epoch, in a terminal or in Jupyter.

``tqdm.auto`` picks the notebook widget under Jupyter (with ipywidgets) and the text bar
elsewhere. Each epoch's bar fills with the step records (``training.log_every_steps``) and gives
way to the epoch's line, which stays. Without a terminal (cron, a pipe) use
:func:`workflows.runs.driver.print_progress`: plain lines, no carriage returns.
"""

import math
import os
import sys
from typing import Any, TextIO

from tqdm.auto import tqdm

from workers.records import (
    EpochRecord,
    RecoveryRecord,
    ResumedRecord,
    StartRecord,
    StepRecord,
    parse_record,
)
from workflows.runs.driver import format_epoch

# How the CLI's recovery line names what the run continued from.
RECOVERED_FROM = {
    "replica": " from a surviving replica's memory",
    "checkpoint": " from the newest checkpoint",
    "start": " from the start",
}


class EpochProgress:
    """An ``on_event`` handler that draws one tqdm bar per epoch (from the start, step, epoch
    and recovery records; it passes over the others)."""

    def __init__(self, file: TextIO | None = None) -> None:
        self.file = file
        self.epochs = 0
        self.steps_per_epoch = 0
        self._bar: Any = None
        self._epoch = 0

    def __call__(self, record: dict[str, Any]) -> None:
        match parse_record(record):
            case StartRecord(epochs=epochs, total_steps=total_steps):
                self.epochs = epochs
                self.steps_per_epoch = math.ceil(total_steps / max(1, epochs))
            case StepRecord(epoch=epoch, step=step, loss=loss):
                done = step - (epoch - 1) * self.steps_per_epoch
                if self.steps_per_epoch:
                    done = max(0, min(done, self.steps_per_epoch))
                if self._bar is None or epoch != self._epoch:
                    self._open(epoch, done, f"{loss:.4f}")  # its first drawing shows this step
                else:
                    self._bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
                    self._bar.update(max(0, done - self._bar.n))
            case EpochRecord():
                self.close()
                self._write(format_epoch(record))
            case ResumedRecord() as resumed:
                self.close()
                self._write(resumed.line())
            case RecoveryRecord() as recovery:
                self.close()
                self._write(
                    f"recovery {recovery.recoveries}: {recovery.failure}; resuming at step "
                    f"{recovery.resumed_from_step}{RECOVERED_FROM[recovery.recovered_from]}"
                )

    def _open(self, epoch: int, done: int, loss: str) -> None:
        self.close()
        self._epoch = epoch
        width = _reported_width(self.file)
        self._bar = tqdm(
            total=self.steps_per_epoch or None,
            initial=done,
            postfix={"loss": loss},
            desc=f"Epoch {epoch}/{self.epochs or '?'}",
            unit="step",
            leave=False,  # the epoch's line replaces its bar
            file=self.file,
            # A terminal that reports no size (a bare pty: `script`, some CI runners) would make
            # tqdm trim the bar to nothing.
            ncols=80 if width == 0 else None,
            nrows=24 if width == 0 else None,
            dynamic_ncols=width != 0,
        )

    def _write(self, line: str) -> None:
        tqdm.write(line, file=self.file or sys.stdout)
        (self.file or sys.stdout).flush()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def _reported_width(file: TextIO | None) -> int | None:
    """The columns the terminal behind ``file`` reports, or None when it is no terminal."""
    try:
        return os.get_terminal_size((file or sys.stderr).fileno()).columns
    except (AttributeError, OSError, ValueError):  # a notebook's stream, a pipe
        return None


__all__ = ["EpochProgress"]
