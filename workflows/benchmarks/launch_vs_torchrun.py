"""The open path against its references: user code on ``launch`` vs torchrun, and what a
SIGKILL costs.

    python -m workflows.benchmarks.launch_vs_torchrun [--steps 150] [--repeats 3]

1. The same torchrun script (``workflows.benchmarks.torchrun_rank``, unmodified) under
   ``dask-train launch`` on a warm cluster and under ``torchrun --standalone``, alternating,
   both with the workers' malloc settings: the ratio of the medians of steady samples/s.
2. Call to first step: ``launch`` of a one-step function on a warm cluster, against
   torchrun's cold start of the same one-step script (process start to its first step).
3. Recovery: a user loop that checkpoints every 10 steps and says where it stands after each
   step (``ctx.step_done``), one worker SIGKILLed mid-run, five steps after a checkpoint; the
   seconds lost (training redone, plus detection to the resumed first step), median of the
   repeats, continuing from the survivor's memory (``launch.recovery = "replica"``, the
   default) and, alternating with it, from the checkpoint (``"checkpoint"``).

The built-in trainer against the same work written as a user function on ``launch`` is
``make bench``'s (``workflows.benchmarks.ddp_vs_torchrun``, beside torchrun).
"""

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from workers.models import build_model
from workers.records import OutputRecord, ReportRecord, parse_record
from workers.script_runner import ScriptSpec, run_script
from workers.spec.launch import LaunchConfig
from workflows.benchmarks.ddp_vs_torchrun import benchmark_config, run_torchrun
from workflows.cluster.training_cluster import start_cluster
from workflows.jobs.launch import launch, launch_on
from workflows.jobs.request import JobRequest
from workflows.runs.driver import train

SCRIPT = "workflows.benchmarks.torchrun_rank"


def _result(lines: list[str]) -> dict:
    line = next(x for x in lines if "RESULT " in x)
    return json.loads(line[line.index("RESULT ") + len("RESULT ") :])


def under_launch(client, config_json: str, workers: int) -> float:
    lines: list[str] = []

    def on_event(record: dict) -> None:
        if isinstance(output := parse_record(record), OutputRecord):
            lines.extend(output.lines)

    spec = ScriptSpec(target=SCRIPT, module=True, args=(config_json,), run_id="bench")
    request = JobRequest(
        fn=run_script,
        settings=LaunchConfig(world_size=workers),
        name="bench-script",
        args=(spec,),
        keep_checkpoints=1,
        final_records=lambda results: [r for result in results for r in result.output],
    )
    launch_on(client, request, on_event=on_event)
    return _result(lines)["steady_samples_per_s"]


def first_step(ctx) -> None:
    ctx.report(step=1)


def torchrun_first_step(workers: int) -> float:
    """Seconds from starting torchrun to rank 0's first all-reduce, a fresh process each."""
    code = (
        "import time, torch, torch.distributed as d; d.init_process_group('gloo'); "
        "t = torch.ones(1); d.all_reduce(t); "
        "d.get_rank() == 0 and print('FIRST', time.time(), flush=True)"
    )
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as script:
        script.write(code)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    started = time.time()
    done = subprocess.run(
        [*command, f"--nproc_per_node={workers}", script.name],
        capture_output=True,
        text=True,
        timeout=300,
    )
    os.unlink(script.name)
    first = min(float(x.split()[-1]) for x in done.stdout.splitlines() if x.startswith("FIRST"))
    return first - started


def checkpointed_loop(ctx, steps: int, every: int) -> None:
    model = DistributedDataParallel(build_model("cifar_cnn", num_classes=10, seed=0))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    state = {"model": model, "optimizer": optimizer}
    start = ctx.restore(state) or 0
    x, y = torch.randn(32, 3, 32, 32), torch.randint(0, 10, (32,))
    for step in range(start, steps):
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        ctx.step_done(step + 1)
        ctx.report(step=step + 1)
        if (step + 1) % every == 0:
            ctx.save(state, step=step + 1)


