"""Each splitting strategy against the same strategy written by hand for ``torchrun``.

    python -m workflows.benchmarks.strategies [--strategies fsdp tp pp] [--repeats 3]
        [--steps 30] [--dim 256] [--layers 4] [--heads 8] [--sequence-length 128] [--batch 16]
        [--keep-freed-memory] [--in-memory]

Three strategies, each on 2 ranks on the CPU (gloo), the built-in GPT (``--layers`` blocks
``--dim`` wide), the same windows of tokens, the same global batch, in one run:

- ``fsdp``: FSDP2, ``fully_shard`` on each block (``training.strategy = "fsdp"``);
- ``tp``: tensor parallelism alone, ``parallelize_module`` with the GPT's Megatron plan
  (``training.strategy = "fsdp"``, ``parallel.tp = 2``: nothing left to shard over);
- ``pp``: a 2-stage pipeline cut between blocks at ``layers.<layers/2>``, 1F1B over
  ``--microbatches`` micro-batches (``training.strategy = "pipeline"``, ``parallel.pp = 2``).

Each runs three ways: (a) dask-train's built-in trainer with that config on a warm 2-worker
cluster, (b) the hand-written script (``workflows/benchmarks/torchrun_scripts/<strategy>.py``)
under ``dask-train launch`` on the same cluster (``launch_script``, the CLI's function, given
the cluster's scheduler), and the reference, the same script under
``torchrun --standalone --nproc-per-node 2``, with the workers' malloc settings
(``TUNED_MALLOC``: the launched scripts inherit them from their workers) and
``OMP_NUM_THREADS=1`` (as torchrun sets it for several processes, and Dask for its workers).

FSDP's trainer on a CPU hands each block of 1 MiB or more that it frees back to the kernel
(``fsdp.return_freed_memory``, on by default: a rank's peak near its shards, at a cost in
speed that depends on the machine's page faults). A script can make the same trade
(``MALLOC_MMAP_THRESHOLD_``), so where the trainer makes it, a fourth side runs the script
under torchrun with that threshold, ``torchrun (returning)``: the trainer's like-for-like
reference, and what the trade costs a plain script. With ``--keep-freed-memory`` the trainer
runs with ``fsdp.return_freed_memory = false`` and keeps freed memory for reuse, as the
scripts do.
With ``--in-memory`` the trainer reads its shard of the store into memory before the first
step (``data.in_memory = true``), as the scripts load the ``.npz`` whole, instead of reading
each batch from the store in a thread.
Every side measures steady samples/s as the trainer does: from the end of the third step to the
end of the last (the first steps pay one-off costs). The sides of a strategy run one
after another, the order rotating each repeat and strategy, so that the machine's noise hits
them alike; the figures are the medians of ``--repeats``, the ratios those of the medians,
and each side's paired ratios: in each repeat, to that repeat's torchrun run, and their median
(the machine's drift from repeat to repeat cancels in them).

The data: a corpus of text files written from a seed (made-up words, no
download) into a text store (byte tokenizer, windows of ``--sequence-length`` tokens) that the
trainer reads; its training split is written once to an ``.npz`` file that the scripts load
whole, each drawing the same global batches from a seeded permutation.
"""

import argparse
import json
import os
import statistics
import string
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from workers.data import open_store
from workers.malloc import SHARDED_MMAP_THRESHOLD
from workers.spec.cluster import ClusterConfig
from workers.spec.launch import LaunchConfig
from workers.spec.run import RunConfig
from workers.strategies import get_strategy
from workflows.cluster.training_cluster import TUNED_MALLOC, start_cluster
from workflows.jobs.script_launch import launch_script
from workflows.runs.config import load_config
from workflows.runs.driver import train

SCRIPTS = Path(__file__).resolve().parent / "torchrun_scripts"
STRATEGIES = ("fsdp", "tp", "pp")
SIDES = ("torchrun", "trainer", "launch")
# The script under torchrun with the trainer's malloc trade, where the trainer makes it.
RETURNING = "torchrun (returning)"


def write_corpus(folder: Path, *, files: int, kib: int, seed: int) -> None:
    """``files`` text files of about ``kib`` KiB each: lines of lowercase words drawn by
    ``seed`` from 500 made-up words (2 to 9 letters)."""
    rng = np.random.default_rng(seed)
    letters = np.array(list(string.ascii_lowercase))
    words = ["".join(rng.choice(letters, size=int(rng.integers(2, 10)))) for _ in range(500)]
    folder.mkdir(parents=True, exist_ok=True)
    for index in range(files):
        lines, size = [], 0
        while size < kib * 1024:
            line = " ".join(rng.choice(words, size=int(rng.integers(4, 16)))) + ".\n"
            lines.append(line)
            size += len(line)
        (folder / f"part-{index:03d}.txt").write_text("".join(lines))


