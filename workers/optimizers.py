"""The built-in trainer's optimizer and learning-rate schedule, from ``training``'s settings.

:func:`build_optimizer` makes the optimizer over a strategy's parameters (DTensor shards under
FSDP and TP: their ``ndim`` is the whole parameter's), :func:`build_schedule` its schedule at
the step a run starts from; ``workers/train.py`` loads a checkpoint into the optimizer between
the two. :func:`check` builds both once on stand-in parameters, so that what only torch can
check (a class's arguments, their values) is a config error on the client before any worker
is used; the names and the built-in classes' argument names are checked without torch, by the
config itself (``workers/spec/sections.py``). The one-process reference of the equivalence tests
(tests/reference.py) builds with the same two functions, so the two cannot drift apart.
"""

import inspect
import math
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR, LRScheduler

from workers.model_sources import ModelError, import_object
from workers.spec.sections import TrainingConfig

# train(config, optimizer=...): called with the model's parameters (a list, in the
# strategy's order); the factory makes its own groups and hyperparameters.
OptimizerFactory = Callable[[list[nn.Parameter]], Optimizer]
# train(config, lr_schedule=...): called with the optimizer and the run's total steps.
ScheduleFactory = Callable[[Optimizer, int], LRScheduler]


class OptimizerError(ValueError):
    """An optimizer or schedule that cannot be built as configured; the message names the
    field."""


def build_optimizer(
    *,
    config: TrainingConfig,
    parameters: Iterable[nn.Parameter],
    factory: OptimizerFactory | None = None,
) -> Optimizer:
    """``config.optimizer`` over ``parameters`` at ``config.lr``, weight decay on those of 2
    or more dimensions only (unless ``config.decay_norms_and_biases``); ``factory``: an
    optimizer given in Python instead, called with the parameters."""
    params = list(parameters)
    if factory is not None:
        return _an_optimizer(factory(params), f"the optimizer factory {_label(factory)}")
    name = config.optimizer_class
    build = _optimizer_class(name)
    takes, more = _arguments(build)
    arguments: dict[str, Any] = {"lr": config.lr}
    if name == "SGD":
        arguments["momentum"] = config.momentum
    if config.weight_decay:
        if not more and "weight_decay" not in takes:
            raise OptimizerError(
                f"training.weight_decay: {config.optimizer} takes no weight decay; set it to 0"
            )
        arguments["weight_decay"] = config.weight_decay
    unknown = sorted(set(config.optimizer_kwargs) - takes) if not more else []
    if unknown:
        raise OptimizerError(
            f"training.optimizer_kwargs: {config.optimizer} takes no argument {unknown[0]!r}; "
            f"it takes {sorted(takes - {'params', 'lr', 'weight_decay'})}"
        )
    try:
        optimizer = build(_groups(params, config), **arguments, **config.optimizer_kwargs)
    except (TypeError, ValueError, RuntimeError) as error:
        field = "training.optimizer_kwargs" if config.optimizer_kwargs else "training.optimizer"
        raise OptimizerError(
            f"{field}: {config.optimizer} refuses its arguments: {error}"
        ) from None
    return _an_optimizer(optimizer, f"training.optimizer: {config.optimizer}")


def build_schedule(
    *,
    optimizer: Optimizer,
    config: TrainingConfig,
    total_steps: int,
    step: int = 0,
    factory: ScheduleFactory | None = None,
) -> LRScheduler:
    """``config.lr_schedule`` (after its warm-up) over ``total_steps``, at ``step``: a resumed
    run continues the schedule where the straight run would be. ``factory``: a schedule given
    in Python instead, called with the optimizer and ``total_steps``."""
    if factory is None and config.builtin_schedule:
        # last_epoch puts the schedule at the resumed step; it scales each group's
        # initial_lr, which a group kept by live recovery already has.
        for group in optimizer.param_groups:
            group.setdefault("initial_lr", group["lr"])
        return LambdaLR(optimizer, lr_factor(config, total_steps), last_epoch=step - 1)
    # Any other schedule starts from the groups' initial rates (a group kept by live recovery
    # holds the rate of its step) and is stepped to ``step``: exact for every schedule that
    # depends on the step count alone, which torch's own chained formulas (StepLR's) are
    # only when stepped one by one from the start.
    for group in optimizer.param_groups:
        group["lr"] = group.setdefault("initial_lr", group["lr"])
    if factory is not None:
        schedule = factory(optimizer, total_steps)
        label = f"the lr_schedule factory {_label(factory)}"
    else:
        schedule, label = _named_schedule(optimizer, config, total_steps), "training.lr_schedule"
    if not isinstance(schedule, LRScheduler):
        raise OptimizerError(f"{label} gave a {type(schedule).__name__}, not an LRScheduler")
    with warnings.catch_warnings():
        # Stepped before any optimizer step on purpose: that is where the run's steps were.
        warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step")
        for _ in range(step):
            schedule.step()
    return schedule


