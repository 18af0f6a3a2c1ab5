"""``pipeline`` and ``model_parallel``: the model cut into stages on several ranks (the runtime:
``workers/strategies/pipeline/schedule.py``).

The ranks form a ``(pp, dp, tp)`` mesh: ``pp`` ranks in a row of stages, ``dp`` replicas of
each stage (FSDP2 shards, DDP copies or both), ``tp`` ranks splitting each stage's layers.
``model_parallel``, the seed article's ModelPart1 -> ModelPart2, is the preset of one
micro-batch and one copy: only one stage works at a time.
"""

from typing import Any

from pydantic import BaseModel, ConfigDict

from workers.spec.layout import ElasticBatch, Layout
from workers.spec.names import MODEL_LAYERS
from workers.spec.plans.base import LayerNames, StrategyPlan, StrategySections, register_plan
from workers.spec.sections import ParallelConfig, PipelineConfig, TrainingConfig


class StagingSettings(BaseModel):
    """What ``pipeline`` and ``model_parallel`` are given (their plan's ``settings``): the
    ``[pipeline]`` section, with its split points resolved by the client so that every rank
    cuts alike, and the model's tensor-parallel plan, which splits each stage's layers where
    ``parallel.tp > 1``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    pipeline: PipelineConfig = PipelineConfig()
    tp_plan: str | None = None


@register_plan
class PipelinePlan(StrategyPlan):
    """Rows of stages, each stage held by replicas; micro-batches overlap the stages."""

    name = "pipeline"
    runtime = "workers.strategies.pipeline.schedule"
    staged = True
    splits_layers = True

    def micro_batches(self, pipeline: PipelineConfig) -> int:
        """Forward passes per rank and step."""
        return pipeline.n_microbatches

    def schedule(self, pipeline: PipelineConfig) -> str:
        """The schedule that runs the stages."""
        return pipeline.schedule

    def defaults(self, raw: dict[str, Any]) -> dict[str, Any]:
        # Stages exchange fixed-shape buffers: drop the last partial batch unless the user
        # says otherwise (which check then refuses, by name).
        data = raw.get("data") or {}
        if isinstance(data, dict) and "drop_last" not in data:
            return {**raw, "data": {**data, "drop_last": True}}
        return raw

    def settings(self, sections: StrategySections) -> StagingSettings:
        return StagingSettings(pipeline=sections.pipeline, tp_plan=sections.model.resolved_tp_plan)

    def check(
        self,
        sections: StrategySections,
        world_size: int | None,
        *,
        layer_names: LayerNames | None = None,
    ) -> None:
        t, p, strategy = sections.training, sections.pipeline, self.name
        if not sections.data.drop_last:
            raise ValueError(
                f"data.drop_last: {strategy} needs every batch the same shape; set "
                "drop_last = true (the last partial batch of an epoch is left out)"
            )
        if t.grad_accum_steps > 1:
            raise ValueError(
                f"training.grad_accum_steps: {strategy} accumulates over "
                "pipeline.n_microbatches already; set grad_accum_steps = 1"
            )
        self.refuse_fp16(t)
        self.check_tp_plan(sections)
        self.check_copies(p, sections.parallel)
        model = sections.model
        layers = MODEL_LAYERS.get(model.name)
        names = list(layers) if layers is not None else layer_names() if layer_names else None
        if layers is not None and p.split_points is not None:
            unknown = [point for point in p.split_points if point not in names]
            if unknown:
                # The config cannot know of a model given to train(model=...): say so where
                # the model is the default one, which such a config leaves as it is.
                given = "name" in model.model_fields_set
                raise ValueError(
                    f"pipeline.split_points: {unknown} name no top-level module of "
                    f"{model.name}; its modules are {names}"
                    + (
                        ""
                        if given
                        else " (a model given as train(model=...) is checked when it is cut: "
                        "leave split_points to the planner)"
                    )
                )
        if world_size is None:
            return
        layout = self.layout(sections, world_size)
        if names is not None and layout.n_stages > len(names):
            field, fewer = (
                ("parallel.pp", "lower parallel.pp")
                if sections.parallel.pp is not None
                else ("pipeline", "use fewer workers")
            )
            raise ValueError(
                f"{field}: {layout.pp} ranks x {layout.stages_per_rank} stages per rank need "
                f"at least {layout.n_stages} layers, and {model.name} has {len(names)}; "
                f"{fewer} or stages_per_rank"
            )

    def check_copies(self, pipeline: PipelineConfig, parallel: ParallelConfig) -> None:
        """Refuse replicas or interleaving that this strategy does not run, before any world
        size (a pipeline runs both)."""

    def layout(
        self, sections: StrategySections, world_size: int, *, elastic: ElasticBatch = None
    ) -> Layout:
        # Stages are laid out once: no elastic world (StrategyPlan.elastic is False).
        layout = super().layout(sections, world_size)
        points = sections.pipeline.split_points
        if points is not None and len(points) + 1 != layout.n_stages:
            raise ValueError(
                f"pipeline.split_points: {len(points)} points make {len(points) + 1} stages, "
                f"but {world_size} workers as pp={layout.pp} x dp={layout.dp} with "
                f"{layout.stages_per_rank} stage(s) per rank hold {layout.n_stages}; "
                "change split_points or launch.world_size"
            )
        schedule = self.schedule(sections.pipeline)
        if schedule == "1f1b" and 1 < layout.n_microbatches < layout.pp:
            # torch's Schedule1F1B refuses it on the ranks: say so before they start.
            raise ValueError(
                f"pipeline.n_microbatches: schedule '1f1b' runs at least as many micro-batches "
                f"as pipeline ranks (pp = {layout.pp}), got {layout.n_microbatches}; raise "
                "n_microbatches or set pipeline.schedule = 'gpipe'"
            )
        return layout

    def degrees(
        self,
        training: TrainingConfig,
        pipeline: PipelineConfig,
        *,
        world_size: int,
        parallel: ParallelConfig | None = None,
        elastic: ElasticBatch = None,
    ) -> Layout:
        batch = training.batch_size
        tp = self.tp_degree(parallel, world_size=world_size)
        # The tp ranks of each stage's replica split its layers: the stages and their
        # replicas share what is left.
        pp, dp, shard = _stage_degrees(pipeline, parallel, world_size=world_size, tp=tp)
        self.check_stage_degrees(pp, dp, parallel, world_size=world_size, tp=tp)
        m = self.micro_batches(pipeline)
        if batch % (dp * m):
            replicas = "pipeline.dp" if parallel is None or not parallel.given else "replicas"
            raise ValueError(
                f"training.batch_size: {batch} must be a multiple of {replicas} x "
                f"pipeline.n_microbatches = {dp} x {m}, so every micro-batch has the same shape"
            )
        return Layout(
            world_size=world_size,
            pp=pp,
            dp=dp,
            batch_size=batch,
            n_microbatches=m,
            stages_per_rank=pipeline.stages_per_rank,
            dp_shard=shard,
            tp=tp,
        )

    def check_stage_degrees(
        self, pp: int, dp: int, parallel: ParallelConfig | None, *, world_size: int, tp: int
    ) -> None:
        """Refuse ``pp`` ranks per row and ``dp`` replicas that this strategy does not run (a
        pipeline runs any)."""


@register_plan
class ModelParallelPlan(PipelinePlan):
    """One copy of the model, one stage per rank, one micro-batch: a pipeline in which only
    one stage works at a time, so its schedule is plain GPipe."""

    name = "model_parallel"

    def micro_batches(self, pipeline: PipelineConfig) -> int:
        return 1

    def schedule(self, pipeline: PipelineConfig) -> str:
        return "gpipe"

    def check_copies(self, pipeline: PipelineConfig, parallel: ParallelConfig) -> None:
        replicas = given_stage_replicas(pipeline, parallel)
        if (replicas or 1) > 1 or pipeline.stages_per_rank > 1:
            field = "pipeline.dp" if pipeline.dp > 1 or pipeline.stages_per_rank > 1 else "parallel"
            raise ValueError(
                f"{field}: model_parallel runs one copy of the model, one stage per rank; "
                "for replicas or interleaving use strategy = 'pipeline'"
            )

    def check_stage_degrees(
        self, pp: int, dp: int, parallel: ParallelConfig | None, *, world_size: int, tp: int
    ) -> None:
        if pp < 2:
            raise ValueError(
                "launch.world_size: model_parallel needs at least 2 workers to hold 2 stages"
            )
        if dp > 1:
            field = "parallel.pp" if parallel is not None and parallel.pp else "pipeline.dp"
            raise ValueError(
                f"{field}: model_parallel runs one copy of the model, one stage per rank, and "
                f"{pp} stages on {world_size // tp} ranks leave {dp} copies; set parallel.pp = "
                f"{world_size // tp}, or use strategy = 'pipeline' for replicas"
            )


def _stage_degrees(
    pipeline: PipelineConfig, parallel: ParallelConfig | None, *, world_size: int, tp: int = 1
) -> tuple[int, int, int]:
    """A staged run's ranks per row of stages (``pp``), its replicas of each stage, and how many
    of those FSDP2 shards each copy over (``dp_shard``: 1 where DDP averages whole copies; the
    replicas itself where they are all shards of one; between, HSDP's replicas of shards), on
    the ``world_size / tp`` ranks that ``tp`` leaves (each of them ``tp`` ranks splitting its
    stages' layers)."""
    whole = f"the world size {world_size}"
    if tp > 1:
        whole = f"world size / tp = {world_size} / {tp}"
        world_size //= tp
    given_pp = parallel.pp if parallel is not None else None
    shard = parallel.dp_shard if parallel is not None else None
    replicate = parallel.dp_replicate if parallel is not None else None
    given = given_stage_replicas(pipeline, parallel)
    if parallel is not None and parallel.given:
        if pipeline.dp > 1:
            raise ValueError(
                "pipeline.dp: the stages' replicas are given once; parallel.dp_shard (FSDP2) "
                "or parallel.dp_replicate (DDP) replaces pipeline.dp and pipeline.dp_mode"
            )
        # Shards (FSDP2), copies of shards (HSDP) or whole copies (DDP, dp_shard unset).
        sharded = replicate in (None, 1) or (shard or 1) > 1
        dp, field = given, "parallel.dp_shard" if sharded else "parallel.dp_replicate"
    elif given is None:  # parallel.pp alone: the replicas are what the world leaves
        if world_size % given_pp:
            raise ValueError(f"parallel.pp: {given_pp} does not divide {whole}")
        dp, sharded, field = world_size // given_pp, pipeline.dp_mode == "fsdp", "parallel.pp"
    else:
        dp, sharded, field = given, pipeline.dp_mode == "fsdp", "pipeline.dp"
    if given_pp is not None and given_pp * dp != world_size:
        raise ValueError(f"parallel: pp x replicas = {given_pp} x {dp} must equal {whole}")
    if world_size % dp:
        raise ValueError(
            f"{field}: {world_size} {'workers' if tp == 1 else 'ranks of world size / tp'} do "
            f"not split into replicas of {dp}; pp x dp{' x tp' if tp > 1 else ''} must equal "
            f"the worker count (set launch.world_size to a multiple of {dp * tp})"
        )
    if dp > 1 and not sharded:
        if tp > 1:
            raise ValueError(
                f"{field}: DDP does not average stages whose layers parallel.tp splits; give "
                "the replicas as parallel.dp_shard (FSDP2)"
            )
        pipeline.check_ddp_stages(field, "use parallel.dp_shard")
    if not sharded:
        return world_size // dp, dp, 1
    return world_size // dp, dp, dp // (replicate or 1)


def given_stage_replicas(pipeline: PipelineConfig, parallel: ParallelConfig | None) -> int | None:
    """A staged run's replicas of each stage as its config gives them, before any world size:
    ``parallel.dp_replicate x dp_shard``, else ``pipeline.dp``; None where ``parallel.pp``
    alone leaves them to the world size."""
    if parallel is not None and parallel.given:
        return (parallel.dp_replicate or 1) * (parallel.dp_shard or 1)
    if parallel is not None and parallel.pp is not None:
        return None
    return pipeline.dp
