"""Preprocessing on the cluster vs one process, and training from the store vs from memory.

    python -m workflows.benchmarks.preprocessing [--images 10000] [--workers 2] [--repeats 3]

1. The Dask graph (decode → resize → statistics → normalize → write) on N workers against the
   same task functions called in a plain loop in this process, on an ImageFolder of JPEGs written
   once to a temporary folder. Ratio of wall times (single / dask).
2. DDP training reading each rank's shard lazily from the zarr store against the same ranks with
   the shard read into memory first (``data.in_memory``); same order, same batches. Ratio of
   steady-state samples/s (store / memory).
"""

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import zarr
from PIL import Image

from workers.data import DataConfig
from workers.preprocessing import (
    StoreArray,
    combine_statistics,
    decode_partition,
    normalize_chunk,
)
from workers.sources import Decoding, list_records
from workflows.cluster.training_cluster import start_cluster
from workflows.data.preprocess import prepare_store
from workflows.runs.config import load_config
from workflows.runs.driver import train


def write_jpeg_folder(root: Path, n: int, size: int = 128) -> None:
    rng = np.random.default_rng(0)
    for i in range(n):
        label = i % 10
        folder = root / f"class{label}"
        folder.mkdir(parents=True, exist_ok=True)
        pixels = rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
        pixels[:, :, label % 3] //= 2
        Image.fromarray(pixels).save(folder / f"{i:06d}.jpg", quality=90)


def preprocess_in_one_process(config: DataConfig, seed: int) -> None:
    """The same work as the graph, as a plain loop over the same task functions, writing the
    same arrays (uncompressed float chunks)."""
    listing = list_records(config, seed=seed)
    url, size = config.store_url, listing.partition_size
    zarr.open_group(url, mode="w")
    outcomes = {}
    how = Decoding(config.image_size, seed)
    for split, records in (("train", listing.train), ("val", listing.val)):
        outcomes[split] = [
            decode_partition(
                config.dataset,
                records[start : start + size],
                how,
                url=url,
                component=f"raw/{split}/{start // size:06d}",
            )
            for start in range(0, len(records), size)
        ]
    mean, std = combine_statistics(outcomes["train"])
    for split, parts in outcomes.items():
        blocks = [(o["component"], o["count"]) for o in parts]
        total = sum(count for _, count in blocks)
        shape = (total, 3, config.image_size, config.image_size)
        zarr.create_array(
            url,
            name=f"{split}/images",
            shape=shape,
            dtype=np.float32,
            chunks=(config.chunk_size, *shape[1:]),
            overwrite=True,
            # As the graph stores them (workflows/data/preprocess.py): zarr's default would spend
            # this side's time on zstd that the graph never pays.
            compressors=None,
        )
        for start in range(0, total, config.chunk_size):
            stop = min(total, start + config.chunk_size)
            target = StoreArray(url, f"{split}/images")
            normalize_chunk(target, blocks, start, stop, mean=mean, std=std)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=10000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=150)
    args = parser.parse_args()

    with (
        tempfile.TemporaryDirectory() as tmp,
        start_cluster(n_workers=args.workers, dashboard_port=0) as cluster,
    ):
        root = Path(tmp) / "images"
        write_jpeg_folder(root, args.images)
        dask_config = DataConfig(dataset="imagefolder", root=str(root), store=f"{tmp}/dask")
        loop_config = dask_config.model_copy(update={"store": f"{tmp}/loop"})
        prepare_store(cluster.client, dask_config, seed=0, force=True)  # warm the workers
        dask_times, loop_times = [], []
        for repeat in range(args.repeats):
            started = time.perf_counter()
            preprocess_in_one_process(loop_config, seed=0)
            loop_times.append(time.perf_counter() - started)
            started = time.perf_counter()
            prepare_store(cluster.client, dask_config, seed=0, force=True)
            dask_times.append(time.perf_counter() - started)
            print(
                f"repeat {repeat + 1}: one process {loop_times[-1]:.2f} s, "
                f"dask {dask_times[-1]:.2f} s",
                flush=True,
            )

        bench = load_config(
            {
                "name": "loading-bench",
                "data": {
                    "dataset": "synthetic",
                    "synthetic_samples": 16384,
                    "drop_last": True,
                    "store": f"{tmp}/synthetic",
                },
                "training": {"epochs": 1, "max_steps": args.steps, "batch_size": 128, "lr": 0.01},
            }
        )
        in_memory = bench.model_copy(
            update={"data": bench.data.model_copy(update={"in_memory": True})}
        )
        train(bench, cluster=cluster, on_event=None)  # builds the store, warms the ranks
        store_rates, memory_rates = [], []
        for repeat in range(args.repeats):
            memory_rates.append(
                train(in_memory, cluster=cluster, on_event=None).steady_samples_per_s
            )
            store_rates.append(train(bench, cluster=cluster, on_event=None).steady_samples_per_s)
            print(
                f"repeat {repeat + 1}: in memory {memory_rates[-1]:.0f}, "
                f"from the store {store_rates[-1]:.0f} samples/s",
                flush=True,
            )

    loop_s, dask_s = statistics.median(loop_times), statistics.median(dask_times)
    memory, store = statistics.median(memory_rates), statistics.median(store_rates)
    print()
    print(f"preprocessing {args.images} JPEGs (128 px → 32 px), median of {args.repeats}:")
    print(f"  one process           {loop_s:7.2f} s  {args.images / loop_s:8.0f} images/s")
    rate = args.images / dask_s
    print(f"  dask, {args.workers} workers        {dask_s:7.2f} s  {rate:8.0f} images/s")
    print(f"  speed-up              {loop_s / dask_s:7.2f}")
    print(f"DDP on {args.workers} ranks, seed CNN, batch 128, median of {args.repeats}:")
    print(f"  shard in memory       {memory:8.0f} samples/s")
    print(f"  shard read lazily     {store:8.0f} samples/s")
    print(f"  ratio store / memory  {store / memory:8.3f}")


if __name__ == "__main__":
    main()
