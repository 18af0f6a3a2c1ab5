"""``fsdp`` and ``hsdp``: sharded data parallelism with FSDP2 (the runtime:
``workers/strategies/fsdp/sharding.py``).

``fsdp`` shards one copy of the model over every data-parallel rank; ``hsdp``, its preset,
shards within groups of ``parallel.dp_shard`` ranks (a host's GPUs) and replicates across the
``parallel.dp_replicate`` groups. Both apply tensor parallelism first where ``parallel.tp > 1``.
"""

from pydantic import BaseModel, ConfigDict

from workers.spec.plans.base import LayerNames, StrategyPlan, StrategySections, register_plan
from workers.spec.sections import FSDPConfig, ParallelConfig

HSDP_NEEDS_A_DEGREE = (
    "parallel.dp_shard: hsdp needs the ranks one copy is sharded over (e.g. the GPUs of one "
    "host), or parallel.dp_replicate"
)


class ShardingSettings(BaseModel):
    """What ``fsdp`` and ``hsdp`` are given (their plan's ``settings``): the ``[fsdp]`` section
    and the model's tensor-parallel plan."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    fsdp: FSDPConfig = FSDPConfig()
    tp_plan: str | None = None


@register_plan
class FSDPPlan(StrategyPlan):
    """One copy of the model, sharded over all the data-parallel ranks."""

    name = "fsdp"
    runtime = "workers.strategies.fsdp.sharding"
    splits_layers = True
    elastic = True  # resharded through a checkpoint at the resize's step boundary

    def settings(self, sections: StrategySections) -> ShardingSettings:
        return ShardingSettings(fsdp=sections.fsdp, tp_plan=sections.model.resolved_tp_plan)

    def check(
        self,
        sections: StrategySections,
        world_size: int | None,
        *,
        layer_names: LayerNames | None = None,
    ) -> None:
        parallel = sections.parallel
        self.refuse_fp16(sections.training)
        self.check_tp_plan(sections)
        if world_size is None and parallel.dp_replicate and parallel.dp_shard:
            world_size = parallel.dp_replicate * parallel.dp_shard * parallel.tp
        super().check(sections, world_size)

    def check_device(self, sections: StrategySections, *, kind: str) -> None:
        if sections.fsdp.cpu_offload and kind == "cpu":
            raise ValueError(
                "fsdp.cpu_offload: a CPU cluster's shards are in host memory already; set "
                "cpu_offload = false (it moves a GPU's shards to the host)"
            )

    def check_without_world(self, sections: StrategySections) -> None:
        """What can be refused before the world size is known (fsdp shards over whatever
        it is)."""
        self.refuse_stages(sections.parallel)

    def shard_degree(self, parallel: ParallelConfig | None, *, world_size: int) -> int:
        replicate = parallel.dp_replicate if parallel is not None else None
        shard = parallel.dp_shard if parallel is not None else None
        if (replicate or 1) != 1 or shard not in (None, world_size):
            raise ValueError(
                f"parallel: fsdp shards over all {world_size} ranks (dp_replicate = 1, "
                f"dp_shard = {world_size}); for replicas of shards use strategy = 'hsdp'"
            )
        return world_size


@register_plan
class HSDPPlan(FSDPPlan):
    """Copies of the model (``parallel.dp_replicate``), each sharded over ``parallel.dp_shard``
    ranks; one of the two given, the other what the world size leaves."""

    name = "hsdp"

    def check_without_world(self, sections: StrategySections) -> None:
        super().check_without_world(sections)
        if not sections.parallel.given:
            raise ValueError(HSDP_NEEDS_A_DEGREE)

    def shard_degree(self, parallel: ParallelConfig | None, *, world_size: int) -> int:
        replicate = parallel.dp_replicate if parallel is not None else None
        shard = parallel.dp_shard if parallel is not None else None
        if replicate is None and shard is None:
            raise ValueError(HSDP_NEEDS_A_DEGREE)
        for name, degree in (("dp_replicate", replicate), ("dp_shard", shard)):
            if degree is not None and world_size % degree:
                raise ValueError(
                    f"parallel.{name}: {degree} does not divide the world size {world_size}"
                )
        replicate = replicate if replicate is not None else world_size // shard
        shard = shard if shard is not None else world_size // replicate
        if replicate * shard != world_size:
            raise ValueError(
                f"parallel: dp_replicate x dp_shard = {replicate} x {shard} must equal the "
                f"world size {world_size}"
            )
        return shard
