"""dask-train DDP vs plain ``torchrun`` on the same model, data, global batch and process count.

    python -m workflows.benchmarks.ddp_vs_torchrun [--workers 2] [--steps 150] [--repeats 3]
        [--device cpu|cuda]

Both sides run :func:`workers.train.train`, so the only difference is what launched the ranks:
torchrun's processes, or Dask worker processes bootstrapped by dask-train. torchrun runs twice
per repeat: as a user gets it (glibc's malloc defaults) and with the malloc settings dask-train
gives its workers, which separates the launcher's cost from the allocator's gain. Runs alternate
so that machine noise hits all alike; ratios are of the medians of steady-state samples/s.
Also prints the time from submit to the first finished step for short jobs on a warm cluster.

``--device cpu`` (the default) compares on gloo and hides any GPU from both sides, so the
figures mean the same on every machine; ``--device cuda`` compares on nccl, one process per
GPU (at most ``--workers``), dask-train on a one-worker-per-GPU cluster.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from workflows.cluster import TUNED_MALLOC, count_gpus, start_cluster
from workflows.config import RunConfig, load_config
from workflows.driver import train


def benchmark_config(steps: int, batch_size: int) -> RunConfig:
    return load_config(
        {
            "name": "bench",
            "data": {"dataset": "synthetic", "synthetic_samples": 16384, "drop_last": True},
            "training": {
                "strategy": "ddp",
                "epochs": 1,
                "max_steps": steps,
                "batch_size": batch_size,
                "lr": 0.01,
            },
        }
    )


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--latency-jobs", type=int, default=10)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args()

    if args.device == "cpu":
        # Before anything asks CUDA: the workers and torchrun's ranks inherit it.
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    else:
        gpus = count_gpus()
        if not gpus:
            raise SystemExit("--device cuda: NVML sees no GPU on this machine")
        args.workers = min(args.workers, gpus)
    config = benchmark_config(args.steps, args.batch_size)
    rates: dict[str, list[float]] = {"plain": [], "tuned": [], "dask": []}
    kind = "cuda" if args.device == "cuda" else "cpu"
    with start_cluster(n_workers=args.workers, kind=kind, dashboard_port=0) as cluster:
        warmup = config.model_copy(
            update={"training": config.training.model_copy(update={"max_steps": 5})}
        )
        train(warmup, cluster=cluster, on_event=None)  # imports and first-touch, both paid once
        for repeat in range(args.repeats):
            for name, tuned in (("plain", False), ("tuned", True)):
                rates[name].append(
                    run_torchrun(config, args.workers, tuned_malloc=tuned, device=args.device)
                )
            rates["dask"].append(train(config, cluster=cluster, on_event=None).steady_samples_per_s)
            print(
                f"repeat {repeat + 1}: torchrun {rates['plain'][-1]:.0f}, torchrun with our malloc "
                f"settings {rates['tuned'][-1]:.0f}, dask-train {rates['dask'][-1]:.0f} samples/s",
                flush=True,
            )

        one_step = config.model_copy(
            update={"training": config.training.model_copy(update={"max_steps": 1})}
        )
        latencies, walls = [], []
        for _ in range(args.latency_jobs):
            started = time.perf_counter()
            result = train(one_step, cluster=cluster, on_event=None)
            walls.append(time.perf_counter() - started)
            latencies.append(result.first_step_s)

    plain, tuned, dask = (statistics.median(rates[k]) for k in ("plain", "tuned", "dask"))
    print()
    print(
        f"seed CNN, {args.workers} processes on {args.device}, global batch {args.batch_size}, "
        f"{args.steps} steps, median of {args.repeats}:"
    )
    print(f"  torchrun --standalone (glibc malloc defaults)  {plain:8.0f} samples/s")
    print(f"  torchrun --standalone (our malloc settings)    {tuned:8.0f} samples/s")
    print(f"  dask-train DDP                                 {dask:8.0f} samples/s")
    print(f"  ratio dask-train / plain torchrun              {dask / plain:8.3f}")
    print(f"  ratio dask-train / torchrun, same malloc       {dask / tuned:8.3f}")
    print(
        f"warm cluster, {args.latency_jobs} one-step jobs: submit → first step median "
        f"{statistics.median(latencies):.3f} s (max {max(latencies):.3f} s), whole job median "
        f"{statistics.median(walls):.3f} s"
    )


if __name__ == "__main__":
    main()
