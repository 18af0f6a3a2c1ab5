"""Which GPU a rank uses, and which GPUs a worker owns: pure rules, so they are tested without a
GPU, and the few lines that ask torch and Dask for the inputs.

Which GPU: dask-cuda (``dask cuda worker``, ``LocalCUDACluster``) starts one worker per GPU and
rotates ``CUDA_VISIBLE_DEVICES`` so that the worker's own GPU comes first ("1,2,3,0" for the
second of four): the worker still sees every GPU, but its own is cuda:0. Batch systems (Slurm,
Kubernetes' device plugin) set the variable the same way, own GPUs first. A stock
``dask worker --resources GPU=1`` started without the variable on a multi-GPU host sees every
GPU in the host's order, like its neighbours: its rank must take the GPU its local rank names,
or all ranks of the host land on cuda:0, which NCCL refuses.

What a worker owns (``nn.DataParallel`` in one worker): as many GPUs as its ``GPU`` resource
declares (``dask worker --resources GPU=4``), from its rank's device on; without the resource,
one. A dask-cuda worker declares none and so owns its one GPU, although it sees them all; a
worker on a shared host never takes every GPU it can see unasked.
"""

import os

import torch


def rank_device_index(local_rank: int, visible: int, cuda_visible_devices: str | None) -> int:
    """The CUDA device index of the rank with ``local_rank`` on a worker that sees ``visible``
    GPUs, with ``CUDA_VISIBLE_DEVICES`` set to ``cuda_visible_devices`` (None: unset).

    One visible GPU: cuda:0. Several, with the variable set (dask-cuda's rotation, a batch
    system): whoever set it put this worker's own GPU first, cuda:0. Several without it (stock
    workers sharing a multi-GPU host): cuda:(local_rank % visible), so that the ranks of a host
    use different GPUs.
    """
    if visible < 1:
        raise ValueError(f"no visible GPU to choose from (local rank {local_rank})")
    if local_rank < 0:
        raise ValueError(f"local rank {local_rank} is negative")
    if visible == 1 or (cuda_visible_devices or "").strip():
        return 0
    return local_rank % visible


def owned_device_indices(first: int, visible: int, declared: float | None) -> list[int]:
    """The CUDA device indices a worker's one process may use, starting at its rank's device
    ``first``: as many as the worker's ``GPU`` resource declares (``None``: one), never more
    than it sees."""
    if not 0 <= first < visible:
        raise ValueError(f"device cuda:{first} is not among the {visible} visible GPUs")
    wanted = 1 if declared is None else max(1, int(declared))
    return list(range(first, min(visible, first + wanted)))


def local_device(local_rank: int) -> torch.device:
    """This process's device for the rank with ``local_rank``: a GPU when it sees one."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    index = rank_device_index(
        local_rank, torch.cuda.device_count(), os.environ.get("CUDA_VISIBLE_DEVICES")
    )
    return torch.device("cuda", index)


def declared_gpus() -> float | None:
    """The ``GPU`` resource of the Dask worker running this code (None: not declared). Outside
    a Dask worker (torchrun), every visible GPU, like ``nn.DataParallel``'s own default."""
    try:
        from distributed import get_worker

        worker = get_worker()
    except (ImportError, ValueError):  # not inside a Dask worker
        return float(torch.cuda.device_count()) if torch.cuda.is_available() else None
    return worker.state.total_resources.get("GPU")
