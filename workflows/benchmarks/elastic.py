"""Elastic jobs: what each change of a job's world costs, against the anchors' way of resizing
(stop, and start again at the new size from the newest checkpoint: torchrun --nnodes=min:max,
Ray Train v2's ScalingConfig(num_workers=(min, max))), in the same run.

    python -m workflows.benchmarks.elastic [--step-ms 30] [--checkpoint-every 10]
    python -m workflows.benchmarks.elastic --model gpt [--gpt-steps 4]

A DDP job of 2:4 ranks (a 3-layer MLP; each step sleeps --step-ms besides, the compute of a
real step) on a cluster of 2 workers: it grows 2 -> 4 when two workers join
(``cluster.scale(4)``), shrinks 4 -> 3 by ``retire_workers``, 3 -> 2 by a SIGKILL (the worker
not started again, as a reclaimed spot instance). Then, on 4 workers, a queued fixed 2-rank job
takes 2 workers from the 2:4 job holding them all. The same three changes again the anchors'
way: a fixed-size job checkpointing every --checkpoint-every steps, stopped (or failed, for the
SIGKILL) and launched again at the new size from its newest checkpoint, on the same warm
workers (torchrun and Ray start new processes as well: their pause is longer still).

Pause: from the last step before the change to the first step after. Redone: steps finished
before it that are trained again after. Also measured: what the elastic job's per-step vote
costs, steps/s of a 2:4 job on 2 workers against a fixed 2-rank one.

``--model gpt``: a grow of the built-in trainer's job on a model of 28.7 M parameters instead
(the built-in GPT, 9 blocks 512 wide, on windows of 64 bytes of the standard library's wsgiref
package; DDP, SGD with momentum, global batch 6, elastic 2:3): warm (a worker forked from the
local cluster's fork server joins, ``cluster.scale(3)``) and cold (a stock ``dask worker``
joins a cluster of stock processes), each after --gpt-steps steps on 2 ranks. Beside each
pause: the state's broadcast in the new group (``broadcast_s`` of the resize record: the
parameters and the momentum, 230 MB, from a live rank to every rank), and the median interval
between two steps before the change, the compute that the pause's first step after includes.
"""

import argparse
import contextlib
import itertools
import os
import signal
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from distributed import Client
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from workers.records import ReportRecord, ResizedRecord, StepRecord, parse_record
from workers.spec.run import RunConfig
from workflows.benchmarks.stock_cluster import stock_cluster
from workflows.cluster.training_cluster import TrainingCluster, live_workers, start_cluster
from workflows.jobs.launch import launch
from workflows.jobs.launcher import JobStopped
from workflows.runs.config import load_config
from workflows.runs.driver import train

GLOBAL_BATCH = 96  # split evenly by 2, 3 and 4 ranks
WAIT_S = 120.0


def mlp_loop(ctx, stop_file: str, step_s: float, checkpoint_every: int) -> int:
    """Train until ``stop_file`` exists (the ranks agree every 5 steps); returns the steps."""
    torch.manual_seed(0)
    model = DistributedDataParallel(
        nn.Sequential(
            nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)
        )
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    state = {"model": model, "optimizer": optimizer}
    step = ctx.restore(state) or 0
    share = GLOBAL_BATCH // ctx.world_size
    while True:
        generator = torch.Generator().manual_seed(step)
        x = torch.randn(GLOBAL_BATCH, 64, generator=generator)[ctx.rank * share :][:share]
        y = torch.randint(0, 10, (GLOBAL_BATCH,), generator=generator)[ctx.rank * share :][:share]
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        step += 1
        ctx.report(step=step, world=ctx.world_size, at=time.time())
        ctx.step_done(step)
        if checkpoint_every and step % checkpoint_every == 0:
            ctx.save(state, step=step)
        if step % 5 == 0:
            stop = torch.tensor([float(os.path.exists(stop_file))])
            dist.all_reduce(stop)
            if stop.item():
                return step
        time.sleep(step_s)


def first_step(ctx) -> None:
    ctx.report(step=1)


