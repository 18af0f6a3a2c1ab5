"""What a warm job costs on workers that earlier jobs had import large libraries, against the
same jobs on fresh workers, in one run on one 2-worker cluster.

    python -m workflows.benchmarks.long_lived_workers [--jobs 20]   # make bench-workers

Every rank begins with a full collection of Python's garbage collector, which walks every
object the collector tracks; a worker that imported torchvision, timm, Optuna and MLflow
tracks ~145,000 more objects (``workers/between_jobs.py`` freezes them before the next job's
group forms). Printed: the median seconds of ``train`` one-step jobs on the digits demo config
(the call to the result, and to rank 0's first step) before and after those imports, and what
one full collection then takes on each worker.
"""

import argparse
import statistics
import tempfile
import time

from workflows.cluster.training_cluster import start_cluster
from workflows.runs.config import load_config
from workflows.runs.driver import train

WARM_UP_JOBS = 3


def import_large_libraries() -> int:
    """On a worker (``Client.run``): what a job using them imports; the objects now tracked."""
    import gc

    import mlflow  # noqa: F401
    import optuna  # noqa: F401
    import timm  # noqa: F401
    import torchvision  # noqa: F401

    return len(gc.get_objects())


def full_collection_ms() -> float:
    import gc

    started = time.perf_counter()
    gc.collect()
    return (time.perf_counter() - started) * 1000


def median_job(cluster, config, jobs: int) -> tuple[float, float]:
    """Median seconds of ``jobs`` jobs: the call to the result, and to the first step."""
    whole, first = [], []
    for _ in range(jobs):
        started = time.perf_counter()
        result = train(config, cluster=cluster, on_event=None)
        whole.append(time.perf_counter() - started)
        first.append(result.first_step_s)
    return statistics.median(whole), statistics.median(first)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=20)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        config = load_config(
            {
                "name": "long-lived-workers",
                "data": {"store": f"{folder}/digits"},
                "training": {"max_steps": 1, "epochs": 1, "batch_size": 32, "seed": 3},
            }
        )
        with start_cluster(n_workers=2, dashboard_port=0) as cluster:
            for _ in range(WARM_UP_JOBS):  # the store, the first imports, the plugins
                train(config, cluster=cluster, on_event=None)
            fresh = median_job(cluster, config, args.jobs)
            tracked = cluster.client.run(import_large_libraries)
            after_imports = median_job(cluster, config, args.jobs)
            collection = cluster.client.run(full_collection_ms)
    print(f"2 workers, one-step train jobs, median of {args.jobs}: job, call to first step")
    print(f"  fresh workers                      {fresh[0]:6.3f} s, {fresh[1]:6.3f} s")
    print(
        f"  after importing large libraries    {after_imports[0]:6.3f} s, {after_imports[1]:6.3f} s"
    )
    print(f"  objects tracked after the imports  {sorted(tracked.values())}")
    print(f"  a full collection then, per worker {[round(ms, 1) for ms in collection.values()]} ms")


if __name__ == "__main__":
    main()