def lr_factor(config: TrainingConfig, total_steps: int) -> Callable[[int], float]:
    """The built-in schedules: the learning rate at a step, as a factor of ``config.lr``."""
    floor = config.min_lr / config.lr
    warmup = config.warmup_steps

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        # The share of the decay done: 0 just after the warm-up, 1 at the last step.
        done = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        if config.lr_schedule == "cosine":
            return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * done))
        if config.lr_schedule == "linear":
            return floor + (1 - floor) * (1 - done)
        if config.lr_schedule == "step":
            assert config.lr_step_size is not None  # the config requires it
            return config.lr_gamma ** ((step - warmup) // config.lr_step_size)
        return 1.0

    return factor


def check(config: TrainingConfig) -> None:
    """Build ``config``'s optimizer and schedule once on stand-in parameters (a matrix and a
    bias): an :class:`OptimizerError` naming the field where a class cannot be imported or
    refuses its arguments."""
    stand_in = [nn.Parameter(torch.zeros(2, 2)), nn.Parameter(torch.zeros(2))]
    optimizer = build_optimizer(config=config, parameters=stand_in)
    build_schedule(optimizer=optimizer, config=config, total_steps=100)


def _groups(params: list[nn.Parameter], config: TrainingConfig) -> list[Any]:
    """The parameters, or two groups: decayed, and not (biases and norms' scales, of fewer
    than 2 dimensions), as nanoGPT and torchtitan decay. Without decay, one list in the
    strategy's order, as the optimizer has always been built."""
    if not config.weight_decay or config.decay_norms_and_biases:
        return params
    decayed = [p for p in params if p.ndim >= 2]
    kept = [p for p in params if p.ndim < 2]
    groups = [{"params": decayed}, {"params": kept, "weight_decay": 0.0}]
    return [group for group in groups if group["params"]]


def _optimizer_class(name: str) -> Callable[..., Any]:
    if ":" in name:
        try:
            return import_object(name, field="training.optimizer")
        except ModelError as error:
            raise OptimizerError(str(error)) from None
    found = getattr(torch.optim, name, None)
    if not (isinstance(found, type) and issubclass(found, Optimizer)):
        raise OptimizerError(f"training.optimizer: torch.optim has no optimizer {name!r}")
    return found


def _named_schedule(optimizer: Optimizer, config: TrainingConfig, total_steps: int) -> Any:
    name = config.lr_schedule
    if ":" in name:
        try:
            build = import_object(name, field="training.lr_schedule")
        except ModelError as error:
            raise OptimizerError(str(error)) from None
    else:
        build = getattr(torch.optim.lr_scheduler, name, None)
        if build is None:
            raise OptimizerError(f"training.lr_schedule: torch has no schedule {name!r}")
    arguments = dict(config.lr_schedule_kwargs)
    takes, more = _arguments(build)
    if "last_epoch" in arguments:
        raise OptimizerError(
            "training.lr_schedule_kwargs: last_epoch is the run's (a resumed run sets it)"
        )
    unknown = sorted(set(arguments) - takes) if not more else []
    if unknown:
        raise OptimizerError(
            f"training.lr_schedule_kwargs: {name} takes no argument {unknown[0]!r}; it "
            f"takes {sorted(takes - {'optimizer', 'last_epoch'})}"
        )
    if "total_steps" in takes and not {"total_steps", "epochs"} & set(arguments):
        arguments["total_steps"] = total_steps  # OneCycleLR's: the run's, unless given
    try:
        return build(optimizer, **arguments)
    except (TypeError, ValueError) as error:
        field = (
            "training.lr_schedule_kwargs" if config.lr_schedule_kwargs else "training.lr_schedule"
        )
        raise OptimizerError(f"{field}: {name} refuses its arguments: {error}") from None


def _arguments(build: Callable[..., Any]) -> tuple[set[str], bool]:
    """The keyword arguments ``build`` takes, and whether it takes any (``**kwargs``)."""
    try:
        signature = inspect.signature(build)
    except (TypeError, ValueError):
        return set(), True
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    names = {p.name for p in signature.parameters.values() if p.kind in kinds}
    more = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values())
    return names, more


def _an_optimizer(made: Any, label: str) -> Optimizer:
    if not isinstance(made, Optimizer):
        raise OptimizerError(f"{label} gave a {type(made).__name__}, not a torch.optim.Optimizer")
    return made


def _label(factory: Callable[..., Any]) -> str:
    return getattr(factory, "__qualname__", None) or repr(factory)
