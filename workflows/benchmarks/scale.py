"""How launching and growing scale with the world, on one machine, beside torchrun.

    python -m workflows.benchmarks.scale [--sizes 2 4 8 16]

For each size n, on a warm local cluster of n workers: ``launch`` of a function that does one
all-reduce (call to rank 0's first report; the median of three after one to warm up), and the
pause of an ``n:n+1`` elastic job growing by one worker (``cluster.scale(n + 1)``: a worker
forked warm; the last step before to the first step after). Beside them, ``torchrun
--standalone --nproc_per_node=n`` of the same one-all-reduce script: process start to rank 0's
all-reduce done, a fresh set of processes each time (what torchrun does on every start and
every restart). The machine's load average is printed beside the figures: a shared machine's
other work shows in every number.
"""

import argparse
import os
import statistics
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from workflows.benchmarks.elastic import ElasticJob
from workflows.benchmarks.launch_vs_torchrun import torchrun_first_step
from workflows.cluster.training_cluster import start_cluster
from workflows.jobs.launch import launch

WAIT_S = 300.0


def one_all_reduce(ctx) -> None:
    total = torch.ones(1)
    dist.all_reduce(total)
    ctx.report(step=1, total=total.item())


def warm_launch_s(cluster, size: int) -> float:
    launch(one_all_reduce, cluster=cluster, world_size=size)  # warm: plugins, connections
    return statistics.median(
        launch(one_all_reduce, cluster=cluster, world_size=size).first_step_s for _ in range(3)
    )


def grow_pause_s(cluster, size: int, folder: Path, step_s: float) -> float:
    """An ``size:size+1`` job on ``size`` workers while one more joins: its resize's pause."""
    job = ElasticJob(cluster, step_s, folder / f"stop-{size}", world_size=f"{size}:{size + 1}")
    job.steps.wait(f"{size} ranks", job.steps.world(size))
    cluster.cluster.scale(size + 1)
    job.steps.wait(f"{size + 1} ranks", job.steps.world(size + 1))
    (resize,) = job.stop()
    return resize["pause_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--step-ms", type=float, default=30.0)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for size in args.sizes:
            # 16 workers start in seconds on a quiet machine, minutes on a loaded one.
            with start_cluster(n_workers=size, dashboard_port=0, start_timeout_s=600) as cluster:
                launched = warm_launch_s(cluster, size)
                grown = grow_pause_s(cluster, size, Path(folder), args.step_ms / 1000)
            cold = torchrun_first_step(size)
            rows.append((size, launched, grown, cold, os.getloadavg()[0]))
            print(rows[-1], flush=True)
    print(
        "| ranks | dask-train: warm launch, one all-reduce | grow by one worker: pause | "
        "torchrun --standalone, same script | load average |"
    )
    print("|---|---|---|---|---|")
    for size, launched, grown, cold, load in rows:
        print(f"| {size} | {launched:.2f} s | {grown:.2f} s | {cold:.1f} s | {load:.1f} |")
    print(f"{os.cpu_count()} cores")


if __name__ == "__main__":
    main()
