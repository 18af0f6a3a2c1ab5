"""SGD against AdamW on the built-in GPT: training loss against steps, and a plot of both.

    python -m workflows.benchmarks.optimizers [--steps 200] [--plot docs/assets/gpt_optimizers.png]

The config of ``workflows/configs/stdlib_gpt.toml`` (the standard library's sources, byte by
byte, the 4-block GPT) under DDP on 2 ranks, the same batches and steps for both:

- SGD as that config had it until the optimizer became a choice: lr 0.5, momentum 0.9,
  cosine after 20 steps of warm-up, gradients clipped to norm 1;
- AdamW as the config has it now (``training.optimizer = "adamw"``): lr 3e-3, betas (0.9,
  0.95), weight decay 0.1 off biases and norms, the same warm-up, cosine and clipping.

Each run logs its loss every 5 steps. Printed: each optimizer's loss over its last 20 steps,
and the first step at which AdamW's loss (averaged over 20 steps) is down to SGD's final one.
"""

import argparse
import tempfile
from pathlib import Path

from workers.records import StepRecord, parse_record
from workflows.cluster.training_cluster import start_cluster
from workflows.runs.config import load_config
from workflows.runs.driver import train

CONFIG = Path(__file__).parents[1] / "configs" / "stdlib_gpt.toml"
SGD = {"optimizer": "sgd", "optimizer_kwargs": {}, "lr": 0.5, "momentum": 0.9, "weight_decay": 0.0}
EVERY = 5  # steps between logged losses
WINDOW = 4  # logged losses averaged: 20 steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--plot", type=Path, help="write the loss curves to this PNG")
    args = parser.parse_args()
    curves: dict[str, list[tuple[int, float]]] = {}
    with tempfile.TemporaryDirectory() as folder, start_cluster(n_workers=2) as cluster:
        for label, training in (("SGD", SGD), ("AdamW", {})):
            overrides = {
                "strategy": "ddp",
                "max_steps": args.steps,
                "log_every_steps": EVERY,
                **training,
            }
            config = load_config(
                CONFIG,
                [
                    "parallel.tp=1",
                    f"data.store='{folder}/stdlib'",
                    *(f"training.{k}={v!r}" for k, v in overrides.items()),
                ],
            )
            records: list[dict] = []
            train(config, cluster=cluster, on_event=records.append)
            steps = [r for r in map(parse_record, records) if isinstance(r, StepRecord)]
            curves[label] = [(r.step, r.loss) for r in steps]
    sgd_final = _smoothed(curves["SGD"])[-1][1]
    reached = next((step for step, loss in _smoothed(curves["AdamW"]) if loss <= sgd_final), None)
    for label, curve in curves.items():
        print(f"{label}: loss {_smoothed(curve)[-1][1]:.3f} over its last {EVERY * WINDOW} steps")
    print(
        f"AdamW reaches SGD's final loss ({sgd_final:.3f}) at step "
        f"{reached if reached is not None else 'never'} of {args.steps}"
    )
    if args.plot:
        _plot(curves, args.plot)
        print(f"plot: {args.plot}")


def _smoothed(curve: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """Each logged step with the mean of the last WINDOW losses up to it."""
    return [
        (step, sum(loss for _, loss in curve[max(0, i - WINDOW + 1) : i + 1]) / min(i + 1, WINDOW))
        for i, (step, _) in enumerate(curve)
    ]


def _plot(curves: dict[str, list[tuple[int, float]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 3.5), dpi=120)
    for label, curve in curves.items():
        axes.plot(*zip(*curve, strict=True), label=label)
    axes.set_xlabel("step")
    axes.set_ylabel("training loss (cross-entropy, bytes)")
    axes.set_title("The built-in GPT on the standard library's sources, 2 ranks")
    axes.legend(loc="upper right", frameon=False)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)


if __name__ == "__main__":
    main()
