"""``launch`` against dask-pytorch-ddp's ``dispatch.run`` on the same warm cluster.

    pip install dask-pytorch-ddp==0.2.2   # not a dependency of dask-train
    python -m workflows.benchmarks.dask_pytorch_ddp [--repeats 5] [--steps 300]

1. One job at a time: the same DDP function (a small MLP, ``--steps`` steps of batch 64 per
   rank) on both workers, alternating the two launchers; the median wall time of a job from
   the call to every rank's result, and the job's first-step latency.
2. Two one-rank jobs at once on the two workers, as two notebooks sharing a cluster would.
"""

import argparse
import statistics
import threading
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from workflows.cluster.training_cluster import start_cluster
from workflows.jobs.launch import launch


def fit(steps: int) -> float:
    """DDP on the process group already formed; returns when the first step ended."""
    torch.manual_seed(0)
    model = DistributedDataParallel(
        nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(dist.get_rank())
    x, y = (
        torch.randn(64, 64, generator=generator),
        torch.randint(0, 10, (64,), generator=generator),
    )
    first = 0.0
    for step in range(steps):
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        if step == 0:
            first = time.time()
    return first


def on_launch(ctx, steps: int) -> float:
    return fit(steps)


def one_job(client, which: str, steps: int) -> tuple[float, float]:
    """Wall seconds of one 2-rank job, and its call-to-first-step seconds."""
    from dask_pytorch_ddp import dispatch

    called = time.time()
    if which == "launch":
        firsts = launch(on_launch, steps, cluster=client, world_size=2).results
    else:
        # Its run() puts positional arguments before its own keywords: keywords only.
        firsts = client.gather(dispatch.run(client, fit, backend="gloo", steps=steps))
    return time.time() - called, min(firsts) - called


def two_at_once(client, which: str, steps: int) -> list[str]:
    """Two one-rank jobs started together: what each ended with."""
    from dask_pytorch_ddp import dispatch

    outcomes: list[str] = []
    workers = sorted(client.scheduler_info()["workers"])

    def run(i: int) -> None:
        try:
            if which == "launch":
                launch(on_launch, steps, cluster=client, world_size=1)
            else:
                # Its run() takes every worker; one job per worker is what two users would do
                # with it: a task of dispatch_with_ddp pinned there, world size 1.
                future = client.submit(
                    dispatch.dispatch_with_ddp,
                    pytorch_function=fit,
                    master_addr="127.0.0.1",
                    master_port=23456,
                    rank=0,
                    world_size=1,
                    backend="gloo",
                    workers=[workers[i]],
                    pure=False,
                    steps=steps,
                )
                future.result(timeout=120)
            outcomes.append("ok")
        except Exception as error:  # what the user would see
            outcomes.append(f"{type(error).__name__}: {str(error).splitlines()[0][:120]}")

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return outcomes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    try:
        import dask_pytorch_ddp  # noqa: F401
    except ImportError:
        raise SystemExit("pip install dask-pytorch-ddp==0.2.2 first (not a dependency)") from None
    with start_cluster(n_workers=2, dashboard_port=0) as cluster:
        client = cluster.client
        for which in ("launch", "dask-pytorch-ddp"):  # warm: imports, first touch
            one_job(client, which, 10)
        timings: dict[str, list[tuple[float, float]]] = {"launch": [], "dask-pytorch-ddp": []}
        for _ in range(args.repeats):
            for which in timings:
                timings[which].append(one_job(client, which, args.steps))
        together = {which: two_at_once(client, which, args.steps) for which in timings}
    print(f"2 ranks, {args.steps} DDP steps, median of {args.repeats} (first step in brackets):")
    for which, runs in timings.items():
        wall = statistics.median(w for w, _ in runs)
        first = statistics.median(f for _, f in runs)
        print(f"  {which:18s} {wall:6.3f} s ({first:.3f} s)")
    ratio = statistics.median(w for w, _ in timings["launch"]) / statistics.median(
        w for w, _ in timings["dask-pytorch-ddp"]
    )
    print(f"  ratio launch / dask-pytorch-ddp {ratio:.3f}")
    print("two one-rank jobs at once on the two workers:")
    for which, outcomes in together.items():
        print(f"  {which:18s} {'; '.join(outcomes)}")


if __name__ == "__main__":
    main()
