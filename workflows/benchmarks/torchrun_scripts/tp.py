"""Tensor parallelism by hand, for ``torchrun``: the built-in GPT split by Megatron's plan.

    torchrun --standalone --nproc-per-node 2 workflows/benchmarks/torchrun_scripts/tp.py \\
        --data DATA.npz [--dim 256] [--layers 4] [--heads 8] [--batch 16] [--steps 30]

``parallelize_module`` with the plan dask-train gives the GPT (``workers/tensor_plans.py``):
each block's q, k, v projections and its feed-forward's first layer split by columns (each rank
a share of the heads and hidden units), the attention's output and the feed-forward's second
layer by rows; the embeddings, norms and head whole on every rank. Every rank runs every batch
whole. SGD with momentum 0.9, the mean cross-entropy over every token. ``DATA.npz`` holds
``tokens`` and ``next`` (the targets), one window a row (``workflows/benchmarks/strategies.py``
writes it). Rank 0 prints ``RESULT {json}``: steady samples/s, from the end of the third step
to the end of the last.
"""

import argparse
import json
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

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
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    data = np.load(args.data)
    tokens, targets = torch.from_numpy(data["tokens"]), torch.from_numpy(data["next"])
    vocabulary, length = int(data["vocabulary"]), tokens.shape[1]

    torch.manual_seed(args.seed)  # the same weights on every rank, before splitting
    model = GPT(vocabulary, length, dim=args.dim, n_layers=args.layers, n_heads=args.heads)
    plan = {}
    for key in model.layers:
        block = f"layers.{key}"
        plan |= {f"{block}.attention.{name}": ColwiseParallel() for name in ("wq", "wk", "wv")}
        plan[f"{block}.attention.wo"] = RowwiseParallel()
        plan[f"{block}.feed_forward.w1"] = ColwiseParallel()
        plan[f"{block}.feed_forward.w2"] = RowwiseParallel()
    model = parallelize_module(model, mesh, plan)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    # The same global batches on every rank: the ranks split the layers, not the batch.
    order = torch.randperm(len(tokens), generator=torch.Generator().manual_seed(args.seed))
    assert args.steps * args.batch <= len(order), "too few windows for --steps x --batch"
    model.train()
    started = 0.0
    for step in range(args.steps):
        rows = order[step * args.batch :][: args.batch]
        x, y = tokens[rows], targets[rows]
        optimizer.zero_grad(set_to_none=True)
        logits = model(x)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        loss.backward()
        optimizer.step()
        if step + 1 == WARM_STEPS:
            started = time.perf_counter()
    seconds = time.perf_counter() - started
    if dist.get_rank() == 0:
        result = {
            "steady_samples_per_s": (args.steps - WARM_STEPS) * args.batch / seconds,
            "loss": loss.item(),
            "threads": torch.get_num_threads(),
        }
        print("RESULT " + json.dumps(result), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
