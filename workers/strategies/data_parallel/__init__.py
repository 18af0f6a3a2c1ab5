"""``data_parallel``: the seed article's first example, ``nn.DataParallel`` over the GPUs of
one worker (the runtime: :mod:`.local_gpus`). The run is one rank, whatever the cluster."""

from typing import TYPE_CHECKING

from workers.strategies import StrategyPlan, register_plan

if TYPE_CHECKING:
    from workflows.config import RunConfig


@register_plan
class DataParallelPlan(StrategyPlan):
    name = "data_parallel"
    runtime = f"{__name__}.local_gpus"

    def world_size(self, given: int | None) -> int | None:
        return 1

    def check(self, config: "RunConfig", world_size: int | None) -> None:
        if config.launch.world_size not in (None, 1):
            raise ValueError(
                "launch.world_size: data_parallel runs in one worker (over the GPUs it sees); "
                "set world_size = 1, or use strategy = 'ddp'"
            )
        super().check(config, world_size)
