"""Each strategy's torch-free plan, by name: the settings its runtime is given, the checks its
config sections must pass, and how a world of ranks divides the work.

A strategy family is a module here (``ddp``, ``data_parallel``, ``fsdp`` with its preset
``hsdp``, ``pipeline`` with ``model_parallel``) that registers its plans; its runtime, the
:class:`~workers.strategies.base.Strategy` that imports torch, is the module its plan names in
``runtime`` (``workers/strategies/<family>/``). Adding a strategy means adding its name to
``STRATEGIES`` (``workers/spec/names.py``), a plan module here and a runtime module there; a
test checks that every name has both. A parallelism that composes into strategies rather than
being one (``tensor_parallel``, which the sharded and staged strategies apply) registers
nothing.
"""

import importlib
import pkgutil

from workers.spec.names import STRATEGIES
from workers.spec.plans.base import PLANS, StrategyPlan, StrategySections

__all__ = ["StrategyPlan", "StrategySections", "get_plan", "registered_plans"]


def get_plan(name: str) -> StrategyPlan:
    """The plan of the strategy called ``name``."""
    if name not in STRATEGIES:
        raise ValueError(
            f"training.strategy: unknown strategy {name!r}; choose one of {STRATEGIES}"
        )
    if name not in PLANS:
        # The families are torch-free and small: import them all rather than keep a second
        # table of which module holds which name.
        for family in pkgutil.iter_modules(__path__):
            if family.name != "base":
                importlib.import_module(f"{__name__}.{family.name}")
    if name not in PLANS:
        raise LookupError(
            f"strategy {name!r} has no plan: add a module workers/spec/plans/<family>.py that "
            "registers one"
        )
    return PLANS[name]


def registered_plans() -> dict[str, StrategyPlan]:
    """The plans registered so far, by name."""
    return dict(PLANS)
