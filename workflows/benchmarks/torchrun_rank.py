"""One rank of the torchrun reference: the same training loop as a Dask rank, launched by
``torchrun`` instead of by dask-train. Prints rank 0's result as one JSON line."""

import json
import sys

import torch
import torch.distributed as dist

from workers.process_group import Membership
from workers.train import train
from workflows.config import RunConfig


def main() -> None:
    config = RunConfig.model_validate_json(sys.argv[1])
    dist.init_process_group("gloo")  # torchrun's env:// rendezvous
    membership = Membership(
        generation="torchrun",
        rank=dist.get_rank(),
        local_rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        backend="gloo",
        device=torch.device("cpu"),
    )
    layout = config.layout(membership.world_size)
    result = train(config.data, config.model, config.training, membership=membership, layout=layout)
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
