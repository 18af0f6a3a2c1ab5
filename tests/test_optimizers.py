"""The built-in trainer's optimizer, LR schedule and weight decay (workers/optimizers.py): what a
config may name, the schedules' shapes, the groups weight decay spares, and AdamW with a
cosine schedule on two ranks against the one-process reference and across a resume."""

import inspect
import json
import math

import pytest
import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR, LRScheduler

from tests.reference import (
    GRADIENTS_SUMMED,
    assert_matches_one_process,
    assert_same_parameters,
    bugs_that_apply,
)
from workers.checkpoint import MANIFEST, list_checkpoints
from workers.optimizers import build_optimizer, build_schedule, lr_factor
from workers.spec.errors import ConfigError
from workers.spec.sections import (
    OPTIMIZER_ARGUMENTS,
    OPTIMIZERS,
    TORCH_OPTIMIZERS,
    TORCH_SCHEDULES,
    TrainingConfig,
)
from workflows.runs.config import check_model, load_config
from workflows.runs.driver import train


@pytest.mark.parametrize(
    ("training", "message"),
    [
        ({"optimizer": "adam_w"}, r"training\.optimizer: unknown optimizer 'adam_w'; did you "),
        ({"optimizer": "Lion"}, r"training\.optimizer: unknown optimizer 'Lion'"),
        (
            {"optimizer": "adamw", "optimizer_kwargs": {"beta": [0.9, 0.95]}},
            r"training\.optimizer_kwargs: adamw takes no argument 'beta'; did you mean 'betas'",
        ),
        (
            {"optimizer": "adamw", "optimizer_kwargs": {"lr": 0.1}},
            r"training\.optimizer_kwargs: 'lr' is training\.lr; set it there",
        ),
        ({"optimizer": "adamw", "momentum": 0.5}, r"training\.momentum is sgd's; adamw takes"),
        ({"lr_schedule": "cosin"}, r"training\.lr_schedule: .*did you mean 'cosine'"),
        ({"lr_schedule": "step"}, r"training\.lr_step_size: lr_schedule = 'step' needs it"),
        ({"lr_schedule": "cosine", "min_lr": 1.0}, r"training\.min_lr \(1\) is above"),
        ({"min_lr": 0.01}, r"training\.min_lr: for cosine and linear, not 'constant'"),
        (
            {"lr_schedule_kwargs": {"gamma": 0.5}},
            r"training\.lr_schedule_kwargs: for a torch\.optim\.lr_scheduler class",
        ),
        (
            {"lr_schedule": "OneCycleLR", "warmup_steps": 10},
            r"training\.warmup_steps: for the built-in schedules",
        ),
    ],
)
def test_a_bad_optimizer_or_schedule_is_refused_naming_the_field(training, message):
    with pytest.raises(ConfigError, match=message):
        load_config({"training": training})


@pytest.mark.parametrize(
    ("training", "message"),
    [
        # What only torch can tell: checked on the client before any worker is used.
        (
            {"optimizer": "adam", "optimizer_kwargs": {"betas": [1.5, 0.9]}},
            r"training\.optimizer_kwargs: adam refuses its arguments: Invalid beta",
        ),
        (
            {"optimizer": "RMSprop", "optimizer_kwargs": {"betas": [0.9, 0.9]}},
            r"training\.optimizer_kwargs: RMSprop takes no argument 'betas'",
        ),
        ({"optimizer": "nosuchpkg.opt:Lion"}, r"training\.optimizer: cannot import module"),
        ({"optimizer": "Rprop", "weight_decay": 0.1}, r"training\.weight_decay: Rprop takes no"),
        (
            {"lr_schedule": "StepLR", "lr_schedule_kwargs": {"step": 3}},
            r"training\.lr_schedule_kwargs: StepLR takes no argument 'step'",
        ),
        ({"lr_schedule": "StepLR"}, r"training\.lr_schedule: StepLR refuses its arguments"),
    ],
)
def test_what_torch_refuses_is_a_config_error_before_launch(training, message):
    config = load_config({"training": training})
    assert not config.training.checked_without_torch
    with pytest.raises(ConfigError, match=message):
        check_model(config, num_classes=10)


