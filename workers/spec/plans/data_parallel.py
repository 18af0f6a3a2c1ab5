"""``data_parallel``: the seed article's first example, ``nn.DataParallel`` over the GPUs of
one worker (the runtime: ``workers/strategies/data_parallel/local_gpus.py``). The run is one
rank, whatever the cluster."""

from workers.spec.plans.base import StrategyPlan, register_plan


@register_plan
class DataParallelPlan(StrategyPlan):
    name = "data_parallel"
    runtime = "workers.strategies.data_parallel.local_gpus"

    def world_size(self, given: int | None) -> int | None:
        return 1

    def check_given_world(self, given: int | None) -> None:
        if given not in (None, 1):
            raise ValueError(
                "launch.world_size: data_parallel runs in one worker (over the GPUs it sees); "
                "set world_size = 1, or use strategy = 'ddp'"
            )
