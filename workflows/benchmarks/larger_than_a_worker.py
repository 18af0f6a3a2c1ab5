"""A model larger than one worker: tried under ``fsdp`` on 4 ranks and ``pipeline`` in 4
stages on workers whose nanny kills them past ``cluster.memory_limit``, and compared with one
process; built whole first (``model.init = 'factory'``), the same job is killed.

    python -m workflows.benchmarks.larger_than_a_worker [--limit-gib 3] [--ratio 1.05]
        [--steps 2] [--runs fsdp pipeline fsdp-whole]

The model is the built-in GPT, 1,024 wide, with as many blocks as make its float32 parameters
``--ratio`` times the limit. Each job trains ``--steps`` SGD steps (no momentum) on windows of
8 bytes of two small text files written to a temporary folder, and runs with
``launch.max_failures = 0``: a worker killed fails it, saying which. One process then trains the
same model on the same batches, without a limit, and the largest difference of any parameter
is printed beside the largest change training made, with each rank's peak
(``peak_memory_mib``). Needs ~19 GB of host memory (4 x the limit, then the one-process
reference: ~3 x the model) and ~8 minutes on 2 cores. What it measured and found:
docs/guides/parallelism.md, "Models larger than one worker". tests/test_larger_than_a_worker.py
(``make test-large``) asserts the same with these pieces, at a limit of 2.5 GiB.
"""

import argparse
import math
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from workers.models import build_model
from workers.spec.run import RunConfig
from workflows.cluster.training_cluster import start_cluster
from workflows.jobs.launch import TrainingFailed
from workflows.runs.config import load_config
from workflows.runs.driver import train

WIDTH, HEADS, SEQUENCE, BATCH, LR = 1024, 16, 8, 4, 0.02  # 256 byte tokens
BLOCK_PARAMETERS = 12 * WIDTH**2 + 13 * WIDTH  # attention, feed-forward, two norms
RUNS = {
    "fsdp": ("fsdp", "auto"),
    "pipeline": ("pipeline", "auto"),
    "fsdp-whole": ("fsdp", "factory"),
}
# The ranks each run's one-process reference stands for: FSDP's 4 read 4 shards, the
# pipeline's one group of stages reads one.
READERS = {"fsdp": 4, "pipeline": 1}
TEXT = (
    "A model whose parameters exceed one worker's memory is trained by splitting it, so "
    "that each rank holds only its part: the shards of every layer, or its stages. "
)


def blocks_for(limit: int, ratio: float) -> int:
    """The GPT's blocks that make its float32 parameters ``ratio`` times ``limit`` bytes."""
    return math.ceil(ratio * limit / 4 / BLOCK_PARAMETERS)


def write_text(folder: Path) -> None:
    """The corpus every run reads: two small text files under ``folder/text``."""
    (folder / "text").mkdir()
    (folder / "text" / "train.txt").write_text(TEXT * 20)
    (folder / "text" / "val.txt").write_text(TEXT[:80])


def run_config(folder: Path, *, layers: int, run: str, steps: int) -> RunConfig:
    """The job of ``run`` (one of RUNS) on the corpus in ``folder``."""
    strategy, init = RUNS[run]
    raw = {
        "name": f"larger-than-a-worker-{run}",
        "data": {
            "dataset": "text",
            "root": str(folder / "text"),
            "files": "*.txt",
            "sequence_length": SEQUENCE,
            "store": str(folder / "store"),
        },
        "model": {
            "name": "gpt",
            "init": init,
            "kwargs": {"dim": WIDTH, "n_layers": layers, "n_heads": HEADS},
        },
        "training": {
            "strategy": strategy,
            "batch_size": BATCH,
            "max_steps": steps,
            "epochs": 1,
            "lr": LR,
            "momentum": 0.0,
            "seed": 5,
            "log_every_steps": 0,
        },
        "launch": {"max_failures": 0},
    }
    if strategy == "pipeline":
        cuts = [f"layers.{layers * stage // 4}" for stage in (1, 2, 3)]
        raw["parallel"] = {"pp": 4}
        raw["pipeline"] = {"n_microbatches": 4, "split_points": cuts}
    return load_config(raw)


