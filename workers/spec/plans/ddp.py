"""``ddp``: every rank trains the whole model on its share of the batch, and
``DistributedDataParallel`` averages the gradients (the runtime:
``workers/strategies/ddp/replicas.py``).

Its plan is the default one: whole copies on every rank, no settings, no tensor parallelism.
"""

from workers.spec.plans.base import StrategyPlan, register_plan


@register_plan
class DDPPlan(StrategyPlan):
    name = "ddp"
    elastic = True
    replicated = True
    runtime = "workers.strategies.ddp.replicas"
