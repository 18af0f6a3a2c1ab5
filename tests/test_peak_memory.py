"""A rank's peak memory: what the kernel says this process reached since the job started."""

import mmap
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from workers.peak_memory import PeakMemory
from workflows.runs.driver import train


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


def test_the_pages_of_a_file_first_read_during_the_job_are_not_its_memory(tmp_path):
    # As a library's code that the job runs for the first time: a mapped file's pages, read.
    path = tmp_path / "library.so"
    path.write_bytes(b"\x01" * (96 * 2**20))
    peak = PeakMemory.start(torch.device("cpu"))
    with path.open("rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        touched = sum(mapped[i] for i in range(0, len(mapped), mmap.PAGESIZE))
        assert touched == 96 * 2**20 // mmap.PAGESIZE  # every page read, and resident
        assert peak.bytes() < 16 * 2**20  # not the job's: 96 MiB were it counted
        allocated = torch.ones(64 * 2**20 // 4)  # the job's own: counted
        assert 60 * 2**20 <= peak.bytes() < (64 + 16) * 2**20
    assert allocated.sum() > 0


def test_a_file_first_read_after_the_peak_does_not_lower_it(tmp_path):
    # A heartbeat's peak, then a library's code read for the first time (a page of it is
    # enough): the rank's final peak read lower than its heartbeat's (seen in CI).
    path = tmp_path / "library.so"
    path.write_bytes(b"\x01" * (64 * 2**20))
    peak = PeakMemory.start(torch.device("cpu"))
    transient = torch.ones(128 * 2**20 // 4)  # mapped by malloc, handed back when freed
    del transient
    at_heartbeat = peak.bytes()
    assert at_heartbeat >= 120 * 2**20
    with path.open("rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        touched = sum(mapped[i] for i in range(0, len(mapped), mmap.PAGESIZE))
        assert touched == 64 * 2**20 // mmap.PAGESIZE  # resident, below the high-water mark
        assert peak.bytes() >= at_heartbeat  # 64 MiB less, were the correction taken off it


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


def _wide_mlp(make_config, store, strategy: str, *, width: int, layers: int):
    """One optimizer step of ``workflows/benchmarks/wide_mlp.py`` on 8x8 synthetic images: a
    stack of square linear layers, each its own FSDP unit, whose parameters dominate."""
    data = {"dataset": "synthetic", "synthetic_samples": 40, "image_size": 8, "store": str(store)}
    model = {
        "name": "workflows.benchmarks.wide_mlp:wide_mlp",
        "kwargs": {"width": width, "layers": layers},
    }
    raw = {"name": f"peak-{strategy}", "data": data, "model": model}
    return make_config(raw, strategy=strategy, epochs=1, max_steps=1, batch_size=8, lr=0.01)


def test_an_fsdp_rank_peaks_at_a_fraction_of_a_ddp_rank_bounded_by_the_parameter_count(
    own_cluster, make_config, tmp_path
):
    """FSDP against DDP at 2 ranks, the model 12 linear layers 1,024 wide on 8x8x3 inputs:
    P = 11.74 M parameters, 44.8 MiB in float32, in 13 units, the largest U (a hidden layer)
    1.05 M parameters, 4 MiB. Both run SGD with momentum, one step.

    - A DDP rank holds the parameters, their gradients, DDP's gradient buckets (a second copy
      of the gradients: gradient_as_bucket_view is off) and the momentum: 4P, 179 MiB; at
      least 3P without the buckets.
    - An FSDP rank builds the whole model (P), which sharding frees unit by unit (P + U/2 at
      most), then holds half of the parameters, gradients and momentum, 1.5P, 67 MiB; and while
      a unit runs, its gathered parameters, the next unit's (prefetched), its unsharded
      gradient and the reduce-scatter's input and output: under 6U, 24 MiB. The rest of a
      rank's job (its batches, gloo's buffers) is allowed 16 MiB (measured: ~1 MiB).

    So FSDP / DDP <= (1.5P + 6U + 16 MiB) / 4P = 0.60. An FSDP that held its parameters,
    gradients and momentum whole (3P) would be at 0.75 of DDP or more. Measured: 0.47 (86 and
    182 MiB a rank).

    Fresh workers: on a warm worker glibc serves FSDP's blocks from heap memory earlier jobs
    freed (malloc_trim gave its pages back, the free chunks stay), and what FSDP frees then
    stays resident: the same FSDP job measured 182 to 264 MiB a rank on the session's workers
    after other jobs, 152 on fresh ones. A tiny FSDP job first imports FSDP's code on the
    workers (~40 MiB, counted by a worker's first FSDP job); then the two measured jobs.
    """
    store = tmp_path / "store"
    train(
        _wide_mlp(make_config, store, "fsdp", width=64, layers=2),
        cluster=own_cluster,
        on_event=None,
    )
    sharded = train(
        _wide_mlp(make_config, store, "fsdp", width=1024, layers=12),
        cluster=own_cluster,
        on_event=None,
    )
    # Its results are off the workers once it returns: freed during the next job, rank 0's
    # whole state dict (45 MiB) made that job's peak read that much lower (seen once in CI).
    assert not any(own_cluster.client.has_what().values())
    replicated = train(
        _wide_mlp(make_config, store, "ddp", width=1024, layers=12),
        cluster=own_cluster,
        on_event=None,
    )
    params = sum(t.numel() for t in replicated.state_dict.values())
    unit = max(
        replicated.state_dict[f"{i}.weight"].numel() + replicated.state_dict[f"{i}.bias"].numel()
        for i in range(1, 26, 2)
    )
    p_mib, u_mib = params * 4 / 2**20, unit * 4 / 2**20
    assert (round(p_mib, 1), round(u_mib, 1)) == (44.8, 4.0)  # the sizes argued above
    bound = (1.5 * p_mib + 6 * u_mib + 16) / (4 * p_mib)
    assert bound < 0.75  # below an FSDP that does not shard: the test can tell them apart

    ddp, fsdp = replicated.peak_memory_mib, sharded.peak_memory_mib
    assert len(ddp) == len(fsdp) == 2
    assert min(ddp) >= 3 * p_mib, ddp  # parameters, gradients and momentum at least
    assert min(fsdp) >= 1.5 * p_mib, fsdp  # their halves at least
    assert max(fsdp) <= bound * min(ddp), (fsdp, ddp, bound)


FREED_RESIDENT = """
import ctypes, sys
from pathlib import Path

import torch

from workers.malloc import M_MMAP_THRESHOLD, SLIDING_THRESHOLD_MAX, release_free_memory
from workers.spec.layout import Layout
from workers.spec.plans.fsdp import ShardingSettings
from workers.spec.sections import FSDPConfig
from workers.strategies.fsdp.sharding import FSDP

libc = ctypes.CDLL("libc.so.6")


def resident() -> int:
    status = Path("/proc/self/status").read_text()
    return int(next(x for x in status.splitlines() if x.startswith("RssAnon:")).split()[1]) * 1024


for case in sys.argv[1:]:  # "<dp_shard>:<return|keep>"
    shards, what = case.split(":")
    layout = Layout(world_size=2, pp=1, dp=2, dp_shard=int(shards), batch_size=8)
    settings = ShardingSettings(fsdp=FSDPConfig(return_freed_memory=what == "return"))
    assert libc.mallopt(M_MMAP_THRESHOLD, SLIDING_THRESHOLD_MAX) == 1  # as a worker's
    with FSDP.job_memory(settings, layout=layout, device=torch.device("cpu")):
        release_free_memory()  # what earlier cases freed: no longer resident
        before = resident()
        units, kept = [], []
        for _ in range(16):  # 128 MiB of 8 MiB units freed, each after one kept
            kept.append(torch.ones(2 * 2**20))
            units.append(torch.ones(2 * 2**20))
        del units
        print(resident() - before - sum(k.nbytes for k in kept))  # freed, still resident
        del kept
"""


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc (Linux)")
def test_an_fsdp_cpu_rank_returns_the_blocks_it_frees_unless_told_to_keep_them():
    # A CPU worker's malloc serves blocks of up to 32 MiB from its heap
    # (workflows/cluster/training_cluster.py's TUNED_MALLOC): freed amid live ones, they stay
    # resident. FSDP's gathered units are such. A fresh process, as a worker's: this one's other
    # threads allocate meanwhile.
    cases = ["2:return", "2:keep", "1:return"]
    done = subprocess.run(
        [sys.executable, "-c", FREED_RESIDENT, *cases],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    freed_resident = dict(zip(cases, map(int, done.stdout.split()), strict=True))
    assert freed_resident["2:return"] < 16 * 2**20, freed_resident
    assert freed_resident["2:keep"] > 96 * 2**20, freed_resident
    # Nothing to give back where nothing is sharded (nor on a GPU: CUDA's caching allocator).
    assert freed_resident["1:return"] > 96 * 2**20, freed_resident
