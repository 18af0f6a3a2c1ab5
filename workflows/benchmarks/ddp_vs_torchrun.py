"""dask-train DDP vs plain ``torchrun`` on the same model, data, global batch and process count,
and the built-in trainer vs the same work written as a user function on ``launch``.

    python -m workflows.benchmarks.ddp_vs_torchrun [--workers 2] [--steps 150] [--repeats 3]
        [--latency-jobs 10] [--device cpu|cuda] [--model cnn|gpt]

torchrun and dask-train's built-in trainer both run :func:`workers.train.train`, so the only
difference is what launched the ranks: torchrun's processes, or Dask worker processes
bootstrapped by dask-train. torchrun runs twice per repeat: as a user gets it (glibc's malloc
defaults) and with the malloc settings dask-train gives its workers, which separates the
launcher's cost from the allocator's gain. The fourth side, :func:`user_ddp_loop` on
``launch``, is the trainer's work as a user writes it (the seed CNN, DDP, SGD with the same
settings, the same per-rank batch and steps) on the same warm workers: the built-in trainer's
own overhead. It trains on random tensors already in memory, while the trainer reads its
synthetic store (chunk reads, row gathers, float32 batches in a prefetch thread) and keeps the
epoch's loss and accuracy sums: that reading and bookkeeping is the trainer's work. Runs
alternate (the order rotates each repeat) so that machine noise hits all alike; ratios are of
the medians of steady-state samples/s (from the fourth step on).

Then the warm first step: jobs of the digits demo config cut to 3 steps, on the ``--workers``
cluster and on a 4-worker cluster started here, from the ``train()`` call to rank 0's first
finished step (``TrainResult.first_step_s``); the first job of each cluster (imports, the
store's first read) is left out; median and max of the rest.

``--model gpt``: the built-in GPT (4 blocks, 128 wide, 0.9 M parameters with the byte
vocabulary) on windows of 128 bytes of the standard library's top-level modules (the text
store; two of them held out), in place of the seed CNN on the synthetic images; torchrun and
the built-in trainer only (the user-function side and the first steps are the CNN's).

``--device cpu`` (the default) compares on gloo and hides any GPU from both sides, so the
figures mean the same on every machine; ``--device cuda`` compares on nccl, one process per
GPU (at most ``--workers``), dask-train on a one-worker-per-GPU cluster.
"""

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from workers.models import build_model
from workers.spec.run import RunConfig
from workflows.cluster.training_cluster import (
    TUNED_MALLOC,
    TrainingCluster,
    count_gpus,
    start_cluster,
)
from workflows.jobs.launch import launch
from workflows.runs.config import load_config
from workflows.runs.driver import train

SYNTHETIC_SAMPLES = 16384
DIGITS_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "digits_ddp.toml"


# What each model trains on: the seed CNN on the synthetic images, the built-in GPT on windows
# of the standard library's top-level modules (two files, 69 kB, held out: each run validates
# once, and throughput is measured on the steps).
WORKLOADS: dict[str, dict] = {
    "cnn": {
        "data": {"dataset": "synthetic", "synthetic_samples": SYNTHETIC_SAMPLES, "drop_last": True}
    },
    "gpt": {
        "data": {
            "dataset": "text",
            "root": "python:stdlib",
            "files": "*.py",
            "sequence_length": 128,
            "drop_last": True,
            "val_fraction": 0.01,
        },
        "model": {"name": "gpt", "kwargs": {"dim": 128, "n_layers": 4, "n_heads": 4}},
    },
}


def benchmark_config(steps: int, batch_size: int, model: str = "cnn") -> RunConfig:
    training = {
        "strategy": "ddp",
        "epochs": 1,
        "max_steps": steps,
        "batch_size": batch_size,
        "lr": 0.01,
    }
    return load_config({"name": f"bench-{model}", **WORKLOADS[model], "training": training})


def run_torchrun(
    config: RunConfig, workers: int, *, tuned_malloc: bool, device: str = "cpu"
) -> float:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={workers}",
        "-m",
        "workflows.benchmarks.torchrun_rank",
        config.model_dump_json(),
        device,
    ]
    # torchrun would set OMP_NUM_THREADS itself (with a warning) for several processes per node.
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env["OMP_NUM_THREADS"] = "1"
    if tuned_malloc:
        env.update({k: str(v) for k, v in TUNED_MALLOC.items()})
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"torchrun failed:\n{done.stderr[-3000:]}")
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))["steady_samples_per_s"]


def user_ddp_loop(ctx, steps: int, batch_size: int) -> float:
    """The built-in trainer's work as a user writes it: the seed CNN, DDP, SGD (the trainer's
    defaults: momentum 0.9, no weight decay), a heartbeat per step; steady samples/s from the
    fourth step on, as the trainer counts them."""
    generator = torch.Generator().manual_seed(0)
    per_rank = batch_size // ctx.world_size
    images = torch.randn(64 * per_rank, 3, 32, 32, generator=generator).to(ctx.device)
    labels = torch.randint(0, 10, (64 * per_rank,), generator=generator).to(ctx.device)
    model = build_model("cifar_cnn", num_classes=10, seed=0).to(ctx.device)
    model = DistributedDataParallel(
        model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    started = None
    for step in range(steps):
        if step == 3:
            if ctx.device.type == "cuda":
                torch.cuda.synchronize(ctx.device)
            started = time.perf_counter()
        start = (step % 64) * per_rank
        x, y = images[start : start + per_rank], labels[start : start + per_rank]
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        ctx.heartbeat(samples=len(y))
    assert started is not None
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)
    return (steps - 3) * batch_size / (time.perf_counter() - started)