class Steps:
    """The job's step reports as they arrive, and its resize records, with bounded waits."""

    def __init__(self) -> None:
        self.reports: list[dict[str, Any]] = []
        self.resizes: list[dict[str, Any]] = []
        self._changed = threading.Condition()

    def _step(self, typed: Any, record: dict[str, Any]) -> None:
        if isinstance(typed, ReportRecord) and typed.rank == 0:
            self.reports.append(record)

    def __call__(self, record: dict[str, Any]) -> None:
        typed = parse_record(record)
        with self._changed:
            if isinstance(typed, ResizedRecord):
                self.resizes.append(record)
            else:
                self._step(typed, record)
            self._changed.notify_all()

    def wait(self, what: str, ready: Any) -> None:
        with self._changed:
            if not self._changed.wait_for(lambda: ready(self), WAIT_S):
                raise TimeoutError(f"not within {WAIT_S:g} s: {what}")

    def world(self, size: int, *, steps_after: int = 5) -> Any:
        """Ready once rank 0 reported ``steps_after`` steps in a world of ``size``."""
        return lambda s: sum(r["world"] == size for r in s.reports[-steps_after:]) >= steps_after


def _last_worker(client) -> str:
    workers = live_workers(client)
    return max(workers, key=lambda a: int(workers[a]["name"]))


def _no_restart(dask_worker) -> None:
    dask_worker.close_gracefully(reason="a spot instance reclaimed")


def _kill_for_good(client) -> None:
    address = _last_worker(client)
    pid = client.run(os.getpid, workers=[address])[address]
    client.run(_no_restart, nanny=True, workers=[address])
    os.kill(pid, signal.SIGKILL)


CHANGES = (
    ("grow 2 -> 4: two workers join", 4, lambda cluster: cluster.cluster.scale(4)),
    (
        "shrink 4 -> 3: retire_workers",
        3,
        lambda cluster: cluster.client.retire_workers([_last_worker(cluster.client)]),
    ),
    ("shrink 3 -> 2: SIGKILL", 2, lambda cluster: _kill_for_good(cluster.client)),
)


class ElasticJob:
    """An ``mlp_loop`` job (2:4 by default) on a thread while the benchmark changes the
    cluster; ``stop()`` ends it and returns its resize records, ``finish()`` its result."""

    def __init__(
        self,
        cluster: TrainingCluster | Client,
        step_s: float,
        stop_file: Path,
        world_size: int | str = "2:4",
    ) -> None:
        self.steps, self.stop_file, self._done = Steps(), stop_file, {}
        self._thread = threading.Thread(
            target=lambda: self._done.update(
                result=launch(
                    mlp_loop,
                    str(stop_file),
                    step_s,
                    0,
                    cluster=cluster,
                    world_size=world_size,
                    on_event=self.steps,
                    config={"worker_wait_s": WAIT_S},
                )
            )
        )
        self._thread.start()

    def finish(self) -> Any:
        """Ask the job to stop and wait for it: its LaunchResult."""
        self.stop_file.touch()
        self._thread.join(WAIT_S)
        return self._done["result"]

    def stop(self) -> list[dict[str, Any]]:
        return self.finish().resizes


def elastic(step_s: float, folder: Path) -> list[dict[str, Any]]:
    """The three changes of one 2:4 job; its resize records."""
    with start_cluster(n_workers=2, dashboard_port=0) as cluster:
        job = ElasticJob(cluster, step_s, folder / "stop-elastic")
        job.steps.wait("2 ranks", job.steps.world(2))
        for _, size, change in CHANGES:
            change(cluster)
            job.steps.wait(f"{size} ranks", job.steps.world(size))
        return job.stop()


# The changes on stock processes (`dask scheduler`, `dask worker` with its nanny): cold workers.
COLD_CHANGES = (
    "cold: grow 2 -> 3, a stock `dask worker` joins",
    "cold: SIGKILL of a worker process, its nanny starts another: 3 -> 2 at once",
    "cold: the nanny's new process joins back, 2 -> 3",
    "cold: shrink 3 -> 2, SIGTERM to a `dask worker`",
)


def cold(step_s: float, folder: Path) -> list[dict[str, Any]]:
    """The same 2:4 job on a cluster of stock processes, every newcomer a fresh interpreter
    that has imported nothing of torch: a ``dask worker`` started during the run joins; a
    worker process is SIGKILLed (the job shrinks at once, and grows back once the process its
    nanny starts is ready); a ``dask worker`` gets SIGTERM. Its resize records, in order."""
    with stock_cluster(2) as cluster:
        client = cluster.client
        job = ElasticJob(client, step_s, folder / "stop-cold")
        job.steps.wait("2 ranks", job.steps.world(2))
        before = set(live_workers(client))
        joined = cluster.add_worker()
        job.steps.wait("3 ranks", job.steps.world(3))
        (newest,) = set(live_workers(client)) - before
        pid = client.run(os.getpid, workers=[newest])[newest]
        os.kill(pid, signal.SIGKILL)
        job.steps.wait("2 ranks", job.steps.world(2))
        job.steps.wait("3 ranks again", job.steps.world(3))
        joined.send_signal(signal.SIGTERM)  # the nanny closes its worker gracefully
        job.steps.wait("2 ranks", job.steps.world(2))
        return job.stop()


