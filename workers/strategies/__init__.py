"""The strategies by name, and each one's torch-free :class:`StrategyPlan`.

A strategy family is a package ``workers/strategies/<family>/``: its ``__init__.py`` holds the
plan (settings, config checks, mesh degrees; torch-free, so that a config validates without
torch) and registers it with :func:`register_plan`; a submodule holds its runtime, the
:class:`~workers.strategies.base.Strategy` that imports torch. Adding a strategy means adding
such a package and its name to :data:`STRATEGIES`; a test checks that every name has both. A
preset of another strategy (``hsdp`` of ``fsdp``, ``model_parallel`` of ``pipeline``) lives in
that strategy's package. A parallelism that composes into strategies rather than being one
(``tensor_parallel``, which the sharded and staged strategies apply) registers nothing.

This file imports no family: :func:`get_plan` imports them on first use.
"""

import importlib
import pkgutil
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import BaseModel

from workers.layout import ElasticBatch, Layout

if TYPE_CHECKING:
    from workers.config_models import ParallelConfig, TrainingConfig
    from workers.strategies.pipeline import PipelineConfig
    from workflows.config import RunConfig

STRATEGIES = ("ddp", "data_parallel", "model_parallel", "pipeline", "fsdp", "hsdp")


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

    def settings(self, config: "RunConfig") -> BaseModel | None:
        """What the runtime's ``prepare`` is given (None: it takes nothing)."""
        return None

    def world_size(self, given: int | None) -> int | None:
        """The ranks a run has where ``launch.world_size`` (or the cluster's workers) is
        ``given``; None where the cluster decides."""
        return given

    def check(self, config: "RunConfig", world_size: int | None) -> None:
        """Refuse, with a ``ValueError`` naming the field, a config this strategy cannot run
        on ``world_size`` ranks (None: not known yet; the driver's ``resolve_run`` checks the
        layout once the cluster's size is known, and a staged run's cut is checked when it is
        planned)."""
        config.layout(world_size or 1)

    def layout(
        self, config: "RunConfig", world_size: int, *, elastic: ElasticBatch = None
    ) -> Layout:
        """How ``world_size`` ranks share ``config``'s model and batch; a ``ValueError``
        naming the field where they cannot. ``elastic``: one world of an elastic job's range,
        whose replicas may hold shares that differ by a row."""
        return self.degrees(
            config.training,
            config.pipeline,
            world_size=world_size,
            parallel=config.parallel,
            elastic=elastic,
        )

    def degrees(
        self,
        training: "TrainingConfig",
        pipeline: "PipelineConfig",
        *,
        world_size: int,
        parallel: "ParallelConfig | None" = None,
        elastic: ElasticBatch = None,
    ) -> Layout:
        """The layout of this strategy on ``world_size`` ranks, from the sections alone; a
        ``ValueError`` naming the config field where they cannot share the work."""
        strategy, batch = self.name, training.batch_size
        tp = self.tp_degree(parallel, world_size=world_size)
        if parallel is not None and (parallel.pp or 1) > 1:
            raise ValueError(
                f"parallel.pp: {strategy} keeps the whole model on every rank; stages are "
                "strategy = 'pipeline' or 'model_parallel'"
            )
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

    def refuse_fp16(self, config: "RunConfig") -> None:
        """For strategies without loss scaling: fp16 gradients would underflow unscaled."""
        if config.training.precision == "fp16":
            raise ValueError(
                f"training.precision: {self.name} has no loss scaling for fp16; use 'bf16'"
            )

    def check_tp_plan(self, config: "RunConfig") -> None:
        """Refuse ``parallel.tp > 1`` without the model's tensor-parallel plan (for plans that
        split layers)."""
        tp = config.parallel.tp
        if tp > 1 and config.model.resolved_tp_plan is None:
            raise ValueError(
                f"model.tp_plan: parallel.tp = {tp} splits the model's layers by its "
                "tensor-parallel plan; set model.tp_plan = 'package.module:plan' (plan(model, "
                "mesh) returns it), or parallel.tp = 1"
            )

    def tp_degree(self, parallel: "ParallelConfig | None", *, world_size: int) -> int:
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

    def shard_degree(self, parallel: "ParallelConfig | None", *, world_size: int) -> int:
        """How many of ``world_size`` data-parallel ranks one copy of the model is sharded
        over: 1, every rank holds a whole copy."""
        if parallel is not None and parallel.given:
            raise ValueError(
                f"parallel: {self.name} replicates the whole model on every rank; the "
                "dp_replicate and dp_shard degrees are for strategy = 'fsdp' or 'hsdp'"
            )
        return 1


_PLANS: dict[str, StrategyPlan] = {}


def register_plan(cls: type[StrategyPlan]) -> type[StrategyPlan]:
    """Class decorator: make an instance of ``cls`` the plan of the strategy ``cls.name``."""
    if cls.name not in STRATEGIES:
        raise ValueError(
            f"strategy {cls.name!r}: add its name to STRATEGIES in workers/strategies/__init__.py"
        )
    _PLANS[cls.name] = cls()
    return cls


def get_plan(name: str) -> StrategyPlan:
    """The plan of the strategy called ``name``."""
    if name not in STRATEGIES:
        raise ValueError(
            f"training.strategy: unknown strategy {name!r}; choose one of {STRATEGIES}"
        )
    if name not in _PLANS:
        # The families are torch-free and small: import them all rather than keep a second
        # table of which package holds which name.
        for family in pkgutil.iter_modules(__path__):
            if family.ispkg:
                importlib.import_module(f"{__name__}.{family.name}")
    if name not in _PLANS:
        raise LookupError(
            f"strategy {name!r} has no plan: add a package workers/strategies/<family>/ whose "
            "__init__.py registers one"
        )
    return _PLANS[name]


def registered_plans() -> dict[str, StrategyPlan]:
    """The plans registered so far, by name."""
    return dict(_PLANS)
