"""A sweep's trials packed on the workers against the same trials one after another.

    python -m workflows.benchmarks.sweep [--trials 8] [--workers 2] [--steps 1200]

On one warm cluster of ``--workers`` workers: ``sweep`` of ``--trials`` one-rank trials (a
small MLP trained for ``--steps`` steps on a fixed batch, about 2 s each; random sampler with
a fixed seed, no pruner), then the same trials, with the same parameters, as one ``launch``
after another. The ratio is of the two wall times: with trials packed two at a time on two
workers it approaches 0.5 (the goal: at most 0.6), as far as the machine lets two processes
compute at once. That bound is measured in the same run: the same trials' work in plain
processes of one torch thread each (as the workers run), ``--workers`` at a time against one
after another.
"""

import argparse
import multiprocessing
import time

import optuna
import torch
import torch.nn.functional as F
from torch import nn

from workflows.cluster.training_cluster import start_cluster
from workflows.jobs.launch import launch
from workflows.sweeps.sweep import sweep

SPACE = {"lr": ("log", 1e-3, 1e-1), "hidden": [256, 512]}


def fit(ctx, params: dict, steps: int) -> float:
    """``steps`` steps of SGD on one fixed batch; the final loss, reported every 50 steps."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(64, params["hidden"]), nn.ReLU(), nn.Linear(params["hidden"], 10)
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=params["lr"])
    x, y = torch.randn(512, 64), torch.randint(0, 10, (512,))
    for step in range(steps):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        if (step + 1) % 50 == 0:
            ctx.report(loss=loss.item(), step=step + 1)
    return loss.item()


class _NoContext:
    def report(self, **_: float) -> None:
        pass


def _fit_alone(params: dict, steps: int) -> float:
    torch.set_num_threads(1)  # as each worker runs
    return fit(_NoContext(), params, steps)


def plain_processes(trials: list[dict], steps: int, at_once: int) -> float:
    """Wall seconds of the trials' work in plain processes, ``at_once`` at a time."""
    with multiprocessing.get_context("spawn").Pool(at_once) as pool:
        pool.starmap(_fit_alone, [({"lr": 0.01, "hidden": 256}, 10)] * at_once)  # imports
        started = time.perf_counter()
        pool.starmap(_fit_alone, [(params, steps) for params in trials], chunksize=1)
        return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=8)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=1200)
    args = parser.parse_args()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    with start_cluster(n_workers=args.workers, dashboard_port=0) as cluster:
        # Imports and first-touch on every worker, paid before either clock starts.
        launch(fit, {"lr": 0.01, "hidden": 256}, 10, cluster=cluster, world_size=args.workers)
        started = time.perf_counter()
        result = sweep(
            fit,
            SPACE,
            n_trials=args.trials,
            metric="loss",
            sampler=optuna.samplers.RandomSampler(seed=0),
            cluster=cluster,
            steps=args.steps,
        )
        swept_s = time.perf_counter() - started
        started = time.perf_counter()
        for params in result.trials["params"]:
            launch(fit, params, args.steps, cluster=cluster, world_size=1)
        sequential_s = time.perf_counter() - started
    params = list(result.trials["params"])
    alone_s = plain_processes(params, args.steps, 1)
    packed_s = plain_processes(params, args.steps, args.workers)
    trial_s = result.trials["wall_s"].median()
    print(f"{args.trials} one-rank trials of {args.steps} steps on {args.workers} workers:")
    print(f"  one launch after another        {sequential_s:6.1f} s")
    print(f"  sweep, packed on the workers    {swept_s:6.1f} s (a trial's median {trial_s:.1f} s)")
    print(f"  ratio sweep / one after another {swept_s / sequential_s:6.2f} (goal: at most 0.6)")
    print(f"the same work in plain processes, {args.workers} at a time against one by one:")
    print(f"  ratio (this machine's bound)    {packed_s / alone_s:6.2f}")


if __name__ == "__main__":
    main()