@dataclass(frozen=True)
class Outcome:
    """One job on the small workers: the trained model saved to ``saved``, or why it failed."""

    wall_s: float
    parameters: int = 0
    peak_memory_mib: tuple[float | None, ...] = ()
    saved: Path | None = None
    failure: str | None = None


def train_on_small_workers(
    folder: Path, *, limit: int, layers: int, steps: int, runs: list[str]
) -> dict[str, Outcome]:
    """Each of ``runs`` in turn on one cluster of 4 workers whose nannies kill them past
    ``limit`` bytes; each trained model is saved to ``folder/<run>.pt`` before the next job
    (the client holds one model at a time: a copy each would not fit beside the one-process
    reference on a 24 GiB machine; measured: OOM-killed)."""
    outcomes = {}
    with start_cluster(n_workers=4, dashboard_port=0, memory_limit=limit) as cluster:
        for run in runs:
            config = run_config(folder, layers=layers, run=run, steps=steps)
            started = time.perf_counter()
            try:
                result = train(config, cluster=cluster, on_event=None)
            except TrainingFailed as failure:
                wall = time.perf_counter() - started
                outcomes[run] = Outcome(wall, failure=str(failure))
                continue
            wall = time.perf_counter() - started
            saved = folder / f"{run}.pt"
            torch.save(result.state_dict, saved)
            outcomes[run] = Outcome(
                wall,
                parameters=sum(v.numel() for v in result.state_dict.values()),
                peak_memory_mib=tuple(result.peak_memory_mib),
                saved=saved,
            )
            del result
    return outcomes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit-gib", type=float, default=3.0)
    parser.add_argument("--ratio", type=float, default=1.05)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument(
        "--runs",
        nargs="+",
        choices=RUNS,
        default=list(RUNS),
        help="which jobs: fsdp and pipeline laid out in place, fsdp-whole built whole first",
    )
    args = parser.parse_args()
    limit = int(args.limit_gib * 2**30)
    layers = blocks_for(limit, args.ratio)
    with tempfile.TemporaryDirectory() as folder:
        folder = Path(folder)
        write_text(folder)
        outcomes = train_on_small_workers(
            folder, limit=limit, layers=layers, steps=args.steps, runs=args.runs
        )
        for run, outcome in outcomes.items():
            strategy, init = RUNS[run]
            if outcome.failure is not None:
                print(f"{strategy} init={init}: failed ({outcome.failure.splitlines()[0]})")
                continue
            print(
                f"{strategy} init={init}: {outcome.parameters / 1e6:.0f} M parameters, "
                f"{outcome.parameters * 4 / limit:.2f} x the limit of {args.limit_gib} GiB; "
                f"peak per rank {list(outcome.peak_memory_mib)} MiB; {outcome.wall_s:.0f} s"
            )
        # The repository's one-process reference (tests/reference.py): the ranks' batches, each
        # rank's share through the model on its own, in float32; one run at a time, as each
        # takes ~3 copies of the model.
        from tests import reference

        for run, outcome in outcomes.items():
            if outcome.saved is None:
                continue
            config = run_config(folder, layers=layers, run=run, steps=args.steps)
            expected = reference.train_in_one_process(
                config, world_size=READERS[run], steps=args.steps
            )
            reference.forget_computed()  # its cache: another copy of the model
            initial = build_model(config.model, num_classes=256, seed=5, input_shape=(SEQUENCE,))
            start = initial.state_dict()
            update = max((v - start[k]).abs().max().item() for k, v in expected.items())
            del initial, start
            # Mapped: the file's pages, not another copy in the process's own memory.
            state = torch.load(outcome.saved, mmap=True, weights_only=True)
            worst = max((state[k] - v).abs().max().item() for k, v in expected.items())
            print(
                f"{run} against one process: largest difference {worst:.1e}, against "
                f"the largest change training made {update:.1e}",
                flush=True,
            )
            del state, expected


if __name__ == "__main__":
    main()
