"""Batch inference on the cluster vs one process scoring the same data with the same model.

    python -m workflows.benchmarks.inference [--images 20000] [--workers 2] [--repeats 3]

A synthetic dataset store of ``--images`` 32 px images is built once in a temporary folder, and
the seed article's CNN (10 classes) is saved as a checkpoint. Each repeat then scores the
store's training split three times, alternating:

- one process: the same task function (``workers.inference.score``) called in a plain loop over
  the same partitions, each written to its own Parquet file, torch at its default threads, in a
  fresh Python process with glibc's malloc defaults (what a user's script gets);
- the same, given the malloc settings our workers get (``workflows.cluster.TUNED_MALLOC``);
- dask-train: ``predict()`` on N workers, from registering the model plugin to the last Parquet
  file written.

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
from workflows.cluster import TUNED_MALLOC, start_cluster
from workflows.predict import PredictConfig, PreparedPrediction, predict, prepare
from workflows.preprocess import prepare_store


def score_in_one_process(prepared: PreparedPrediction, output: Path) -> float:
    """images/s of the same partitions scored and written in a plain loop in this process."""
    started = time.perf_counter()
    device = torch.device("cpu")
    model = prepared.spec.build(device)
    output.mkdir(parents=True)
    count = 0
    for partition in prepared.plan.partitions:
        frame = score(
            model, partition, prepared.job, device=device, precision=prepared.settings.precision
        )
        frame.to_parquet(output / f"part.{partition.index:06d}.parquet", index=False)
        count += len(frame)
    return count / (time.perf_counter() - started)


def one_process_run(request: dict, *, tuned_malloc: bool) -> float:
    """``score_in_one_process`` in a fresh interpreter (malloc settings are read at start)."""
    env = {k: v for k, v in os.environ.items() if k not in TUNED_MALLOC}
    if tuned_malloc:
        env |= {k: str(v) for k, v in TUNED_MALLOC.items()}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "workflows.benchmarks.inference",
            "--one-process",
            json.dumps(request),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
        check=True,
    )
    return float(done.stdout.split()[-1])


def _one_process_main(request: dict) -> None:
    prepared = prepare(
        model=request["model"],
        input=request["input"],
        output=request["output"],
        config=request["config"],
        settings=request["settings"],
    )
    print(score_in_one_process(prepared, Path(request["output"])))


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
        plain, tuned, dask = [], [], []
        for repeat in range(args.repeats):
            request = {
                "model": str(checkpoint),
                "input": data.store,
                "config": config,
                "settings": settings.model_dump(),
            }
            plain.append(
                one_process_run(request | {"output": f"{tmp}/plain-{repeat}"}, tuned_malloc=False)
            )
            tuned.append(
                one_process_run(request | {"output": f"{tmp}/tuned-{repeat}"}, tuned_malloc=True)
            )
            dask.append(on_cluster(Path(tmp) / f"dask-{repeat}"))
            print(
                f"repeat {repeat + 1}: one process {plain[-1]:.0f} images/s "
                f"({tuned[-1]:.0f} with our malloc settings), dask {dask[-1]:.0f} images/s",
                flush=True,
            )
        medians = [statistics.median(v) for v in (plain, tuned, dask)]
        count = manifest.counts["train"]
        print(
            f"\nseed CNN, {count} images of 32 px from a dataset store, batch {args.batch_size}, "
            f"partitions of {args.partition_size}, median of {args.repeats}:"
        )
        print(f"  one process (glibc malloc defaults)      {medians[0]:8.0f} images/s")
        print(f"  one process (our malloc settings)        {medians[1]:8.0f} images/s")
        print(f"  dask-train, {args.workers} workers                  {medians[2]:8.0f} images/s")
        print(f"  ratio dask-train / one process           {medians[2] / medians[0]:8.3f}")
        print(f"  ratio dask-train / one process, same malloc {medians[2] / medians[1]:5.3f}")


if __name__ == "__main__":
    main()
