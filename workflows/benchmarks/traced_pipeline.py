"""The planner's cut against an equal-layers cut of a traced model: torchvision's resnet18 as a
2-stage pipeline.

    python -m workflows.benchmarks.traced_pipeline [--steps 12] [--batch 128] [--rounds 2]

resnet18 is not an ``nn.Sequential``: it is traced by ``torch.distributed.pipelining`` and cut at
module paths. On one 2-worker cluster, in one run:

1. The planner profiles the pieces between resnet18's cut points on a worker (``conv1``,
   ``bn1``, ``maxpool``, ``layer1``, ``layer1.1`` … ``fc``) and picks the cut that balances the
   two stages' time; the equal-layers cut gives each stage the same number of pieces.
2. Each cut trains ``--steps`` steps of 1F1B with ``--microbatches`` micro-batches through the
   pipeline strategy on ``launch``, on the same random 32 px images; the cuts alternate for
   ``--rounds`` rounds, and the ratio is of the median steady samples/s (the first
   ``--warmup`` steps left out).

Through a run config this needs a model source that names resnet18; ``launch`` and the
planner's ``build`` hook need none.
"""

import argparse
import statistics
import time

import torch
import torchvision
from torch import nn

from workers.precision import Precision
from workers.spec.plans import get_plan
from workers.spec.plans.pipeline import StagingSettings
from workers.spec.sections import PipelineConfig, TrainingConfig
from workers.strategies import get_strategy
from workers.strategies.base import EpochSums, RankPlacement
from workflows.cluster.training_cluster import start_cluster
from workflows.jobs.launch import launch
from workflows.runs.config import load_config
from workflows.runs.planner import plan, resolve_split_points
from workflows.runs.resolved_run import resolve_run

IMAGE = (3, 32, 32)


def resnet18() -> nn.Module:
    """torchvision's resnet18 for 10 classes, the same numbers on every rank."""
    torch.manual_seed(0)
    return torchvision.models.resnet18(weights=None, num_classes=10)


def steady_samples_per_s(
    ctx, split_points: list[str], *, batch: int, microbatches: int, steps: int, warmup: int
) -> float:
    """This rank's samples/s over the steps after ``warmup``, 1F1B on the traced cut."""
    config = PipelineConfig(
        schedule="1f1b", n_microbatches=microbatches, split_points=tuple(split_points)
    )
    training = TrainingConfig(strategy="pipeline", batch_size=batch)
    precision = Precision("fp32", ctx.device)
    layout = get_plan(training.strategy).degrees(training, config, world_size=ctx.world_size)
    placement = RankPlacement(
        layout=layout,
        rank=ctx.rank,
        device=ctx.device,
        precision=precision,
        settings=StagingSettings(pipeline=config),
        sample=torch.zeros(layout.micro_batch, *IMAGE),
    )
    strategy = get_strategy("pipeline").prepare(resnet18(), placement)
    optimizer = torch.optim.SGD(strategy.parameters(), lr=0.01, momentum=0.9)
    sums = EpochSums([0.0, 0.0, 0.0], device=ctx.device)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(batch, *IMAGE, generator=generator).to(ctx.device)
    y = torch.randint(0, 10, (batch,), generator=generator).to(ctx.device)
    started = time.perf_counter()
    for step in range(steps):
        if step == warmup:
            if ctx.device.type == "cuda":
                torch.cuda.synchronize(ctx.device)
            started = time.perf_counter()
        optimizer.zero_grad()
        strategy.forward_backward(x, y, precision=precision, sums=sums)
        optimizer.step()
        ctx.heartbeat(samples=batch)
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)
    return (steps - warmup) * batch / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()

    config = load_config(
        {
            "name": "traced-pipeline-bench",
            "training": {"strategy": "pipeline", "batch_size": args.batch},
            "pipeline": {"schedule": "1f1b", "n_microbatches": args.microbatches},
        }
    )
    with start_cluster(n_workers=2, dashboard_port=0) as cluster:
        client = cluster.client
        started = time.perf_counter()
        run = resolve_run(client, config)  # on the cluster's 2 workers
        planned = plan(client, run, num_classes=10, build=resnet18)
        print(f"planned in {time.perf_counter() - started:.1f} s (trace and profile on a worker)")
        print(planned.render())
        by_layers = config.pipeline.model_copy(update={"balance": "layers"})
        even = resolve_split_points(
            client,
            resolve_run(client, config.model_copy(update={"pipeline": by_layers})),
            num_classes=10,
            build=resnet18,
        )
        seconds = {layer.name: layer.seconds for layer in planned.profile.layers}
        names = list(seconds)
        for label, points in (("planned", planned.split_points), ("equal-layers", even)):
            at = names.index(points[0])
            stages = [sum(seconds[n] for n in names[:at]), sum(seconds[n] for n in names[at:])]
            print(
                f"{label} cut at {list(points)}: profiled stages "
                f"{', '.join(f'{s * 1e3:.1f} ms' for s in stages)}"
            )
        runs: dict[str, list[float]] = {"planned": [], "equal-layers": []}
        options = {
            "batch": args.batch,
            "microbatches": args.microbatches,
            "steps": args.steps,
            "warmup": args.warmup,
        }
        for round_ in range(args.rounds):
            for label, points in (("planned", planned.split_points), ("equal-layers", even)):
                result = launch(
                    steady_samples_per_s, list(points), cluster=client, world_size=2, **options
                )
                # The ranks move in lockstep; the slower one's rate is the pipeline's.
                runs[label].append(min(result.results))
            print(
                f"round {round_ + 1}: planned cut {runs['planned'][-1]:.1f}, equal-layers cut "
                f"{runs['equal-layers'][-1]:.1f} samples/s",
                flush=True,
            )
        ratio = statistics.median(runs["planned"]) / statistics.median(runs["equal-layers"])
        print(
            f"planned cut {list(planned.split_points)} vs equal-layers cut {list(even)} on "
            f"traced resnet18, 2-stage 1F1B m={args.microbatches}: {ratio:.2f}x"
        )


if __name__ == "__main__":
    main()