def digits_config(world_size: int) -> RunConfig:
    """The demo config cut to 3 steps, on ``world_size`` ranks."""
    config = load_config(DIGITS_CONFIG)
    return config.model_copy(
        update={
            "training": config.training.model_copy(update={"max_steps": 3}),
            "launch": config.launch.model_copy(update={"world_size": world_size}),
        }
    )


def warm_first_steps(cluster: TrainingCluster, world_size: int, jobs: int) -> list[float]:
    """Seconds from the ``train()`` call to the first step, for ``jobs`` warm jobs (one job
    before them, left out, warms the cluster)."""
    config = digits_config(world_size)
    train(config, cluster=cluster, on_event=None)
    return [train(config, cluster=cluster, on_event=None).first_step_s for _ in range(jobs)]


def describe_first_steps(label: str, seconds: list[float]) -> str:
    return (
        f"  {label:<46} median {statistics.median(seconds):.3f} s, max {max(seconds):.3f} s "
        f"({len(seconds)} jobs)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--latency-jobs", type=int, default=10)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--model", choices=("cnn", "gpt"), default="cnn")
    args = parser.parse_args()
    cnn = args.model == "cnn"

    if args.device == "cpu":
        # Before anything asks CUDA: the workers and torchrun's ranks inherit it.
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    else:
        gpus = count_gpus()
        if not gpus:
            raise SystemExit("--device cuda: NVML sees no GPU on this machine")
        args.workers = min(args.workers, gpus)
    config = benchmark_config(args.steps, args.batch_size, args.model)
    rates: dict[str, list[float]] = {
        "plain": [],
        "tuned": [],
        "dask": [],
        "user": [] if cnn else [math.nan],
    }
    kind = "cuda" if args.device == "cuda" else "cpu"
    first: dict[int, list[float]] = {}
    with start_cluster(n_workers=args.workers, kind=kind, dashboard_port=0) as cluster:
        # Imports and first-touch, paid once; and the steps the trainer runs (one epoch of the
        # training split, at most --steps), which the user function runs too.
        steps = int(train(config, cluster=cluster, on_event=None).history[-1]["step"])
        if cnn:
            launch(user_ddp_loop, 5, args.batch_size, cluster=cluster)
        sides = {
            "plain": lambda: run_torchrun(
                config, args.workers, tuned_malloc=False, device=args.device
            ),
            "tuned": lambda: run_torchrun(
                config, args.workers, tuned_malloc=True, device=args.device
            ),
            "dask": lambda: train(config, cluster=cluster, on_event=None).steady_samples_per_s,
            "user": lambda: statistics.mean(
                launch(user_ddp_loop, steps, args.batch_size, cluster=cluster).results
            ),
        }
        if not cnn:
            del sides["user"]
        order = list(sides)
        for repeat in range(args.repeats):
            # Rotated each repeat: no side always follows the same one.
            shift = repeat % len(order)
            for name in order[shift:] + order[:shift]:
                rates[name].append(sides[name]())
            user = f", the same work on launch {rates['user'][-1]:.0f}" if cnn else ""
            print(
                f"repeat {repeat + 1}: torchrun {rates['plain'][-1]:.0f}, torchrun with our malloc "
                f"settings {rates['tuned'][-1]:.0f}, dask-train {rates['dask'][-1]:.0f}{user} "
                "samples/s",
                flush=True,
            )
        if cnn:
            first[args.workers] = warm_first_steps(cluster, args.workers, args.latency_jobs)
    if cnn and args.workers != 4 and (args.device == "cpu" or count_gpus() >= 4):
        with start_cluster(n_workers=4, kind=kind, dashboard_port=0) as cluster:
            first[4] = warm_first_steps(cluster, 4, args.latency_jobs)

    plain, tuned, dask, user = (
        statistics.median(rates[k]) for k in ("plain", "tuned", "dask", "user")
    )
    print()
    print(
        f"{'seed CNN' if cnn else 'GPT on text'}, {args.workers} processes on {args.device}, "
        f"global batch {args.batch_size}, "
        f"{steps} steps, median of {args.repeats}:"
    )
    print(f"  torchrun --standalone (glibc malloc defaults)  {plain:8.0f} samples/s")
    print(f"  torchrun --standalone (our malloc settings)    {tuned:8.0f} samples/s")
    print(f"  dask-train DDP (built-in trainer)              {dask:8.0f} samples/s")
    if cnn:
        print(f"  the same work as a user function on launch     {user:8.0f} samples/s")
    print(f"  ratio dask-train / plain torchrun              {dask / plain:8.3f}")
    print(f"  ratio dask-train / torchrun, same malloc       {dask / tuned:8.3f}")
    if not cnn:
        return
    print(f"  ratio built-in trainer / user function         {dask / user:8.3f}")
    print("warm first step, digits config (3 steps), train() call to the first step:")
    for ranks, seconds in sorted(first.items()):
        print(describe_first_steps(f"{ranks} ranks on a {ranks}-worker cluster", seconds))


if __name__ == "__main__":
    main()