def test_the_torch_free_tables_match_torch():
    # The config checks names without importing torch: its tables must say what torch has.
    def subclasses(module, base):
        return {n for n, c in vars(module).items() if isinstance(c, type) and issubclass(c, base)}

    optimizers = subclasses(torch.optim, torch.optim.Optimizer)
    assert set(TORCH_OPTIMIZERS) == optimizers - {"Optimizer", "LBFGS"}
    assert set(OPTIMIZERS.values()) <= set(TORCH_OPTIMIZERS)
    for name, arguments in OPTIMIZER_ARGUMENTS.items():
        takes = set(inspect.signature(getattr(torch.optim, name)).parameters)
        own = {"params", "lr", "weight_decay"} | ({"momentum"} if name == "SGD" else set())
        assert set(arguments) == takes - own, name
    schedules = subclasses(torch.optim.lr_scheduler, torch.optim.lr_scheduler.LRScheduler)
    needs_code = {"LambdaLR", "MultiplicativeLR", "SequentialLR", "ChainedScheduler"}
    bases = {"LRScheduler", "_LRScheduler", "ReduceLROnPlateau"}
    assert set(TORCH_SCHEDULES) == schedules - needs_code - bases


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4), nn.Linear(4, 2))


def _rates(training: dict, *, steps: int, total: int, start: int = 0) -> list[float]:
    """The learning rate of each step from ``start``, as the trainer builds the schedule."""
    config = TrainingConfig(**training)
    optimizer = build_optimizer(config=config, parameters=_model().parameters())
    schedule = build_schedule(optimizer=optimizer, config=config, total_steps=total, step=start)
    rates = []
    for _ in range(start, steps):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()  # no gradients: only the rate moves
        schedule.step()
    return rates


