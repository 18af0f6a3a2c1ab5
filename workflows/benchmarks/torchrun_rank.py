"""One rank of the torchrun reference: the same training loop as a Dask rank, launched by
``torchrun`` instead of by dask-train. Prints rank 0's result as one JSON line.

    python -m workflows.benchmarks.torchrun_rank CONFIG_JSON [cpu|cuda]

``cuda``: nccl, each rank on the GPU its local rank names (``workers/devices.py``'s rule).
"""

import json
import os
import sys

import torch
import torch.distributed as dist

from workers.devices import local_device
from workers.process_group import Membership
from workers.spec.run import RunConfig
from workers.train import TrainJob, train


def main() -> None:
    config = RunConfig.model_validate_json(sys.argv[1])
    cuda = len(sys.argv) > 2 and sys.argv[2] == "cuda"
    backend = "nccl" if cuda else "gloo"
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = local_device(local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group(backend)  # torchrun's env:// rendezvous
    membership = Membership(
        generation="torchrun",
        rank=dist.get_rank(),
        local_rank=local_rank,
        world_size=dist.get_world_size(),
        backend=backend,
        device=device,
    )
    layout = config.layout(membership.world_size)
    job = TrainJob(data=config.data, model=config.model, training=config.training, layout=layout)
    result = train(job, membership=membership, layout=layout)
    if membership.rank == 0:
        print(
            "RESULT "
            + json.dumps(
                {
                    "steady_samples_per_s": result.steady_samples_per_s,
                    "samples_per_s": result.samples_per_s,
                    "steps": result.steps,
                }
            ),
            flush=True,
        )
    dist.barrier()  # no rank may tear gloo down while its peer still talks to it
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