WARM_NANNY = ("--preload-nanny", "workflows.cluster.warm_workers")


def fixed_sigkill(step_s: float, folder: Path, worker_args: tuple[str, ...]) -> dict[str, Any]:
    """A fixed 2-rank job on stock processes whose worker process is SIGKILLed (its nanny
    starts another, which the job waits for): the recovery's record (seconds_lost)."""
    with stock_cluster(2, worker_args) as cluster:
        client = cluster.client
        stop_file = folder / "stop-fixed"
        stop_file.unlink(missing_ok=True)
        job = ElasticJob(client, step_s, stop_file, world_size=2)
        job.steps.wait("2 ranks", job.steps.world(2, steps_after=20))
        victim = sorted(live_workers(client))[-1]
        os.kill(client.run(os.getpid, workers=[victim])[victim], signal.SIGKILL)
        seen = len(job.steps.reports)
        job.steps.wait("recovered", lambda s: len(s.reports) >= seen + 20)
        return job.finish().recoveries[0]


@dataclass(frozen=True)
class RestartedLoop:
    """What every launch of the restarted job shares: :func:`mlp_loop`'s stop file, step time
    and checkpoint period, and the folder its checkpoints are kept in across the launches."""

    stop_file: Path
    step_s: float
    checkpoint_every: int
    checkpoints: Path


def restarted(step_s: float, checkpoint_every: int, folder: Path) -> list[dict[str, Any]]:
    """The same changes the anchors' way: a fixed-size job, stopped (or failed, for the
    SIGKILL) and launched again at the new size from its newest checkpoint. One dict per
    change: pause_s, redone_steps."""
    stop_file = folder / "stop-restarted"
    loop = RestartedLoop(stop_file, step_s, checkpoint_every, folder / "checkpoints")
    measured: list[dict[str, Any]] = []
    with start_cluster(n_workers=2, dashboard_port=0) as cluster:
        size, stopped = 2, None
        for index in range(len(CHANGES) + 1):
            steps, stop = Steps(), threading.Event()
            job = threading.Thread(
                target=_until_stopped,
                args=(cluster, size, steps, stop, loop),
            )
            job.start()
            steps.wait(f"{size} ranks", lambda s: len(s.reports) >= 1)
            if stopped is not None:
                first = steps.reports[0]
                measured.append(
                    {
                        "pause_s": first["at"] - stopped["at"],
                        "redone_steps": stopped["step"] - (first["step"] - 1),
                    }
                )
            if index == len(CHANGES):
                stop_file.touch()
                job.join(WAIT_S)
                break
            steps.wait("steps", steps.world(size, steps_after=checkpoint_every + 3))
            _, size, change = CHANGES[index]
            if index == 0:  # torchrun restarts once the new workers have joined
                change(cluster)
                cluster.client.wait_for_workers(size, timeout=WAIT_S)
                stop.set()
            elif index == 1:  # a graceful leave: stopped, then the worker goes
                stop.set()
                job.join(WAIT_S)
                change(cluster)
            else:  # the SIGKILL fails the job
                change(cluster)
            job.join(WAIT_S)
            stopped = steps.reports[-1]
            while len(live_workers(cluster.client)) != size:
                time.sleep(0.01)
    return measured


def _until_stopped(
    cluster: TrainingCluster,
    size: int,
    steps: Steps,
    stop: threading.Event,
    loop: RestartedLoop,
) -> None:
    # Stopped, or failed by the SIGKILL: main launches it again.
    with contextlib.suppress(Exception):
        launch(
            mlp_loop,
            str(loop.stop_file),
            loop.step_s,
            loop.checkpoint_every,
            cluster=cluster,
            world_size=size,
            checkpoint_dir=loop.checkpoints,
            on_event=steps,
            stop=stop,
            config={"max_failures": 0},
        )


