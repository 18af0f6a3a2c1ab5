"""The built-in trainer from Dask collections written into the store, against the same
collections persisted on the workers.

    python -m workflows.benchmarks.array_store [--samples 200000] [--features 64]
        [--partitions 16] [--epochs 2] [--batch-size 512] [--rounds 2] [--workers 2]

``train(config, data=...)`` with ``data.collections = "store"`` (the collections written into a
zarr store as Dask tasks, then read by each rank chunk by chunk) and with ``"persist"`` (read
where the partitions lie), alternating which goes first (ABBA). Reported: the store's write
(the first call; later calls reuse it), and the median of each side's steady samples/s (the
ratio: 1.0 means reading chunks from the store costs nothing against reading memory).
"""

import argparse
import json
import statistics
import tempfile

import dask.array as da
import numpy as np
from torch import nn

from workflows.cluster.training_cluster import start_cluster
from workflows.runs.config import load_config
from workflows.runs.driver import train


def mlp(in_features: int, num_classes: int) -> nn.Module:
    """The benchmark's model (``model.name = "workflows.benchmarks.array_store:mlp"``)."""
    return nn.Sequential(
        nn.Linear(in_features, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=200_000)
    parser.add_argument("--features", type=int, default=64)
    parser.add_argument("--partitions", type=int, default=16)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=512, help="global, per step")
    parser.add_argument("--rounds", type=int, default=2, help="ABBA rounds")
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    weights = rng.uniform(0.3, 1.7, args.partitions)  # uneven partitions, as real data comes
    bounds = np.round(np.cumsum(weights) / weights.sum() * args.samples).astype(int)
    sizes = tuple(int(s) for s in np.diff(bounds, prepend=0))
    x = da.random.default_rng(1).standard_normal(
        (args.samples, args.features), chunks=(sizes, args.features), dtype=np.float32
    )
    y = (x[:, 0] > 0).astype(np.int64) + 2 * (x[:, 1] > 0).astype(np.int64)
    n_val = args.samples // 10
    data = {"train": (x[n_val:], y[n_val:]), "val": (x[:n_val], y[:n_val])}
    figures: dict[str, list[float]] = {"store": [], "persist": []}
    write_s = None
    with (
        tempfile.TemporaryDirectory() as folder,
        start_cluster(n_workers=args.workers, dashboard_port=0) as cluster,
    ):
        for round_ in range(args.rounds):
            sides = ("store", "persist") if round_ % 2 == 0 else ("persist", "store")
            for side in sides:
                config = load_config(
                    {
                        "name": f"bench-{side}",
                        "model": {"name": "workflows.benchmarks.array_store:mlp"},
                        "data": {"collections": side, "store": f"{folder}/store"},
                        "training": {
                            "epochs": args.epochs,
                            "batch_size": args.batch_size,
                            "lr": 0.01,
                        },
                    }
                )
                result = train(config, cluster=cluster, data=data, on_event=None)
                if side == "store" and result.store is not None and not result.store.reused:
                    write_s = result.store.seconds
                figures[side].append(result.steady_samples_per_s)
    store, persist = (statistics.median(figures[s]) for s in ("store", "persist"))
    print(
        json.dumps(
            {
                "samples": args.samples,
                "features": args.features,
                "partitions": args.partitions,
                "workers": args.workers,
                "store_write_s": None if write_s is None else round(write_s, 2),
                "store_write_mb_per_s": None
                if write_s is None
                else round(x.nbytes / 1e6 / write_s, 1),
                "store_samples_per_s": round(store),
                "persisted_samples_per_s": round(persist),
                "ratio": round(store / persist, 3),
                "runs": {side: [round(v) for v in values] for side, values in figures.items()},
            }
        )
    )


if __name__ == "__main__":
    main()
