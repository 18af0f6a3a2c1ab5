"""The job's one device mesh, built once per attempt from the layout's degrees.

torchtitan's order, outermost first: ``pp``, ``dp_replicate``, ``dp_shard``, ``tp``. The ranks
that talk most (a layer's ``tp`` slices, then a copy's shards) are neighbours, on one host
where a host holds them. The mesh's rank order is the layout's (``workers/spec/layout.py``).
"""

import sys

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from workers.spec.layout import Layout

ORDER = ("pp", "dp_replicate", "dp_shard", "tp")


def build_device_mesh(
    layout: Layout, device: torch.device, *, keep: tuple[str, ...] = ()
) -> DeviceMesh:
    """The mesh of ``layout``'s degrees. A degree of 1 is left out (it would make one-rank
    process groups, one per rank, for nothing) unless it is in ``keep``: the dimensions the
    caller indexes whatever their size."""
    degrees = {
        "pp": layout.pp,
        "dp_replicate": layout.dp_replicate,
        "dp_shard": layout.dp_shard,
        "tp": layout.tp,
    }
    names = [name for name in ORDER if degrees[name] > 1 or name in keep]
    if not names:
        raise ValueError(f"a mesh of {layout} has no dimension; keep one")
    sizes = tuple(degrees[name] for name in names)
    return init_device_mesh(device.type, sizes, mesh_dim_names=tuple(names))


def forget_earlier_meshes() -> None:
    """Empty DTensor's caches in this thread: call before a job's ranks use any mesh.

    A warm worker runs one job after another in the same process, each with its own process
    groups. A mesh of an earlier job compares equal to this job's of the same shape (a
    ``DeviceMesh``'s equality leaves its groups out), so DTensor's sharding-propagation cache,
    keyed by such meshes, hands back output specs on the earlier mesh, whose collectives name
    groups that are gone ("Could not resolve the process group registered under the name 3",
    measured: a pipeline split by tensor parallelism after a TP x FSDP job on the same workers)
    or, where the names happen to exist again, other groups. The Python cache is per thread:
    this clears the calling thread's, and the process-wide ones.
    """
    if "torch.distributed.tensor" not in sys.modules:
        return  # nothing cached: no job here has used a DTensor
    from workers.compat.torch_private import forget_dtensor_caches

    forget_dtensor_caches()
