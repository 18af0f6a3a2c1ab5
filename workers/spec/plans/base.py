"""What every strategy's plan is: :class:`StrategyPlan`, the sections it reads
(:class:`StrategySections`), and the registry its families add themselves to
(:func:`register_plan`; :func:`workers.spec.plans.get_plan` finds them)."""

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, ClassVar

from pydantic import BaseModel

from workers.spec.layout import ElasticBatch, Layout
from workers.spec.names import STRATEGIES
from workers.spec.sections import (
    DataConfig,
    FSDPConfig,
    ModelConfig,
    ParallelConfig,
    PipelineConfig,
    TrainingConfig,
)

# The names of the points a model can be cut at into stages, asked only when a plan needs them
# (it builds the model, which imports torch: the client passes workers.stage_cuts's).
LayerNames = Callable[[], list[str]]


@dataclass(frozen=True)
class StrategySections:
    """The sections of a run's config that strategies read: a plan is given these, never the
    whole config, whose cluster, launch and tracking sections are the client's."""

    data: DataConfig
    model: ModelConfig
    training: TrainingConfig
    pipeline: PipelineConfig
    parallel: ParallelConfig
    fsdp: FSDPConfig

    def with_batch(self, batch_size: int) -> "StrategySections":
        """These sections with ``training.batch_size`` = ``batch_size`` (one world of an
        elastic range whose each rank keeps its batch)."""
        return replace(self, training=self.training.model_copy(update={"batch_size": batch_size}))