def strategy_config(
    strategy: str, args: argparse.Namespace, corpus: Path, store: Path
) -> RunConfig:
    """dask-train's built-in trainer doing what ``torchrun_scripts/<strategy>.py`` does."""
    raw: dict = {
        "name": f"bench-strategies-{strategy}",
        "data": {
            "dataset": "text",
            "root": str(corpus),
            "files": "*.txt",
            "sequence_length": args.sequence_length,
            "drop_last": True,
            "val_fraction": 0.025,
            "store": str(store),
            "in_memory": args.in_memory,
        },
        "model": {
            "name": "gpt",
            "kwargs": {"dim": args.dim, "n_layers": args.layers, "n_heads": args.heads},
        },
        "training": {
            "strategy": "pipeline" if strategy == "pp" else "fsdp",
            "epochs": 1,
            "max_steps": args.steps,
            "batch_size": args.batch,
            "lr": 0.01,
        },
    }
    if strategy != "pp" and args.keep_freed_memory:
        raw["fsdp"] = {"return_freed_memory": False}
    if strategy == "tp":
        raw["parallel"] = {"tp": 2}
    if strategy == "pp":
        raw["parallel"] = {"pp": 2}
        raw["pipeline"] = {
            "schedule": "1f1b",
            "n_microbatches": args.microbatches,
            "split_points": [f"layers.{args.layers // 2}"],
        }
    return load_config(raw)


def returns_freed_memory(config: RunConfig) -> bool:
    """Whether the trainer's CPU ranks hand freed blocks back to the kernel (the strategy's
    rule, which ``workers/train.py: run_rank`` follows, at 2 ranks)."""
    return get_strategy(config.training.strategy).returns_freed_memory(
        config.strategy_settings, layout=config.layout(2), device=torch.device("cpu")
    )


def with_steps(config: RunConfig, steps: int) -> RunConfig:
    return config.model_copy(
        update={"training": config.training.model_copy(update={"max_steps": steps})}
    )


def export_batches(config: RunConfig, path: Path) -> int:
    """The store's training split as the scripts read it; returns its number of windows."""
    split = open_store(config.data.store_url).train
    tokens = np.asarray(split.images[:], dtype=np.int64)
    targets = np.asarray(split.labels, dtype=np.int64)
    np.savez(path, tokens=tokens, next=targets, vocabulary=256)  # the byte tokenizer's
    return len(tokens)


def script_args(strategy: str, args: argparse.Namespace, data: Path, steps: int) -> list[str]:
    found = [
        "--data",
        str(data),
        "--dim",
        str(args.dim),
        "--layers",
        str(args.layers),
        "--heads",
        str(args.heads),
        "--batch",
        str(args.batch),
        "--steps",
        str(steps),
    ]
    if strategy == "pp":
        found += ["--microbatches", str(args.microbatches)]
    return found


def _result(lines: list[str]) -> dict:
    line = next(x for x in lines if "RESULT " in x)
    return json.loads(line[line.index("RESULT ") + len("RESULT ") :])


