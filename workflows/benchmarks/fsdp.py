"""FSDP2 against DDP: peak memory per rank and throughput, at 2 and 4 ranks, beside what
``dask-train plan`` estimates.

    python -m workflows.benchmarks.fsdp [--model mlp|gpt|vit] [--width 4096] [--layers 6]
        [--steps 4] [--activation-checkpointing none full selective] [--no-estimate]
        [--keep-freed-memory] [--checkpoints]

On one machine, for each world size (2, then 4 workers), in one run: the same model, data and
steps under ``ddp`` and ``fsdp``. The model is a stack of ``--layers`` square linear layers
``--width`` wide (6 x 4096 wide: 101 M parameters), so that parameters, gradients and
optimizer state (SGD momentum) dominate a rank's memory, as in a large transformer; the data is
the synthetic store (32x32 RGB). ``--model gpt``: the built-in GPT, ``--layers`` blocks
``--width`` wide (8 x 1024: 101 M parameters), on windows of 64 bytes of the standard library's
wsgiref package (the text store), global batch 8 unless ``--batch`` says otherwise.
``--model vit``: torchvision's ``vit_b_16`` (86 M parameters) on the synthetic 32x32 images
(``image_size = 32``), global batch 32. Its class token and position embedding cannot draw
their values in place (no ``reset_parameters``), so it starts from a weights file the
benchmark writes first from a seed (``model.weights``): each rank maps it and copies its part;
``--init factory`` builds it whole on every rank instead.

Memory: each rank's peak while training, as ``TrainResult.peak_memory_mib`` reports it (the
growth of the worker's peak resident set on CPU, CUDA's allocator peak on a GPU; the model's
pieces copied for the client at the end left out), the largest rank's. A DDP rank holds the
parameters, their gradients, DDP's gradient buckets and the momentum, ~4 copies; an FSDP rank
1/N of the three sharded states plus, while one layer runs, that layer whole: it is built on
the meta device and draws only its shards (``model.init``; ``--init factory`` builds the
model whole on every rank first, as every model was before). Throughput: steady
samples/s, FSDP over DDP, in the same run.

After each job, on the same workers, the planner profiles the model
(``workflows.runs.planner.plan``, what ``dask-train plan`` prints) and its estimate of a rank's
memory under that strategy and world size is printed beside the measured peak.

``--keep-freed-memory`` runs FSDP with ``fsdp.return_freed_memory = false``: on a CPU, glibc
keeps what FSDP frees (each unit's gathered parameters and gradients) for reuse, faster, and
resident: the peak this costs against the default.

``--checkpoints`` writes checkpoints as ``dask-train run`` does (``checkpoint.async_save``, the
default: each rank keeps a CPU copy of its part of the state, and its serialized files while
they are written), at the last step: the peak with them, which the plan counts.

``--activation-checkpointing`` runs each strategy under each mode given
(``training.activation_checkpointing``): the peak with and without the blocks' activations
kept, and what recomputing them costs in samples/s.
"""

import argparse
import tempfile
from pathlib import Path

from workers.spec.run import RunConfig
from workflows.cluster.training_cluster import start_cluster
from workflows.runs.config import load_config
from workflows.runs.driver import train
from workflows.runs.planner import plan
from workflows.runs.resolved_run import resolve_run

VIT_IMAGE_SIZE, VIT_CLASSES = 32, 10


def _vit_weights(folder: Path) -> Path:
    """A vit_b_16's initial values from a seed, as a whole-model file (model.weights)."""
    import torch
    from torchvision.models import vit_b_16

    torch.manual_seed(0)
    path = folder / "vit_b_16.pt"
    torch.save(vit_b_16(image_size=VIT_IMAGE_SIZE, num_classes=VIT_CLASSES).state_dict(), path)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("mlp", "gpt", "vit"), default="mlp")
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
        help="model.init of the linear stack and the ViT: factory builds it whole on every "
        "rank first",
    )
    parser.add_argument(
        "--no-estimate",
        action="store_false",
        dest="estimate",
        help="skip the planner's estimate after each job",
    )
    parser.add_argument(
        "--keep-freed-memory",
        action="store_true",
        help="fsdp.return_freed_memory = false: malloc keeps what FSDP frees, for speed",
    )
    parser.add_argument(
        "--checkpoints",
        action="store_true",
        help="checkpoint as dask-train run does (asynchronously, at the last step)",
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
    tmp = tempfile.TemporaryDirectory()
    if args.model == "vit":
        data = {"dataset": "synthetic", "synthetic_samples": 1024}
        model = {"name": "torchvision:vit_b_16", "kwargs": {"image_size": VIT_IMAGE_SIZE}}
        if args.init != "factory":
            model["weights"] = str(_vit_weights(Path(tmp.name)))
    elif gpt:
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
        checkpoints = (
            {"directory": f"{tmp.name}/checkpoints-{strategy}"} if args.checkpoints else {}
        )
        return load_config(
            {
                "name": f"fsdp-bench-{strategy}",
                "data": data | {"store": store},
                "model": model,
                "checkpoint": checkpoints,
                "training": {
                    "strategy": strategy,
                    "epochs": 1,
                    "max_steps": args.steps,
                    "batch_size": batch,
                    "lr": 0.01,
                    "activation_checkpointing": checkpointing,
                },
            }
            | ({"fsdp": {"return_freed_memory": False}} if args.keep_freed_memory else {})
        )

    with tmp:
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
                    run = config(f"{tmp.name}/store", strategy, checkpointing)
                    with start_cluster(n_workers=ranks, dashboard_port=0) as cluster:
                        result = train(run, cluster=cluster, on_event=None)
                        estimate = None
                        if args.estimate and result.store is not None:
                            # After the job: profiling builds the model whole on a worker.
                            planned = plan(
                                cluster.client,
                                resolve_run(cluster.client, run),  # on its `ranks` workers
                                num_classes=result.store.num_classes,
                            )
                            estimate = planned.memory[ranks if strategy == "fsdp" else 1]
                            profiled = planned.profile
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
                    if estimate is not None:
                        measured = max(result.peak_memory_mib)
                        print(
                            f"  plan's estimate {estimate.total / 2**20:,.0f} MiB (parameters "
                            f"{estimate.parameters / 2**20:,.0f}, gradients "
                            f"{estimate.gradients / 2**20:,.0f}, optimizer "
                            f"{estimate.optimizer / 2**20:,.0f}, activations "
                            f"{estimate.activations / 2**20:,.0f}, checkpoint "
                            f"{estimate.checkpoint / 2**20:,.0f}); measured / estimate "
                            f"{measured / (estimate.total / 2**20):.2f}",
                            flush=True,
                        )
                        layers = profiled.layers
                        print(
                            f"  profile: parameters "
                            f"{sum(x.param_bytes for x in layers) / 2**20:,.1f} MiB, largest "
                            f"unit {profiled.largest_unit_bytes / 2**20:,.1f} MiB, "
                            f"activations {sum(x.activation_bytes for x in layers) / 2**20:,.2f}"
                            f" MiB per micro-batch of {profiled.micro_batch}",
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
