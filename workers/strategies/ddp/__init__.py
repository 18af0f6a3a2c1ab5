"""``ddp``: every rank trains the whole model on its share of the batch, and
``DistributedDataParallel`` averages the gradients (the runtime: :mod:`.replicas`).

Its plan is the default one: whole copies on every rank, no settings, no tensor parallelism.
"""

from workers.strategies import StrategyPlan, register_plan


@register_plan
class DDPPlan(StrategyPlan):
    name = "ddp"
    elastic = True
    replicated = True
    runtime = f"{__name__}.replicas"