def under_torchrun(strategy: str, arguments: list[str], *, returning: bool = False) -> dict:
    """``returning``: with the trainer's mmap threshold, freed blocks of that size or more
    handed back to the kernel at once (``fsdp.return_freed_memory``)."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(SCRIPTS / f"{strategy}.py"),
        *arguments,
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env |= {"OMP_NUM_THREADS": "1", **{k: str(v) for k, v in TUNED_MALLOC.items()}}
    if returning:
        env["MALLOC_MMAP_THRESHOLD_"] = str(SHARDED_MMAP_THRESHOLD)
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"torchrun failed:\n{done.stderr[-3000:]}")
    return _result(done.stdout.splitlines())


def under_launch(strategy: str, arguments: list[str], scheduler: str) -> dict:
    """``dask-train launch --scheduler ADDR --world-size 2 SCRIPT ARGS``, as the CLI runs it."""
    lines: list[str] = []
    launch_script(
        str(SCRIPTS / f"{strategy}.py"),
        tuple(arguments),
        cluster=ClusterConfig(scheduler=scheduler),
        launch_config=LaunchConfig(world_size=2),
        echo=lines.append,
    )
    return _result(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategies", nargs="+", choices=STRATEGIES, default=list(STRATEGIES))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--sequence-length", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16, help="global, per step")
    parser.add_argument("--microbatches", type=int, default=8, help="pp's, per step")
    parser.add_argument(
        "--in-memory",
        action="store_true",
        help="the trainer reads its shard into memory first (data.in_memory), as the scripts do",
    )
    parser.add_argument(
        "--keep-freed-memory",
        action="store_true",
        help="the trainer with fsdp.return_freed_memory = false, as the scripts run",
    )
    args = parser.parse_args()
    # Before anything asks CUDA: the workers, the launched scripts and torchrun's ranks
    # inherit it, so the figures mean the same on every machine.
    os.environ["CUDA_VISIBLE_DEVICES"] = ""

    rates: dict[str, dict[str, list[float]]] = {}
    with (
        tempfile.TemporaryDirectory() as tmp,
        start_cluster(n_workers=2, dashboard_port=0) as cluster,
    ):
        folder = Path(tmp)
        # Enough windows for every step's batch from one permutation, half again over, in 40
        # files: validation (after the steps, not timed, but run) takes one of them.
        need = args.steps * args.batch * (args.sequence_length + 1) * 3 // 2
        write_corpus(folder / "corpus", files=40, kib=need // 1024 // 39 + 1, seed=0)
        configs = {
            s: strategy_config(s, args, folder / "corpus", folder / "store")
            for s in args.strategies
        }
        for strategy, config in configs.items():
            returning = (RETURNING,) if returns_freed_memory(config) else ()
            rates[strategy] = {side: [] for side in SIDES + returning}
        scheduler = cluster.client.scheduler.address
        data = folder / "batches.npz"
        # Imports, the store (built by the first job), first-touch: paid once, left out.
        for strategy, config in configs.items():
            train(with_steps(config, 4), cluster=cluster, on_event=None)
            if not data.exists():
                windows = export_batches(config, data)
            warm = script_args(strategy, args, data, 4)
            under_torchrun(strategy, warm, returning=RETURNING in rates[strategy])
            under_launch(strategy, warm, scheduler)
        print(
            f"GPT dim {args.dim}, {args.layers} blocks, {args.heads} heads, windows of "
            f"{args.sequence_length} tokens ({windows} in the training split), global batch "
            f"{args.batch}, {args.steps} steps, 2 ranks on the CPU (gloo)",
            flush=True,
        )
        sides = {
            "torchrun": lambda s: under_torchrun(s, script_args(s, args, data, args.steps))[
                "steady_samples_per_s"
            ],
            "trainer": lambda s: (
                train(configs[s], cluster=cluster, on_event=None).steady_samples_per_s
            ),
            "launch": lambda s: under_launch(s, script_args(s, args, data, args.steps), scheduler)[
                "steady_samples_per_s"
            ],
            RETURNING: lambda s: under_torchrun(
                s, script_args(s, args, data, args.steps), returning=True
            )["steady_samples_per_s"],
        }
        for repeat in range(args.repeats):
            for index, strategy in enumerate(args.strategies):
                order = list(rates[strategy])
                shift = (repeat + index) % len(order)  # no side always first, or after another
                for side in order[shift:] + order[:shift]:
                    rates[strategy][side].append(sides[side](strategy))
                got = ", ".join(f"{side} {v[-1]:.1f}" for side, v in rates[strategy].items())
                print(f"repeat {repeat + 1}, {strategy}: {got} samples/s", flush=True)

    print()
    print(f"steady samples/s, median of {args.repeats} (ratio to torchrun):")
    print(f"  {'strategy':<9}{'torchrun':>10}{'dask-train trainer':>26}{'script under launch':>27}")
    for strategy, got in rates.items():
        med = {side: statistics.median(values) for side, values in got.items()}
        reference = med["torchrun"]
        print(
            f"  {strategy:<9}{reference:>10.1f}"
            f"{med['trainer']:>17.1f} ({med['trainer'] / reference:.3f})"
            f"{med['launch']:>18.1f} ({med['launch'] / reference:.3f})"
        )
    # A side against torchrun in the same repeat, run back to back: the machine's drift over
    # the repeats (seen: 1.3x from the first to the last) is common to both, and cancels.
    print("paired: each repeat's ratio to that repeat's torchrun, and their median:")
    for strategy, got in rates.items():
        pairs = [("trainer", "torchrun"), ("launch", "torchrun")]
        if RETURNING in got:  # like for like, and what the trade costs the script itself
            pairs += [("trainer", RETURNING), (RETURNING, "torchrun")]
        for side, reference in pairs:
            ratios = [v / t for v, t in zip(got[side], got[reference], strict=True)]
            each = ", ".join(f"{r:.3f}" for r in ratios)
            median = statistics.median(ratios)
            print(f"  {strategy:<5}{side:<21} / {reference:<21} {each}  median {median:.3f}")
    print("every run (samples/s):")
    for strategy, got in rates.items():
        for side, values in got.items():
            print(f"  {strategy:<5}{side:<21} {', '.join(f'{v:.1f}' for v in values)}")


if __name__ == "__main__":
    main()