def queued_first_step(step_s: float, folder: Path) -> tuple[float, float, float]:
    """A fixed 2-rank job called while a 2:4 job holds all 4 workers: its call-to-first-step,
    the elastic job's pause as it yields, and the same call on an idle cluster."""
    with start_cluster(n_workers=4, dashboard_port=0) as cluster:
        for _ in range(2):  # warm: imports, plugins, connections
            launch(first_step, cluster=cluster, world_size=2)
        idle = launch(first_step, cluster=cluster, world_size=2).first_step_s
        job = ElasticJob(cluster, step_s, folder / "stop-queued")
        job.steps.wait("4 ranks", job.steps.world(4))
        queued = launch(first_step, cluster=cluster, world_size=2).first_step_s
        resizes = job.stop()
    yielded = next(r for r in resizes if r["cause"] == "yielded")
    return queued, yielded["pause_s"], idle


def vote_cost(cluster: TrainingCluster, folder: Path, steps: int) -> tuple[float, float]:
    """Steps/s of a fixed 2-rank job and of a 2:4 one on the same 2 workers, no sleep."""
    rates = []
    for world in (2, "2:4"):
        stop = folder / f"stop-{world}".replace(":", "-")
        counter = Steps()

        def stop_after(record: dict[str, Any], counter: Steps = counter, stop: Path = stop) -> None:
            counter(record)
            if len(counter.reports) >= steps:
                stop.touch()

        launch(mlp_loop, str(stop), 0.0, 0, cluster=cluster, world_size=world, on_event=stop_after)
        reports = counter.reports  # the first 10 steps warm up
        rates.append((len(reports) - 10) / (reports[-1]["at"] - reports[9]["at"]))
    return rates[0], rates[1]


GPT = {"name": "gpt", "kwargs": {"dim": 512, "n_layers": 9, "n_heads": 8}}  # 28.7 M parameters


def gpt_config(folder: Path) -> RunConfig:
    """The built-in trainer's elastic 2:3 job on the GPT: a step a second or so on this CPU."""
    return load_config(
        {
            "name": "elastic-gpt",
            "launch": {"world_size": "2:3", "worker_wait_s": WAIT_S},
            "data": {
                "dataset": "text",
                "root": "python:wsgiref",
                "files": "*.py",
                "sequence_length": 64,
                "val_fraction": 0.1,
                "store": str(folder / "gpt-store"),
            },
            "model": GPT,
            "training": {
                "strategy": "ddp",
                "epochs": 1,
                "batch_size": 6,  # global: 3 and 2 ranks each take an equal share
                "lr": 0.01,
                "momentum": 0.9,
                "log_every_steps": 1,
            },
        }
    )


class TrainerSteps(Steps):
    """Rank 0's step records of a built-in trainer's job, as their arrival times, and its
    resize records, with bounded waits."""

    def __init__(self) -> None:
        super().__init__()
        self.arrived: list[float] = []

    def _step(self, typed: Any, record: dict[str, Any]) -> None:
        if isinstance(typed, StepRecord):
            self.arrived.append(time.time())


