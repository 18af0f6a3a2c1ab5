"""FSDP2 against DDP: peak memory per rank and throughput, at 2 and 4 ranks.

    python -m workflows.benchmarks.fsdp [--model mlp|gpt] [--width 4096] [--layers 6] [--steps 4]
        [--activation-checkpointing none full selective]

On one machine, for each world size (2, then 4 workers), in one run: the same model, data and
steps under ``ddp`` and ``fsdp``. The model is a stack of ``--layers`` square linear layers
``--width`` wide (6 x 4096 wide: 101 M parameters), so that parameters, gradients and
optimizer state (SGD momentum) dominate a rank's memory, as in a large transformer; the data is
the synthetic store (32x32 RGB). ``--model gpt``: the built-in GPT, ``--layers`` blocks
``--width`` wide (8 x 1024: 101 M parameters), on windows of 64 bytes of the standard library's
wsgiref package (the text store), global batch 8 unless ``--batch`` says otherwise.

Memory: each rank's peak while training, as ``TrainResult.peak_memory_mib`` reports it (the
growth of the worker's peak resident set on CPU, CUDA's allocator peak on a GPU; the model's
pieces copied for the client at the end left out), the largest rank's. A DDP rank holds the
parameters, their gradients, DDP's gradient buckets and the momentum, ~4 copies; an FSDP rank
1/N of the three sharded states plus, while one layer runs, that layer whole: it is built on
the meta device and draws only its shards (``model.init``; ``--init factory`` builds the
linear stack whole on every rank first, as every model was before). Throughput: steady
samples/s, FSDP over DDP, in the same run.

``--activation-checkpointing`` runs each strategy under each mode given
(``training.activation_checkpointing``): the peak with and without the blocks' activations
kept, and what recomputing them costs in samples/s.
"""

import argparse
import tempfile

from workflows.cluster import start_cluster
from workflows.config import RunConfig, load_config
from workflows.driver import train


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("mlp", "gpt"), default="mlp")
    parser.add_argument("--width", type=int)
    parser.add_argument("--layers", type=int)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch", type=int)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--strategies", nargs="+", default=["ddp", "fsdp"])
    parser.add_argument(
        "--init",
        choices=("reset_parameters", "factory"),
        default="reset_parameters",
        help="model.init of the linear stack: factory builds it whole on every rank first",
    )
    parser.add_argument(
        "--activation-checkpointing",
        nargs="+",
        default=["none"],
        choices=("none", "full", "selective"),
        dest="checkpointing",
    )
    args = parser.parse_args()
    gpt = args.model == "gpt"
    width = args.width or (1024 if gpt else 4096)
    layers = args.layers or (8 if gpt else 6)
    batch = args.batch or (8 if gpt else 32)
    if gpt:
        # A small corpus: validation runs the 101 M-parameter model over the whole val split
        # (one file, 105 windows), which on a CPU takes longer than the steps measured.
        data = {
            "dataset": "text",
            "root": "python:wsgiref",
            "files": "*.py",
            "sequence_length": 64,
            "val_fraction": 0.1,
        }
        model = {"name": "gpt", "kwargs": {"dim": width, "n_layers": layers, "n_heads": 8}}
    else:
        data = {"dataset": "synthetic", "synthetic_samples": 1024}
        model = {
            "name": "workflows.benchmarks.wide_mlp:wide_mlp",
            "kwargs": {"width": width, "layers": layers},
            # torch's layers only: their reset_parameters draw the constructor's own values,
            # so FSDP's ranks draw their shards in place (the GPT's are too, as a built-in).
            "init": args.init,
        }

    def config(store: str, strategy: str, checkpointing: str) -> RunConfig:
        return load_config(
            {
                "name": f"fsdp-bench-{strategy}",
                "data": data | {"store": store},
                "model": model,
                "training": {
                    "strategy": strategy,
                    "epochs": 1,
                    "max_steps": args.steps,
                    "batch_size": batch,
                    "lr": 0.01,
                    "activation_checkpointing": checkpointing,
                },
            }
        )

    with tempfile.TemporaryDirectory() as tmp:
        for ranks in args.ranks:
            grown: dict[str, float] = {}
            speed: dict[str, float] = {}
            for strategy in args.strategies:
                for checkpointing in args.checkpointing:
                    # Fresh workers for each: a warm worker's heap keeps what its last job
                    # freed, and the next job reuses it resident (an FSDP job after a DDP job
                    # on the same workers measured 1.4 GiB per rank, 0.8 GiB on fresh ones).
                    # Each worker may hold a whole DDP replica: 24 GiB machines, 4 ranks of
                    # ~2 GiB.
                    with start_cluster(n_workers=ranks, dashboard_port=0) as cluster:
                        result = train(
                            config(f"{tmp}/store", strategy, checkpointing),
                            cluster=cluster,
                            on_event=None,
                        )
                    # The largest rank's: TrainResult's per-rank peaks (workers/peak_memory.py).
                    if checkpointing == args.checkpointing[0]:
                        grown[strategy] = max(result.peak_memory_mib)
                        speed[strategy] = result.steady_samples_per_s
                    mode = (
                        f", checkpointing {checkpointing}" if args.checkpointing != ["none"] else ""
                    )
                    print(
                        f"{ranks} ranks, {strategy}{mode}: peak memory per rank "
                        f"{', '.join(f'{m:,.0f}' for m in result.peak_memory_mib)} MiB, "
                        f"{result.steady_samples_per_s:.1f} samples/s",
                        flush=True,
                    )
            if {"ddp", "fsdp"} <= set(grown):
                print(
                    f"{ranks} ranks: FSDP / DDP peak memory per rank "
                    f"{grown['fsdp'] / grown['ddp']:.2f}x, samples/s "
                    f"{speed['fsdp'] / speed['ddp']:.2f}x",
                    flush=True,
                )


if __name__ == "__main__":
    main()
