"""Pipeline parallelism by hand, for ``torchrun``: the built-in GPT in 2 stages, 1F1B.

    torchrun --standalone --nproc-per-node 2 workflows/benchmarks/torchrun_scripts/pp.py \\
        --data DATA.npz [--dim 256] [--layers 4] [--heads 8] [--batch 16] [--steps 30] \\
        [--microbatches 8]

``torch.distributed.pipelining`` as torchtitan cuts a transformer by hand: each rank copies the
model and keeps its own blocks, the first stage the embeddings too, the last the final norm and
the head (the GPT's ``forward`` skips what is None). Stage ``r`` on rank ``r``, cut between
blocks as dask-train's ``pipeline`` cuts it at ``split_points = ["layers.<layers/2>"]``, run by
``Schedule1F1B`` over ``--microbatches`` micro-batches of each global batch; the loss (the mean
cross-entropy over every token) on the last stage. SGD with momentum 0.9. ``DATA.npz`` holds
``tokens`` and ``next`` (the targets), one window a row (``workflows/benchmarks/strategies.py``
writes it). The last stage prints ``RESULT {json}``: steady samples/s, from the end of the
third step to the end of the last.
"""

import argparse
import copy
import json
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

from workers.models import GPT

WARM_STEPS = 3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--batch", type=int, default=16, help="global, per step")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, stages = dist.get_rank(), dist.get_world_size()
    data = np.load(args.data)
    tokens, targets = torch.from_numpy(data["tokens"]), torch.from_numpy(data["next"])
    vocabulary, length = int(data["vocabulary"]), tokens.shape[1]

    torch.manual_seed(args.seed)  # the same weights on every rank, before cutting
    model = GPT(vocabulary, length, dim=args.dim, n_layers=args.layers, n_heads=args.heads)
    # Equal numbers of blocks per stage: stage r keeps blocks [r*n/s, (r+1)*n/s).
    keys = list(model.layers)
    mine = keys[rank * len(keys) // stages : (rank + 1) * len(keys) // stages]
    stage = copy.deepcopy(model)
    del model
    for key in keys:
        if key not in mine:
            del stage.layers[key]
    if rank > 0:
        stage.tok_embeddings = stage.pos_embeddings = None
    if rank < stages - 1:
        stage.norm = stage.output = None

    def loss_fn(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())

    pipeline_stage = PipelineStage(stage, rank, stages, torch.device("cpu"))
    schedule = Schedule1F1B(pipeline_stage, n_microbatches=args.microbatches, loss_fn=loss_fn)
    optimizer = torch.optim.SGD(stage.parameters(), lr=args.lr, momentum=0.9)

    # The same global batches on every rank: the first stage reads the tokens, the last the
    # targets.
    order = torch.randperm(len(tokens), generator=torch.Generator().manual_seed(args.seed))
    assert args.steps * args.batch <= len(order), "too few windows for --steps x --batch"
    first, last = rank == 0, rank == stages - 1
    stage.train()
    started = 0.0
    losses: list[torch.Tensor] = []
    for step in range(args.steps):
        rows = order[step * args.batch :][: args.batch]
        optimizer.zero_grad(set_to_none=True)
        losses.clear()
        if first:
            schedule.step(tokens[rows])
        elif last:
            schedule.step(target=targets[rows], losses=losses)
        else:
            schedule.step()
        optimizer.step()
        if step + 1 == WARM_STEPS:
            started = time.perf_counter()
    seconds = time.perf_counter() - started
    if last:  # the stage that computes the loss reports, as dask-train's pipeline does
        result = {
            "steady_samples_per_s": (args.steps - WARM_STEPS) * args.batch / seconds,
            "threads": torch.get_num_threads(),
        }
        print("RESULT " + json.dumps(result), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