def recovery_seconds(cluster, steps: int, every: int, recovery: str = "replica") -> dict:
    victim = max(cluster.client.run(os.getpid).values())
    kill_at = steps // 2 + every // 2

    killed: list[float] = []

    def kill(record: dict) -> None:
        report = parse_record(record)
        at_kill = isinstance(report, ReportRecord) and report.metrics.get("step") == kill_at
        if not killed and at_kill:
            os.kill(victim, signal.SIGKILL)
            killed.append(time.time())

    with tempfile.TemporaryDirectory() as folder:
        result = launch(
            checkpointed_loop,
            steps,
            every,
            cluster=cluster,
            world_size=2,
            checkpoint_dir=folder,
            on_event=kill,
            config={"recovery": recovery},
        )
    (recovery,) = result.recoveries
    return recovery


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--kills", type=int, default=3, help="SIGKILLs per path and repeat")
    args = parser.parse_args()
    config = benchmark_config(args.steps, args.batch_size)
    config_json = config.model_dump_json()
    rates: dict[str, list[float]] = {"torchrun": [], "launch": []}
    firsts: dict[str, list[float]] = {"launch": [], "torchrun": []}
    recoveries: dict[str, list[dict]] = {"replica": [], "checkpoint": []}
    with start_cluster(n_workers=args.workers, dashboard_port=0) as cluster:
        warm = config.model_copy(
            update={"training": config.training.model_copy(update={"max_steps": 5})}
        )
        train(warm, cluster=cluster, on_event=None)  # imports and first-touch, paid once
        for repeat in range(args.repeats):
            rates["torchrun"].append(run_torchrun(config, args.workers, tuned_malloc=True))
            rates["launch"].append(under_launch(cluster.client, config_json, args.workers))
            firsts["launch"].append(launch(first_step, cluster=cluster).first_step_s)
            firsts["torchrun"].append(torchrun_first_step(args.workers))
            for _ in range(args.kills):
                for path, kept in recoveries.items():
                    kept.append(recovery_seconds(cluster, steps=60, every=10, recovery=path))
            print(
                f"repeat {repeat + 1}: torchrun {rates['torchrun'][-1]:.0f}, the same script "
                f"under launch {rates['launch'][-1]:.0f} samples/s; first step "
                f"{firsts['launch'][-1]:.3f} s vs {firsts['torchrun'][-1]:.2f} s; SIGKILL "
                f"cost {recoveries['replica'][-1]['seconds_lost']:.2f} s from the replica, "
                f"{recoveries['checkpoint'][-1]['seconds_lost']:.2f} s from the checkpoint",
                flush=True,
            )
    med = {k: statistics.median(v) for k, v in rates.items()}
    print()
    print(f"seed CNN, {args.workers} ranks, batch {args.batch_size}, median of {args.repeats}:")
    print(f"  torchrun --standalone, our malloc settings   {med['torchrun']:8.0f} samples/s")
    print(f"  the same script under dask-train launch      {med['launch']:8.0f} samples/s")
    print(f"  ratio launch / torchrun                      {med['launch'] / med['torchrun']:8.3f}")
    print(
        f"call to first step: launch on a warm cluster {statistics.median(firsts['launch']):.3f}"
        f" s, torchrun cold start {statistics.median(firsts['torchrun']):.2f} s"
    )
    for path, done in recoveries.items():
        assert all(r["recovered_from"] == path for r in done), done
        print(
            f"SIGKILL of a worker, continued from the {path:10s}: "
            f"{statistics.median(r['seconds_lost'] for r in done):.2f} s lost (median of "
            f"{len(done)}; redo {statistics.median(r['redo_s'] for r in done):.2f} s + restart "
            f"{statistics.median(r['restart_s'] for r in done):.2f} s, slowest restart "
            f"{max(r['restart_s'] for r in done):.2f} s)"
        )


if __name__ == "__main__":
    main()
