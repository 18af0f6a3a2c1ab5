"""What the shared-cluster queue costs a job that waits: from the end of the job holding the
workers to the waiting job's first step, on a warm 2-worker cluster.

    python -m workflows.benchmarks.queue_overhead [--repeats 7]

Each round, job A (2 ranks) holds both workers for a second and returns the time its ranks
ended; job B (2 ranks) is launched while A runs, waits in the queue, and reports at its first
step. The overhead is B's first step minus A's last rank's end: A's release (leaving the group,
the plugin's teardown), the queue's grant, and B's start (its group's rendezvous, its tasks).
The reference, in the same run: B's call-to-first-step on an idle cluster.
"""

import argparse
import statistics
import threading
import time

from workflows.cluster.training_cluster import start_cluster
from workflows.jobs.admission import queue_snapshot
from workflows.jobs.launch import launch


def hold_for(ctx, seconds: float) -> float:
    time.sleep(seconds)
    return time.time()


def first_step(ctx) -> None:
    ctx.report(step=1)


def one_round(cluster, hold_s: float) -> float:
    """Seconds from job A's end to queued job B's first step."""
    ended: list[float] = []
    holder = threading.Thread(
        target=lambda: ended.extend(launch(hold_for, hold_s, cluster=cluster, world_size=2).results)
    )
    holder.start()
    while not cluster.client.run_on_scheduler(queue_snapshot)["holding"]:
        time.sleep(0.005)
    called = time.time()
    waited = launch(first_step, cluster=cluster, world_size=2)
    holder.join()
    return called + waited.first_step_s - max(ended)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--hold-s", type=float, default=1.0)
    args = parser.parse_args()
    with start_cluster(n_workers=2, dashboard_port=0) as cluster:
        for _ in range(3):  # warm: imports, plugins, connections
            launch(first_step, cluster=cluster, world_size=2)
        idle = [launch(first_step, cluster=cluster, world_size=2).first_step_s for _ in range(5)]
        queued = [one_round(cluster, args.hold_s) for _ in range(args.repeats)]
    print(f"2 workers, 2-rank jobs, median of {args.repeats} (slowest):")
    print(
        f"  idle cluster, call to first step              {statistics.median(idle):6.3f} s "
        f"({max(idle):.3f})"
    )
    print(
        f"  queued, holder's end to waiter's first step   {statistics.median(queued):6.3f} s "
        f"({max(queued):.3f})"
    )


if __name__ == "__main__":
    main()