class StrategyPlan:
    """What one strategy decides before any rank starts: the settings its runtime is given,
    the checks its config must pass, and how a world of ranks divides the work.

    The defaults are a strategy that keeps the whole model on every rank, takes no settings
    and no tensor parallelism; a family overrides what it does differently.
    """

    name: ClassVar[str]
    runtime: ClassVar[str]  # the module that registers the Strategy of the same name
    staged: ClassVar[bool] = False  # cuts the model into stages on several ranks
    splits_layers: ClassVar[bool] = False  # composes with tensor parallelism (parallel.tp)
    # Runs on a world that changes between steps (launch.world_size = "min:max"): every rank
    # holds the whole state, so a live one hands it to the new world (replicated), or the
    # ranks' shards go to the new world through a checkpoint written at the step boundary.
    elastic: ClassVar[bool] = False
    replicated: ClassVar[bool] = False

    def defaults(self, raw: dict[str, Any]) -> dict[str, Any]:
        """``raw``, a config's sections before validation, with what this strategy assumes
        unless the config says otherwise."""
        return raw

    def settings(self, sections: StrategySections) -> BaseModel | None:
        """What the runtime's ``prepare`` is given (None: it takes nothing)."""
        return None

    def world_size(self, given: int | None) -> int | None:
        """The ranks a run has where ``launch.world_size`` (or the cluster's workers) is
        ``given``; None where the cluster decides."""
        return given

    def check_given_world(self, given: int | None) -> None:
        """Refuse a ``launch.world_size`` this strategy cannot take whatever the cluster."""

    def check_device(self, sections: StrategySections, *, kind: str) -> None:
        """Refuse settings this strategy cannot use on a cluster of ``kind`` (``cluster.kind``:
        ``"cpu"``, ``"cuda"`` or ``"auto"``), naming the field."""

    def check(
        self,
        sections: StrategySections,
        world_size: int | None,
        *,
        layer_names: LayerNames | None = None,
    ) -> None:
        """Refuse, with a ``ValueError`` naming the field, sections this strategy cannot run
        on ``world_size`` ranks (None: not known yet; the driver's ``resolve_run`` checks the
        layout once the cluster's size is known, and a staged run's cut is checked when it is
        planned). ``layer_names``: where a staged model can be cut (None: not checked)."""
        if world_size is None:
            self.check_without_world(sections)
        else:
            self.layout(sections, world_size)

    def check_without_world(self, sections: StrategySections) -> None:
        """What can be refused before the world size is known: for a strategy that keeps the
        whole model on every rank, every degree of parallelism it does not take."""
        parallel = sections.parallel
        self.tp_degree(parallel, world_size=parallel.tp)
        self.refuse_stages(parallel)
        self.refuse_shards(parallel)

    def layout(
        self, sections: StrategySections, world_size: int, *, elastic: ElasticBatch = None
    ) -> Layout:
        """How ``world_size`` ranks share the model and batch; a ``ValueError`` naming the
        field where they cannot. ``elastic``: one world of an elastic job's range, whose
        replicas may hold shares that differ by a row."""
        return self.degrees(
            sections.training,
            sections.pipeline,
            world_size=world_size,
            parallel=sections.parallel,
            elastic=elastic,
        )

    def degrees(
        self,
        training: TrainingConfig,
        pipeline: PipelineConfig,
        *,
        world_size: int,
        parallel: ParallelConfig | None = None,
        elastic: ElasticBatch = None,
    ) -> Layout:
        """The layout of this strategy on ``world_size`` ranks, from the sections alone; a
        ``ValueError`` naming the config field where they cannot share the work."""
        batch = training.batch_size
        tp = self.tp_degree(parallel, world_size=world_size)
        self.refuse_stages(parallel)
        dp = world_size // tp
        shard = self.shard_degree(parallel, world_size=dp)
        # Each data-parallel rank reads its own share; the tp ranks of one read the same.
        readers = "world size" if tp == 1 else "data-parallel ranks (world size / tp)"
        if batch < dp:
            raise ValueError(
                f"training.batch_size: {batch} is smaller than the {readers} {dp}; every "
                "rank needs at least one sample per step"
            )
        if not elastic and batch % (dp * training.grad_accum_steps):
            raise ValueError(
                f"training.batch_size: {batch} must be a multiple of {readers} x "
                f"grad_accum_steps = {dp} x {training.grad_accum_steps}"
            )
        return Layout(
            world_size=world_size,
            pp=1,
            dp=dp,
            batch_size=batch,
            n_microbatches=training.grad_accum_steps,
            dp_shard=shard,
            tp=tp,
            elastic=elastic,
        )

    def refuse_fp16(self, training: TrainingConfig) -> None:
        """For strategies without loss scaling: fp16 gradients would underflow unscaled."""
        if training.precision == "fp16":
            raise ValueError(
                f"training.precision: {self.name} has no loss scaling for fp16; use 'bf16'"
            )

    def check_tp_plan(self, sections: StrategySections) -> None:
        """Refuse ``parallel.tp > 1`` without the model's tensor-parallel plan (for plans that
        split layers)."""
        tp = sections.parallel.tp
        if tp > 1 and sections.model.resolved_tp_plan is None:
            raise ValueError(
                f"model.tp_plan: parallel.tp = {tp} splits the model's layers by its "
                "tensor-parallel plan; set model.tp_plan = 'package.module:plan' (plan(model, "
                "mesh) returns it), or parallel.tp = 1"
            )

    def tp_degree(self, parallel: ParallelConfig | None, *, world_size: int) -> int:
        """How many ranks split each layer (``parallel.tp``), checked against this strategy."""
        tp = parallel.tp if parallel is not None else 1
        if tp == 1:
            return 1
        if not self.splits_layers:
            raise ValueError(
                f"parallel.tp: tensor parallelism composes with strategy = 'fsdp' or 'hsdp' "
                f"(with parallel.tp = {world_size} FSDP has one rank and only TP splits), "
                f"'pipeline' or 'model_parallel', not {self.name}"
            )
        if world_size % tp:
            raise ValueError(f"parallel.tp: {tp} does not divide the world size {world_size}")
        return tp

    def shard_degree(self, parallel: ParallelConfig | None, *, world_size: int) -> int:
        """How many of ``world_size`` data-parallel ranks one copy of the model is sharded
        over: 1, every rank holds a whole copy."""
        self.refuse_shards(parallel)
        return 1

    def refuse_stages(self, parallel: ParallelConfig | None) -> None:
        """Refuse ``parallel.pp > 1`` (for plans that keep the whole model on every rank)."""
        if parallel is not None and (parallel.pp or 1) > 1:
            raise ValueError(
                f"parallel.pp: {self.name} keeps the whole model on every rank; stages are "
                "strategy = 'pipeline' or 'model_parallel'"
            )

    def refuse_shards(self, parallel: ParallelConfig | None) -> None:
        """Refuse the data-parallel degrees (for plans that replicate the whole model)."""
        if parallel is not None and parallel.given:
            raise ValueError(
                f"parallel: {self.name} replicates the whole model on every rank; the "
                "dp_replicate and dp_shard degrees are for strategy = 'fsdp' or 'hsdp'"
            )


PLANS: dict[str, StrategyPlan] = {}


def register_plan(cls: type[StrategyPlan]) -> type[StrategyPlan]:
    """Class decorator: make an instance of ``cls`` the plan of the strategy ``cls.name``."""
    if cls.name not in STRATEGIES:
        raise ValueError(
            f"strategy {cls.name!r}: add its name to STRATEGIES in workers/spec/names.py"
        )
    PLANS[cls.name] = cls()
    return cls
