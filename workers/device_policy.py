"""What a worker does about host memory and Python's collector, by device kind: one policy a
kind, asked by the code that would otherwise test the device itself.

These are the host's concerns, measured on CPU machines, and decided here and nowhere else:

- glibc's malloc settings for the workers a local cluster starts (``workers/malloc.py``,
  ``workflows.cluster.training_cluster.malloc_settings``): torch's CPU allocator has no cache, so a
  worker keeps freed memory for reuse instead of page-faulting every step's activations in again.
- Freed blocks handed back to the kernel at once while a rank holds shards
  (``freed_memory_returned``): FSDP on a CPU frees the whole model once it is sharded; a GPU's
  caching allocator keeps its own, so on CUDA this never applies.
- Memory freed by the collector and malloc handed back to the kernel before a peak is measured
  and after a rank's job (``malloc_trim``).
- The collector's freezes: the fork server's heap (``workers/frozen_heap.py``) and what a
  worker's jobs imported (``workers/between_jobs.py``), so that a full collection does not walk
  the libraries' objects at every job.

A GPU worker is a host process too: its data loading allocates from glibc, and its jobs import
the same libraries; so CUDA keeps the malloc settings and the freezes, and differs only where
the GPU's own allocator does the work. Each answer is one field below, to change in one place.

Importing this module imports neither torch nor Dask: the client's cluster module reads it.
"""

import gc
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, Literal

DeviceKind = Literal["cpu", "cuda"]


@dataclass(frozen=True)
class DevicePolicy:
    """What applies to the workers and ranks of one device kind."""

    kind: DeviceKind
    # Local workers get workflows.cluster.training_cluster's malloc settings
    # (cluster.tune_malloc permitting).
    tunes_malloc: bool
    # A rank holding shards maps every block over 1 MiB on its own, handed back once freed.
    returns_sharded_memory: bool
    # Collect, then freeze what survives, where a worker has imported something new.
    freezes_heap: bool

    def job_memory(self, wanted: bool) -> AbstractContextManager[Any]:
        """What a rank's whole job runs inside: freed memory returned to the kernel at once
        where its strategy ``wanted`` it and this kind's memory is the host's."""
        if wanted and self.returns_sharded_memory:
            from workers.malloc import freed_memory_returned

            return freed_memory_returned()
        return nullcontext()

    def release_freed_memory(self) -> None:
        """Collect what reference cycles hold, and hand what malloc holds free back to the
        kernel (a rank's host memory, whatever its device)."""
        from workers.malloc import release_free_memory

        gc.collect()
        release_free_memory()

    def freeze_what_jobs_imported(self) -> bool:
        """Before this worker joins a job's process group: collect and freeze where this kind
        freezes (``workers/between_jobs.py``). Whether it froze."""
        if not self.freezes_heap:
            return False
        from workers.between_jobs import freeze_what_earlier_jobs_imported

        return freeze_what_earlier_jobs_imported()


CPU = DevicePolicy("cpu", tunes_malloc=True, returns_sharded_memory=True, freezes_heap=True)
CUDA = DevicePolicy("cuda", tunes_malloc=True, returns_sharded_memory=False, freezes_heap=True)
POLICIES: dict[str, DevicePolicy] = {"cpu": CPU, "cuda": CUDA}


def policy_for(device: Any) -> DevicePolicy:
    """The policy of ``device``: a ``torch.device`` or its type's name ("cpu", "cuda"). Another
    accelerator's memory is its own allocator's, as CUDA's is."""
    return POLICIES.get(getattr(device, "type", device), CUDA)


def this_worker() -> DevicePolicy:
    """The policy of this process's ranks: CUDA where torch sees a GPU (``workers.devices``)."""
    import torch

    return CUDA if torch.cuda.is_available() else CPU