def test_the_schedules_follow_their_closed_forms():
    lr, low, warm, total = 0.1, 0.01, 4, 20

    def after_warmup(step: int, decayed: float) -> float:
        return lr * (step + 1) / warm if step < warm else decayed

    def done(step: int) -> float:
        return (step - warm) / (total - warm)

    cosine = _rates(
        {"lr": lr, "lr_schedule": "cosine", "warmup_steps": warm, "min_lr": low},
        steps=total,
        total=total,
    )
    assert cosine == pytest.approx(
        [
            after_warmup(s, low + (lr - low) * 0.5 * (1 + math.cos(math.pi * done(s))))
            for s in range(total)
        ],
        rel=1e-12,
    )
    assert cosine[warm] == pytest.approx(lr) and min(cosine) > low
    linear = _rates(
        {"lr": lr, "lr_schedule": "linear", "warmup_steps": warm, "min_lr": low},
        steps=total + 3,
        total=total,
    )
    expected = [after_warmup(s, low + (lr - low) * (1 - min(1.0, done(s)))) for s in range(23)]
    assert linear == pytest.approx(expected, rel=1e-12)
    assert linear[-3:] == pytest.approx([low] * 3)  # the floor holds past the end
    step = _rates(
        {"lr": lr, "lr_schedule": "step", "warmup_steps": warm, "lr_step_size": 5, "lr_gamma": 0.5},
        steps=total,
        total=total,
    )
    assert step == pytest.approx(
        [after_warmup(s, lr * 0.5 ** ((s - warm) // 5)) for s in range(total)], rel=1e-12
    )


@pytest.mark.parametrize(
    "training",
    [
        {"lr_schedule": "cosine", "warmup_steps": 3, "min_lr": 0.001},
        # torch's own StepLR computes each rate from the last one: stepped to the start.
        {"lr_schedule": "StepLR", "lr_schedule_kwargs": {"step_size": 3, "gamma": 0.5}},
        {"lr_schedule": "OneCycleLR", "lr_schedule_kwargs": {"max_lr": 0.2}},
    ],
)
def test_a_schedule_built_at_a_resumed_step_continues_the_straight_one(training):
    straight = _rates(training, steps=12, total=12)
    assert len(set(straight)) > 2
    assert _rates(training, steps=12, total=12, start=7) == straight[7:]


def test_weight_decay_spares_biases_and_norms_unless_asked():
    model = _model()
    params = list(model.parameters())
    matrices = [model[0].weight, model[2].weight]

    def groups(**training) -> list[tuple[list[nn.Parameter], float]]:
        optimizer = build_optimizer(config=TrainingConfig(**training), parameters=params)
        return [(g["params"], g["weight_decay"]) for g in optimizer.param_groups]

    spared = [model[0].bias, model[1].weight, model[1].bias, model[2].bias]
    assert groups(optimizer="adamw", weight_decay=0.1) == [(matrices, 0.1), (spared, 0.0)]
    assert groups(optimizer="adamw", weight_decay=0.1, decay_norms_and_biases=True) == [
        (params, 0.1)
    ]
    # Without decay: one group in the parameters' order, SGD with momentum 0.9, as the trainer
    # has always built it (existing runs step the same, bit for bit).
    default = build_optimizer(config=TrainingConfig(), parameters=params)
    assert type(default) is torch.optim.SGD and groups() == [(params, 0.0)]
    assert default.defaults["momentum"] == 0.9 and default.defaults["lr"] == 0.05


# AdamW divides each gradient element by its own root mean square, so an element whose
# gradient is near the rounding of its sum moves by a share of lr either way: its float32 run
# strays from float64 some 100 times as far as SGD's (measured: 1e-5 to 1e-4 of each tensor
# against 1e-7), and the tolerance with it. A weight decay of 1 keeps the planted bug of
# decaying the biases too 20 times past that tolerance (measured: 160 to 230 times float32's
# rounding); 4 steps: 2 of warm-up, 2 of cosine.
ADAMW = {
    "optimizer": "adamw",
    "optimizer_kwargs": {"betas": [0.9, 0.95]},
    "lr": 0.002,
    "weight_decay": 1.0,
    "lr_schedule": "cosine",
    "warmup_steps": 2,
    "min_lr": 0.0002,
    "batch_size": 32,
    "seed": 3,
}
STEPS = 4


@pytest.mark.equivalence
# fsdp: the groups made of DTensor shards (whose ndim is the whole parameter's), and the
# moments saved in shards.
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_adamw_with_warmup_and_cosine_on_two_ranks_matches_one_process_and_resumes_exactly(
    cluster, make_config, tmp_path, strategy
):
    checkpoints = tmp_path / "adamw"
    raw = {
        "name": "adamw",
        "checkpoint": {"directory": str(checkpoints), "every_steps": 2, "keep": 10},
    }
    training = ADAMW | {"max_steps": STEPS, "epochs": 1, "strategy": strategy}
    config = make_config(raw, **training)
    straight = train(config, cluster=cluster, on_event=None)
    assert (straight.strategy, straight.world_size) == (strategy, 2)
    assert straight.history[-1]["step"] == STEPS
    # Held against the one-process reference built by the same builder, and against the same
    # with each planted bug (tests/reference.py): the tolerance is proved tight enough.
    # Not the gradients summed: Adam's step divides the moment by its root mean square, so a
    # factor on every gradient cancels (as clipping by the norm cancels it for SGD); SGD's
    # equivalence tests hold that bug.
    bugs = [b for b in bugs_that_apply(config, world_size=2) if b != GRADIENTS_SUMMED]
    assert_matches_one_process(straight.state_dict, config, world_size=2, steps=STEPS, bugs=bugs)
    # Resumed from the mid-run checkpoint: the same AdamW moments and step counts, and the
    # schedule at the same step, give the straight run's parameters to the last bit.
    saved = list_checkpoints(checkpoints)
    assert [json.loads((p / MANIFEST).read_text())["step"] for p in saved] == [4, 2]
    for file in saved[0].iterdir():
        file.unlink()
    saved[0].rmdir()
    resumed = train(config, cluster=cluster, on_event=None)
    assert_same_parameters(resumed.state_dict, straight.state_dict)
    assert resumed.history[-1]["lr"] == straight.history[-1]["lr"]


def _adamw(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    """ADAMW's optimizer, made in Python: its groups as the config's."""
    decayed = [p for p in params if p.ndim >= 2]
    spared = [p for p in params if p.ndim < 2]
    groups = [{"params": decayed}, {"params": spared, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=0.002, betas=(0.9, 0.95), weight_decay=1.0)


def _cosine(optimizer: torch.optim.Optimizer, total_steps: int) -> LRScheduler:
    """ADAMW's schedule, made in Python."""
    return LambdaLR(optimizer, lr_factor(TrainingConfig(**ADAMW), total_steps))


def test_an_optimizer_and_a_schedule_given_in_python_train_as_the_config_does(cluster, make_config):
    config = make_config({"name": "factories"}, **(ADAMW | {"max_steps": STEPS, "epochs": 1}))
    named = train(config, cluster=cluster, on_event=None)
    given = train(config, optimizer=_adamw, lr_schedule=_cosine, cluster=cluster, on_event=None)
    assert_same_parameters(given.state_dict, named.state_dict)
    assert given.history[-1]["lr"] == named.history[-1]["lr"]
