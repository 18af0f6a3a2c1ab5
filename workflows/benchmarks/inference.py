"""Batch inference on the cluster vs one process scoring the same data with the same model.

    python -m workflows.benchmarks.inference [--images 20000] [--workers 2] [--repeats 3]

A synthetic dataset store of ``--images`` 32 px images is built once in a temporary folder, and
the seed article's CNN (10 classes) is saved as a checkpoint. Each repeat then scores the
store's training split four times, alternating:

- one process: the same task function (``workers.inference.score``) called in a plain loop over
  the same partitions, each written to its own Parquet file, torch at its default threads, in a
  fresh Python process with glibc's malloc defaults (what a user's script gets), warmed like
  the workers before the clock starts: one partition scored and written first, so that neither
  side pays imports, first allocations or pyarrow's start in the figure;
- the same, given the malloc settings our workers get
(``workflows.cluster.training_cluster.TUNED_MALLOC``); - two such processes side by side (no Dask),
each scoring every other partition: what this   machine's cores give two processes at all, the
ceiling for any 2-worker scheme; - dask-train: ``predict()`` on N workers, from registering the
model plugin to the last Parquet   file written.

All do the same work (read, forward pass, probabilities, Parquet) with the same batch size;
metrics are off. The ratios are of the medians of images/s (dask / one process).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from workers.data import DataConfig
from workers.inference import score
from workers.models import build_model
from workers.spec.predict import PredictConfig
from workflows.cluster.training_cluster import TUNED_MALLOC, start_cluster
from workflows.data.preprocess import prepare_store
from workflows.prediction.batch_predict import PreparedPrediction, predict, prepare


def score_in_one_process(
    prepared: PreparedPrediction,
    output: Path,
    share: tuple[int, int] = (0, 1),
    *,
    warm_up: bool = True,
) -> dict[str, float]:
    """Score and write partitions ``share[0]::share[1]`` in a plain loop in this process;
    returns the count and the wall-clock start and stop (comparable across processes).

    ``warm_up`` first scores and writes this share's first partition untimed, as the cluster's
    workers have done before their figure is taken (the model is built again in the timed part,
    as each worker loads it in every job)."""
    if warm_up:
        score_in_one_process(
            prepared, output / "warm-up", (share[0], len(prepared.plan.partitions)), warm_up=False
        )
    started = time.time()
    device = torch.device("cpu")
    model = prepared.spec.build(device)
    output.mkdir(parents=True, exist_ok=True)
    count = 0
    for partition in prepared.plan.partitions[share[0] :: share[1]]:
        frame = score(
            model, partition, prepared.job, device=device, precision=prepared.settings.precision
        )
        frame.to_parquet(output / f"part.{partition.index:06d}.parquet", index=False)
        count += len(frame)
    return {"count": count, "start": started, "stop": time.time()}


TUNED = {k: str(v) for k, v in TUNED_MALLOC.items()}
# The baselines: name → (environment, processes side by side).
BASELINES = {
    "one process (glibc malloc defaults)": ({}, 1),
    "one process (our malloc settings)": (TUNED, 1),
    "2 plain processes, half each, no Dask": (TUNED, 2),
}


def baseline_run(request: dict, environ: dict[str, str], processes: int) -> float:
    """images/s of ``processes`` fresh interpreters (malloc settings are read at start), each
    scoring its share of the partitions, all at the same time."""
    env = {k: v for k, v in os.environ.items() if k not in TUNED_MALLOC}
    running = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "workflows.benchmarks.inference",
                "--one-process",
                json.dumps(request | {"share": [k, processes]}),
            ],
            env=env | environ,
            stdout=subprocess.PIPE,
            text=True,
        )
        for k in range(processes)
    ]
    outcomes = []
    for process in running:
        stdout, _ = process.communicate(timeout=1800)
        if process.returncode:
            raise RuntimeError(f"the one-process baseline failed (exit {process.returncode})")
        outcomes.append(json.loads(stdout.splitlines()[-1]))
    wall = max(o["stop"] for o in outcomes) - min(o["start"] for o in outcomes)
    return sum(o["count"] for o in outcomes) / wall


def _one_process_main(request: dict) -> None:
    prepared = prepare(
        model=request["model"],
        input=request["input"],
        output=request["output"] + "-unused",
        config=request["config"],
        settings=request["settings"],
    )
    share = tuple(request["share"])
    print(json.dumps(score_in_one_process(prepared, Path(request["output"]), share)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=20000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--partition-size", type=int, default=1024)
    parser.add_argument(
        "--threads-per-worker", type=int, default=None, help="torch threads in each worker"
    )
    parser.add_argument("--one-process", metavar="REQUEST", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one_process:
        _one_process_main(json.loads(args.one_process))
        return

    with (
        tempfile.TemporaryDirectory() as tmp,
        start_cluster(n_workers=args.workers, dashboard_port=0) as cluster,
    ):
        data = DataConfig(
            dataset="synthetic",
            synthetic_samples=args.images,
            val_fraction=0.01,
            store=f"{tmp}/store",
        )
        manifest = prepare_store(cluster.client, data, seed=0)
        checkpoint = Path(tmp) / "model.pt"
        torch.save(build_model("cifar_cnn", num_classes=10, seed=0).state_dict(), checkpoint)
        config = {"name": "inference-bench", "data": data.model_dump()}
        settings = PredictConfig(
            split="train",
            batch_size=args.batch_size,
            partition_size=args.partition_size,
            outputs="probabilities",
            evaluate=False,
            threads_per_worker=args.threads_per_worker,
        )

        def on_cluster(output: Path) -> float:
            result = predict(
                model=checkpoint,
                input=data.store,
                output=output,
                config=config,
                settings=settings,
                cluster=cluster,
            )
            return result.images_per_s

        on_cluster(Path(tmp) / "warm-up")  # workers import torch and zarr once
        runs: dict[str, list[float]] = {name: [] for name in [*BASELINES, "dask"]}
        for repeat in range(args.repeats):
            request = {
                "model": str(checkpoint),
                "input": data.store,
                "config": config,
                "settings": settings.model_dump(),
            }
            for i, (name, (environ, processes)) in enumerate(BASELINES.items()):
                output = {"output": f"{tmp}/loop-{repeat}-{i}"}
                runs[name].append(baseline_run(request | output, environ, processes))
            runs["dask"].append(on_cluster(Path(tmp) / f"dask-{repeat}"))
            figures = ", ".join(f"{v[-1]:.0f}" for v in runs.values())
            print(f"repeat {repeat + 1}: images/s {figures}", flush=True)
        medians = {name: statistics.median(values) for name, values in runs.items()}
        dask = medians.pop("dask")
        count = manifest.counts["train"]
        print(
            f"\nseed CNN, {count} images of 32 px from a dataset store, batch {args.batch_size}, "
            f"partitions of {args.partition_size}, median of {args.repeats}:"
        )
        for name, value in medians.items():
            print(f"  {name:<40} {value:6.0f} images/s")
        print(f"  {f'dask-train, {args.workers} workers':<40} {dask:6.0f} images/s")
        for name, value in medians.items():
            print(f"  ratio dask-train / {name:<40} {dask / value:6.3f}")


if __name__ == "__main__":
    main()
