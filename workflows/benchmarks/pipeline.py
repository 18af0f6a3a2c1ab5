"""Pipeline parallelism on the cluster: speed-up, balanced planning, and memory per schedule.

    python -m workflows.benchmarks.pipeline [--steps 12] [--batch 128] [--rounds 2]

All on one 2-worker cluster, on the same synthetic store, in one run:

1. A 2-stage 1F1B pipeline (m=8, cut by the profiling planner) against the whole model in
   one process (one worker, ``data_parallel`` on CPU is the plain model). Ratio of steady
   samples/s; the ideal on a balanced model is 2·m/(m+p-1) = 1.78.
2. The same pipeline cut by the planner against the naive cut (equal numbers of layers) on
   ``small_resnet``, whose layers cost very different amounts. Ratio of steady samples/s.
3. Peak memory per rank of GPipe and 1F1B at m=8: how much each worker's high-water mark
   grows during training (``ru_maxrss`` after a fresh restart on CPU; ``max_memory_allocated``
   on a GPU).
"""

import argparse
import statistics
import tempfile

from workers.spec.run import RunConfig
from workflows.cluster.training_cluster import start_cluster
from workflows.runs.config import load_config
from workflows.runs.driver import TrainResult, train


def peak_memory_bytes() -> int:
    """This process's high-water mark: the device's allocator on a GPU, else resident set."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated()
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _load_training_code() -> None:
    # Imported before the baseline is read, so the baseline holds torch itself.
    import workers.train  # noqa: F401


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--model", default="small_resnet")
    parser.add_argument("--memory-batch", type=int, default=512)
    args = parser.parse_args()

    with (
        tempfile.TemporaryDirectory() as tmp,
        start_cluster(n_workers=2, dashboard_port=0) as cluster,
    ):

        def config(**changes: dict) -> RunConfig:
            raw = {
                "name": "pipeline-bench",
                "data": {
                    "dataset": "synthetic",
                    "synthetic_samples": 2048,
                    "store": f"{tmp}/store",
                },
                "model": {"name": args.model},
                "training": {
                    "epochs": 1,
                    "max_steps": args.steps,
                    "batch_size": args.batch,
                    "lr": 0.01,
                    "strategy": "pipeline",
                },
                "pipeline": {"schedule": "1f1b", "n_microbatches": args.microbatches},
            }
            for section, values in changes.items():
                raw[section] = raw.get(section, {}) | values
            return load_config(raw)

        def run(cfg: RunConfig) -> TrainResult:
            return train(cfg, cluster=cluster, on_event=None)

        single = config(training={"strategy": "data_parallel"}, launch={"world_size": 1})
        planned = config(pipeline={"balance": "profile"})
        naive = config(pipeline={"balance": "layers"})
        run(planned)  # warm the workers and build the store
        one, piped, even = [], [], []
        for round_ in range(args.rounds):
            one.append(run(single).steady_samples_per_s)
            result = run(planned)
            piped.append(result.steady_samples_per_s)
            cut = result.split_points
            naive_result = run(naive)
            even.append(naive_result.steady_samples_per_s)
            print(
                f"round {round_ + 1}: one process {one[-1]:.1f}, pipeline {piped[-1]:.1f} "
                f"(cut at {list(cut)}), naive cut {even[-1]:.1f} "
                f"(at {list(naive_result.split_points)}) samples/s",
                flush=True,
            )
        speedup = statistics.median(piped) / statistics.median(one)
        balance = statistics.median(piped) / statistics.median(even)
        m, p = args.microbatches, 2
        print(
            f"2-stage 1F1B pipeline (m={m}) vs the whole model in one process: {speedup:.2f}x "
            f"(ideal 2m/(m+p-1) = {2 * m / (m + p - 1):.2f})"
        )
        print(f"planned cut vs equal-layers cut on {args.model}: {balance:.2f}x")

        # Large micro-batches, so activations stand out from the ~0.7 GiB a worker starts with.
        for schedule in ("gpipe", "1f1b"):
            cluster.client.restart()  # a fresh high-water mark on every worker
            cluster.client.run(_load_training_code)
            before = cluster.client.run(peak_memory_bytes)
            big = {"batch_size": args.memory_batch, "max_steps": 3}
            run(config(pipeline={"schedule": schedule}, training=big))
            after = cluster.client.run(peak_memory_bytes)
            grown = ", ".join(f"{(after[w] - before[w]) / 2**20:,.0f} MiB" for w in sorted(after))
            print(
                f"peak memory growth per rank while training, {schedule} m={m}, batch "
                f"{args.memory_batch}: {grown}"
            )


if __name__ == "__main__":
    main()
