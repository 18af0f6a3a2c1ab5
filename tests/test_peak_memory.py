"""A rank's peak memory: what the kernel says this process reached since the job started."""

import torch

from workers.peak_memory import PeakMemory


def test_the_peak_counts_what_was_held_since_the_start_and_not_before():
    held_before = torch.ones(64 * 2**20 // 4)  # 64 MiB the worker already holds
    peak = PeakMemory.start(torch.device("cpu"))
    assert peak.bytes() is not None and peak.bytes() < 16 * 2**20
    transient = torch.ones(256 * 2**20 // 4)  # 256 MiB, touched, then freed
    del transient
    # Freed, yet the peak keeps it; what was held before the start is not counted. (Pages:
    # a few the process held at the start may have been returned since.)
    assert 240 * 2**20 <= peak.bytes() < (256 + 32) * 2**20
    assert held_before.sum() > 0


def test_memory_an_earlier_job_freed_counts_again_when_this_job_takes_it():
    # 128 MiB in 64 KiB tensors: malloc's heap, not mmap. The tensor made after them keeps
    # free() from handing the heap's top back: freed, they stay resident with malloc.
    blocks = [torch.ones(16 * 1024) for _ in range(2048)]
    pinned = torch.ones(16)
    del blocks
    peak = PeakMemory.start(torch.device("cpu"))
    again = [torch.ones(16 * 1024) for _ in range(2048)]  # this job's: the same 128 MiB
    # Reused from malloc's free memory, they would not grow the resident set at all.
    assert peak.bytes() >= 100 * 2**20
    assert len(again) == 2048 and pinned.sum() == 16
