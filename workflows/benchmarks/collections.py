"""DDP from persisted Dask partitions against the same arrays already in each rank's memory.

    python -m workflows.benchmarks.collections [--samples 100000] [--partitions 16]
        [--features 64] [--batch-size 256] [--repeats 6] [--workers 2]

One ``launch(fn, data={"train": (X, y)})`` on uneven persisted partitions; in each round every
rank trains one epoch of DDP from its Dask partitions (``ctx.shard``) and one epoch of the same
batches, in the same order, from its rows copied into one array in its memory beforehand,
alternating which goes first (ABBA). The first Dask epoch includes reading the partitions. The
ratio is of the medians of samples/s over all ranks (1.0: reading from Dask partitions costs
nothing).
"""

import argparse
import json
import statistics
import time

import dask.array as da
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from workflows.cluster.training_cluster import start_cluster
from workflows.jobs.launch import launch


def _model(features: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(features, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10)
    )


def rounds(ctx, features: int, batch_size: int, repeats: int) -> dict[str, list[float]]:
    """``repeats`` rounds of one epoch from the Dask partitions and one from in-memory arrays,
    alternating which goes first (ABBA); this rank's samples/s of each."""
    started = time.perf_counter()
    batches = ctx.shard("train", batch_size=batch_size, epoch=0)  # reads the partitions
    load_s = time.perf_counter() - started
    # The in-memory side: the same rows, copied into one array before its clock starts.
    x_all = np.concatenate(batches.rows.x_parts)
    y_all = np.concatenate(batches.rows.y_parts)
    figures: dict[str, list[float]] = {"dask": [], "memory": []}
    for round_ in range(repeats):
        sides = ("dask", "memory") if round_ % 2 == 0 else ("memory", "dask")
        for side in sides:
            model = DistributedDataParallel(_model(features))
            optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
            batches = ctx.shard("train", batch_size=batch_size, epoch=round_)
            started = time.perf_counter()
            if side == "dask":
                for x, y in batches:
                    step(model, optimizer, x, y)
            else:
                at = 0
                for size in batches.sizes:
                    index = batches.order[at : at + size]
                    at += size
                    step(
                        model,
                        optimizer,
                        torch.from_numpy(x_all[index]),
                        torch.from_numpy(y_all[index]),
                    )
            seconds = time.perf_counter() - started
            if side == "dask" and round_ == 0:
                seconds += load_s  # the first epoch pays for reading the partitions
            figures[side].append(len(batches.order) / seconds)
    return figures


def step(model: nn.Module, optimizer: torch.optim.Optimizer, x, y) -> None:
    optimizer.zero_grad(set_to_none=True)
    F.cross_entropy(model(x), y).backward()
    optimizer.step()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=100_000)
    parser.add_argument("--partitions", type=int, default=16)
    parser.add_argument("--features", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=256, help="per rank")
    parser.add_argument("--repeats", type=int, default=6, help="rounds, ABBA")
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    # Uneven partitions, as real data comes: sizes drawn around the mean.
    weights = rng.uniform(0.3, 1.7, args.partitions)
    sizes = np.diff(
        np.round(np.cumsum(weights) / weights.sum() * args.samples).astype(int), prepend=0
    )
    x = da.random.default_rng(1).standard_normal(
        (args.samples, args.features), chunks=(tuple(sizes), args.features), dtype=np.float32
    )
    y = (x[:, 0] > 0).astype(np.int64) + 2 * (x[:, 1] > 0).astype(np.int64)
    with start_cluster(n_workers=args.workers, dashboard_port=0) as cluster:
        x, y = cluster.client.persist([x, y])
        result = launch(
            rounds,
            args.features,
            args.batch_size,
            args.repeats,
            cluster=cluster,
            world_size=args.workers,
            data={"train": (x, y)},
        )
    # samples/s over all ranks, round by round
    figures = {
        side: [sum(rank[side][i] for rank in result.results) for i in range(args.repeats)]
        for side in ("dask", "memory")
    }
    dask_rate = statistics.median(figures["dask"])
    memory_rate = statistics.median(figures["memory"])
    print(
        json.dumps(
            {
                "samples": args.samples,
                "partitions": args.partitions,
                "workers": args.workers,
                "batch_size_per_rank": args.batch_size,
                "dask_samples_per_s": round(dask_rate),
                "in_memory_samples_per_s": round(memory_rate),
                "ratio": round(dask_rate / memory_rate, 3),
                "runs": {side: [round(v) for v in values] for side, values in figures.items()},
            }
        )
    )


if __name__ == "__main__":
    main()
