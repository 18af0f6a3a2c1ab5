"""Progress the ecosystem's way: a tqdm bar per epoch, in a terminal or in Jupyter.

``tqdm.auto`` picks the notebook widget under Jupyter (with ipywidgets) and the text bar
elsewhere. Each epoch's bar fills with the step records (``training.log_every_steps``) and gives
way to the epoch's line, which stays. Without a terminal (cron, a pipe) use
:func:`workflows.driver.print_progress`: plain lines, no carriage returns.
"""

import math
import sys
from typing import Any, TextIO

from tqdm.auto import tqdm

from workflows.driver import format_epoch


class EpochProgress:
    """An ``on_event`` handler that draws one tqdm bar per epoch."""

    def __init__(self, file: TextIO | None = None) -> None:
        self.file = file
        self.epochs = 0
        self.steps_per_epoch = 0
        self._bar: Any = None
        self._epoch = 0

    def __call__(self, record: dict[str, Any]) -> None:
        kind = record.get("kind")
        if kind == "start":
            self.epochs = int(record["epochs"])
            self.steps_per_epoch = math.ceil(int(record["total_steps"]) / max(1, self.epochs))
        elif kind == "step":
            bar = self._open(int(record["epoch"]))
            done = int(record["step"]) - (self._epoch - 1) * self.steps_per_epoch
            if bar.total:
                done = min(done, bar.total)
            bar.set_postfix(loss=f"{record['loss']:.4f}", refresh=False)
            bar.update(max(0, done - bar.n))
        elif kind == "epoch":
            self.close()
            self._write(format_epoch(record))
        elif kind == "recovery":
            self.close()
            self._write(
                f"recovery {record.get('recoveries')}: {record.get('failure')}; resuming from "
                f"step {record.get('resumed_from_step')}"
            )

    def _open(self, epoch: int) -> Any:
        if self._bar is not None and epoch == self._epoch:
            return self._bar
        self.close()
        self._epoch = epoch
        self._bar = tqdm(
            total=self.steps_per_epoch or None,
            desc=f"Epoch {epoch}/{self.epochs or '?'}",
            unit="step",
            leave=False,  # the epoch's line replaces its bar
            file=self.file,
            dynamic_ncols=True,
        )
        return self._bar

    def _write(self, line: str) -> None:
        tqdm.write(line, file=self.file or sys.stdout)
        (self.file or sys.stdout).flush()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


__all__ = ["EpochProgress"]
