"""A rank's peak memory over one job: CUDA's allocator peak on a GPU, the growth of the
process's peak resident set on a CPU.

On a CPU the figure is the Linux kernel's high-water mark (``VmHWM``), reset when the job
starts (``/proc/self/clear_refs``), less the resident set at that moment: a warm worker's
earlier jobs do not count, and neither does what the worker held before (torch itself). Just
before, malloc hands back what it holds free: memory an earlier job freed would otherwise stay
resident, be reused, and hide this job's peak (measured: an FSDP job after a DDP job on the
same workers reported a tenth of its peak). What earlier jobs left in reference cycles is
collected first: freed by the collector during the job, it would lower the job's figure.

Nor do the pages of files that the job reads for the first time count (``RssFile``'s growth,
taken off the high-water mark): a library's code that the job runs for the first time (the
kernels of an operator, DTensor's dispatch, a model library's modules) is mapped from its file,
shared by every process of the host that runs it, and stays resident once read: the same on
every strategy, and none of it the job's allocations, which are what the figure is for
(and what CUDA's counts on a GPU).

That correction can only grow, so the figure is the highest it has been: a file first read
after the job's peak would otherwise be taken off a high-water mark it never raised, and a
heartbeat's peak would read more than the rank's final one (seen once in CI: 2.4 KiB, a page).
"""

import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch

from workers.device_policy import policy_for

_STATUS = Path("/proc/self/status")


def _status_kib(field: str) -> int | None:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


@dataclass
class PeakMemory:
    """Started as a job starts on this rank; ``bytes()`` is the peak since then."""

    device: torch.device
    resident_at_start: int | None  # KiB; None where the kernel's figures are not readable
    file_pages_at_start: int = 0  # KiB of mapped files resident at the start (RssFile)
    highest: int = 0  # bytes: the most bytes() has returned; a peak never goes down
    # The heartbeat's thread and the training thread both read it.
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    @classmethod
    def start(cls, device: torch.device) -> "PeakMemory":
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            return cls(device, None)
        policy_for(device).release_freed_memory()
        try:
            Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
        except OSError:
            return cls(device, None)
        return cls(device, _status_kib("VmRSS"), _status_kib("RssFile") or 0)

    def bytes(self) -> int | None:
        """The peak so far: None where it cannot be measured (not Linux, no /proc)."""
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        peak = _status_kib("VmHWM")
        if self.resident_at_start is None or peak is None:
            return None
        # Files' pages read since the start: the code the job ran first (see above).
        file_pages = max(0, (_status_kib("RssFile") or 0) - self.file_pages_at_start)
        with self._lock:
            self.highest = max(self.highest, (peak - self.resident_at_start - file_pages) * 1024)
            return self.highest
