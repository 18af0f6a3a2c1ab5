"""Each strategy's runtime, found by name: the :class:`~workers.strategies.base.Strategy` that
imports torch and runs on a rank. Its torch-free plan, which the client checks and lays out
with, is in ``workers/spec/plans/``, and names the runtime's module (``runtime``): a family's
folder here holds that module (``ddp/replicas.py``, ``fsdp/sharding.py``, ...)."""

import importlib

from workers.spec.plans import get_plan
from workers.strategies.base import REGISTERED, Strategy


def get_strategy(name: str) -> type[Strategy]:
    """The runtime of the strategy called ``name`` (imports torch)."""
    plan = get_plan(name)  # refuses an unknown name
    if name not in REGISTERED:
        importlib.import_module(plan.runtime)
    return REGISTERED[name]


def registered() -> dict[str, type[Strategy]]:
    """The strategies registered so far, by name."""
    return dict(REGISTERED)
