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
reference: ~5 x the model) and ~8 minutes on 2 cores. What it measured and found:
docs/guides/parallelism.md, "Models larger than one worker".
"""

import argparse
import math
import tempfile
import time
from pathlib import Path

import torch

from workers.models import build_model
from workflows.cluster import start_cluster
from workflows.config import RunConfig, load_config
from workflows.driver import train
from workflows.jobs import TrainingFailed

WIDTH, HEADS, SEQUENCE, BATCH, LR = 1024, 16, 8, 4, 0.02  # 256 byte tokens
BLOCK_PARAMETERS = 12 * WIDTH**2 + 13 * WIDTH  # attention, feed-forward, two norms
RUNS = {
    "fsdp": ("fsdp", "auto"),
    "pipeline": ("pipeline", "auto"),
    "fsdp-whole": ("fsdp", "factory"),
}
TEXT = (
    "A model whose parameters exceed one worker's memory is trained by splitting it, so "
    "that each rank holds only its part: the shards of every layer, or its stages. "
)


def _config(folder: Path, *, layers: int, strategy: str, init: str, steps: int) -> RunConfig:
    raw = {
        "name": f"larger-than-a-worker-{strategy}-{init}",
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
    layers = math.ceil(args.ratio * limit / 4 / BLOCK_PARAMETERS)
    with tempfile.TemporaryDirectory() as folder:
        folder = Path(folder)
        (folder / "text").mkdir()
        (folder / "text" / "train.txt").write_text(TEXT * 20)
        (folder / "text" / "val.txt").write_text(TEXT[:80])
        with start_cluster(n_workers=4, dashboard_port=0, memory_limit=limit) as cluster:
            saved: dict[str, Path] = {}
            for run in args.runs:
                strategy, init = RUNS[run]
                config = _config(
                    folder, layers=layers, strategy=strategy, init=init, steps=args.steps
                )
                started = time.perf_counter()
                try:
                    result = train(config, cluster=cluster, on_event=None)
                except TrainingFailed as failure:
                    print(f"{strategy} init={init}: failed ({str(failure).splitlines()[0]})")
                    continue
                wall = time.perf_counter() - started
                parameters = sum(v.numel() for v in result.state_dict.values())
                print(
                    f"{strategy} init={init}: {parameters / 1e6:.0f} M parameters, "
                    f"{parameters * 4 / limit:.2f} x the limit of {args.limit_gib} GiB; "
                    f"peak per rank {result.peak_memory_mib} MiB; {wall:.0f} s"
                )
                # To disk: the client holds one model at a time (a copy each would not fit
                # beside the one-process reference on a 24 GiB machine; measured: OOM-killed).
                saved[run] = folder / f"{run}.pt"
                torch.save(result.state_dict, saved[run])
                del result
        if not saved:
            return
        # The repository's one-process reference (tests/reference.py): the ranks' batches, each
        # rank's share through the model on its own, in float32; one run at a time, as each
        # takes ~5 copies of the model.
        from tests import reference

        for run, path in saved.items():
            strategy = RUNS[run][0]
            expected = reference.train_in_one_process(
                _config(folder, layers=layers, strategy=strategy, init="auto", steps=args.steps),
                # FSDP's 4 ranks read 4 shards; the pipeline's one group of stages reads one.
                world_size=4 if strategy == "fsdp" else 1,
                steps=args.steps,
            )
            reference.forget_computed()  # its cache: another copy of the model
            initial = build_model(config.model, num_classes=256, seed=5, input_shape=(SEQUENCE,))
            start = initial.state_dict()
            update = max((v - start[k]).abs().max().item() for k, v in expected.items())
            del initial, start
            # Mapped: the file's pages, not another copy in the process's own memory.
            state = torch.load(path, mmap=True, weights_only=True)
            worst = max((state[k] - v).abs().max().item() for k, v in expected.items())
            print(
                f"{run} against one process: largest difference {worst:.1e}, against "
                f"the largest change training made {update:.1e}",
                flush=True,
            )
            del state, expected


if __name__ == "__main__":
    main()