def gpt_grow(config: RunConfig, cluster: Any, grow: Any, steps_before: int) -> dict[str, Any]:
    """The GPT job on ``cluster`` (2 workers) until ``steps_before`` steps are done, then
    ``grow()`` adds a worker; stopped after the new world's first step. Its resize record,
    with ``step_s``: the median interval between two steps before the change."""
    steps, stop = TrainerSteps(), threading.Event()

    def run() -> None:
        with contextlib.suppress(JobStopped):
            train(config, cluster=cluster, on_event=steps, stop=stop)

    thread = threading.Thread(target=run)
    thread.start()
    try:
        steps.wait(f"{steps_before} steps", lambda s: len(s.arrived) >= steps_before)
        before = list(steps.arrived)
        grow()
        steps.wait("grown to 3", lambda s: any(r["to"] == 3 for r in s.resizes))
    finally:
        stop.set()
        thread.join(WAIT_S)
    intervals = sorted(b - a for a, b in itertools.pairwise(before[1:]))  # the first warms up
    return steps.resizes[0] | {"step_s": intervals[len(intervals) // 2]}


def gpt(steps_before: int, folder: Path) -> None:
    """The warm and the cold grow of the GPT job, as a table."""
    config = gpt_config(folder)
    with start_cluster(n_workers=2, dashboard_port=0) as cluster:
        warm = gpt_grow(config, cluster, lambda: cluster.cluster.scale(3), steps_before)
    load = os.getloadavg()[0]
    with stock_cluster(2) as stock:
        cold = gpt_grow(config, stock.client, stock.add_worker, steps_before)
    load = max(load, os.getloadavg()[0])
    print(
        f"built-in trainer, GPT of 28.7 M parameters, DDP 2:3, global batch 6; grown after "
        f"{steps_before} steps on 2 ranks"
    )
    print(
        "| grow 2 -> 3 | pause | of which the state's broadcast | a step before | pause less "
        "that step |"
    )
    print("|---|---|---|---|---|")
    for what, resize in (
        ("warm: a forked worker joins", warm),
        ("cold: a stock `dask worker` joins", cold),
    ):
        print(
            f"| {what} | {resize['pause_s']:.2f} s | {resize['broadcast_s']:.2f} s | "
            f"{resize['step_s']:.2f} s | {resize['pause_s'] - resize['step_s']:.2f} s |"
        )
    print(f"load average (1 min) up to {load:.1f} on {os.cpu_count()} cores")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--step-ms", type=float, default=30.0)
    parser.add_argument("--checkpoint-every", type=int, default=10)
    parser.add_argument("--vote-steps", type=int, default=300)
    parser.add_argument("--cold-only", action="store_true", help="only the stock processes' case")
    parser.add_argument(
        "--model",
        choices=("mlp", "gpt"),
        default="mlp",
        help="gpt: only the grow, warm and cold, of the built-in trainer's 28.7 M-parameter GPT",
    )
    parser.add_argument("--gpt-steps", type=int, default=4, help="steps before the GPT's grow")
    args = parser.parse_args()
    if args.model == "gpt":
        with tempfile.TemporaryDirectory() as folder:
            gpt(args.gpt_steps, Path(folder))
        return
    if args.cold_only:
        with tempfile.TemporaryDirectory() as folder:
            for resize in cold(args.step_ms / 1000, Path(folder)):
                print(resize, f"load {os.getloadavg()[0]:.1f}")
            for worker_args in ((), WARM_NANNY):
                lost = fixed_sigkill(args.step_ms / 1000, Path(folder), worker_args)
                print(worker_args, lost, f"load {os.getloadavg()[0]:.1f}")
        return
    step_s = args.step_ms / 1000
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder)
        with start_cluster(n_workers=2, dashboard_port=0) as cluster:
            fixed_rate, elastic_rate = vote_cost(cluster, path, args.vote_steps)
        ours = elastic(step_s, path)
        load = os.getloadavg()[0]
        cold_resizes = cold(step_s, path)
        load = max(load, os.getloadavg()[0])
        lost_cold = fixed_sigkill(step_s, path, ())
        lost_warm = fixed_sigkill(step_s, path, WARM_NANNY)
        load = max(load, os.getloadavg()[0])
        theirs = restarted(step_s, args.checkpoint_every, path)
        queued, yielded_pause, idle = queued_first_step(step_s, path)
    print(
        f"DDP job 2:4 ranks, a step = compute + {args.step_ms:g} ms; checkpoints every "
        f"{args.checkpoint_every} steps for the restart"
    )
    print(
        "| change | dask-train elastic: pause | redone steps | restart from checkpoint: "
        "pause | redone steps |"
    )
    print("|---|---|---|---|---|")
    for (what, _, _), resize, anchor in zip(CHANGES, ours, theirs, strict=True):
        print(
            f"| {what} | {resize['pause_s']:.2f} s | {resize['redone_steps']} | "
            f"{anchor['pause_s']:.2f} s | {anchor['redone_steps']} |"
        )
    for what, resize in zip(COLD_CHANGES, cold_resizes, strict=False):
        print(f"| {what} | {resize['pause_s']:.2f} s | {resize['redone_steps']} | | |")
    for what, recovery in (
        ("cold: fixed 2 ranks, SIGKILL, a stock nanny's new process", lost_cold),
        (
            "fixed 2 ranks, SIGKILL, a nanny with --preload-nanny workflows.cluster.warm_workers",
            lost_warm,
        ),
    ):
        print(
            f"| {what}: seconds lost | {recovery['seconds_lost']:.2f} s | "
            f"{recovery['recovered_from']} | | |"
        )
    print(
        f"| a queued 2-rank job takes 2 of 4 | {yielded_pause:.2f} s | 0 | | |\n"
        f"queued job, call to first step: {queued:.2f} s (idle cluster: {idle:.2f} s)\n"
        f"per-step vote: {elastic_rate:.0f} steps/s elastic vs {fixed_rate:.0f} fixed "
        f"({elastic_rate / fixed_rate:.2f}x)\n"
        f"cold resizes: {[(r['from'], r['to'], r['cause']) for r in cold_resizes]}; load "
        f"average (1 min) up to {load:.1f} on {os.cpu_count()} cores"
    )


if __name__ == "__main__":
    main()
