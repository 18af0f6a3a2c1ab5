"""A run's whole configuration, :class:`RunConfig`: the TOML file's sections, validated and
frozen, and the checks that span sections.

Each section is a module of this package: the trainer's in :mod:`.sections`, the client's in
:mod:`.cluster` (with :mod:`.security`), :mod:`.launch` and :mod:`.tracking`, batch
inference's in :mod:`.predict`; each strategy's checks are its plan's (:mod:`.plans`).
``workflows/runs/config.py`` reads the TOML and validates it here.
"""

from collections.abc import Callable
from functools import partial
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, model_validator

from workers.spec.cluster import ClusterConfig
from workers.spec.errors import ConfigError
from workers.spec.launch import LaunchConfig
from workers.spec.layout import Layout
from workers.spec.locations import bucket_of
from workers.spec.names import STRATEGIES
from workers.spec.plans import StrategyPlan, StrategySections, get_plan
from workers.spec.sections import (
    SCHEDULES_OVER_THE_RUN,
    CheckpointConfig,
    DataConfig,
    FSDPConfig,
    ModelConfig,
    ParallelConfig,
    PipelineConfig,
    Redacted,
    TrainingConfig,
)
from workers.spec.tracking import TrackingConfig

# The validation context's key for where a staged run's model can be cut: a function of
# (sections, plan) that builds the model (imports torch), so a model that does not trace, or a
# split point where no stage can begin, is a config error at validation. The client passes
# workers.stage_cuts's (workflows/runs/config.py's load_config); without it the cut is not checked.
CUT_POINTS = "cut_points"
CutPoints = Callable[[StrategySections, StrategyPlan], list[str]]


class RunConfig(Redacted):
    """A run's whole configuration: the TOML file's sections, validated and frozen.

    Made by `load_config`. Each section is a model of its own; every key is in the
    configuration reference.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(
        default="run",
        pattern=r"^[A-Za-z0-9_.-]+$",
        description="the job's name, in task keys, event topics, run directories and `/metrics`",
    )
    cluster: ClusterConfig = ClusterConfig()
    launch: LaunchConfig = LaunchConfig()
    data: DataConfig = DataConfig()
    model: ModelConfig = ModelConfig()
    training: TrainingConfig = TrainingConfig()
    pipeline: PipelineConfig = PipelineConfig()
    parallel: ParallelConfig = ParallelConfig()
    fsdp: FSDPConfig = FSDPConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    tracking: TrackingConfig = TrackingConfig()

    @model_validator(mode="before")
    @classmethod
    def _strategy_defaults(cls, raw: Any) -> Any:
        # What the strategy assumes unless told (a staged one drops the last partial batch);
        # an unknown strategy is left to its field's own error.
        if not isinstance(raw, dict):
            return raw
        training = raw.get("training") or {}
        strategy = getattr(training, "strategy", None) or (
            training.get("strategy") if isinstance(training, dict) else None
        )
        if isinstance(strategy, str) and strategy in STRATEGIES:
            return get_plan(strategy).defaults(raw)
        return raw

    def located_options(self) -> list[tuple[str, str, dict[str, Any]]]:
        """(field, location, its section's storage options) for each location the config
        gives: what one bucket's options are read from."""
        given = [
            ("checkpoint.directory", self.checkpoint.directory, self.checkpoint.storage_options),
            ("data.store", self.data.store, self.data.storage_options),
            ("data.root", self.data.root, self.data.storage_options),
            ("model.weights", self.model.weights, self.model.storage_options),
        ]
        return [(field, where, dict(options)) for field, where, options in given if where]

    def bucket_options(self, url: str) -> dict[str, Any]:
        """The storage options for ``url``'s bucket: those of the section that names a location
        in it (one set per bucket, checked), so that every writer there (the run directory's
        copy, a sweep's journal, the checkpoints) reaches the same store; none: {}."""
        bucket = bucket_of(url)
        for _, where, options in self.located_options():
            if bucket is not None and bucket_of(where) == bucket and options:
                return options
        return {}

    @model_validator(mode="after")
    def _one_set_of_options_per_bucket(self) -> "RunConfig":
        seen: dict[tuple[str, str], tuple[str, dict[str, Any]]] = {}
        for field, where, options in self.located_options():
            bucket = bucket_of(where)
            if bucket is None or not options:
                continue
            first = seen.setdefault(bucket, (field, options))
            if first[1] != options:
                section, other = field.split(".")[0], first[0].split(".")[0]
                raise ValueError(
                    f"{section}.storage_options: {where} is in the bucket {bucket[0]}://"
                    f"{bucket[1]} that {first[0]} names with other {other}.storage_options; "
                    "give one bucket one set of options (the same in both, or in one only)"
                )
        return self

    @model_validator(mode="after")
    def _sections_agree(self, info: ValidationInfo) -> "RunConfig":
        world = self.launch.world_size
        if isinstance(world, tuple):
            self.elastic_layouts()  # every world of the range, checked
            world = world[0]  # the least the cluster must hold
        workers = self.cluster.n_workers
        if world is not None and workers is not None and world > workers:
            raise ValueError(
                f"launch.world_size: {world} ranks need {world} workers, but cluster.n_workers "
                f"is {workers}"
            )
        if self.model.builtin and self.data.image_size % 4:
            raise ValueError(
                f"data.image_size: {self.model.name} pools twice, so the size must be a "
                f"multiple of 4 (got {self.data.image_size})"
            )
        plan = self._plan
        plan.check_device(self.sections, kind=self.cluster.kind)
        plan.check_given_world(world)
        # An unknown world: the driver's resolve_run checks the layout once the cluster's
        # size is known.
        cut: CutPoints | None = (info.context or {}).get(CUT_POINTS)
        layer_names = partial(cut, self.sections, plan) if cut else None
        plan.check(self.sections, plan.world_size(world or workers), layer_names=layer_names)
        return self

    @property
    def sections(self) -> StrategySections:
        """The sections a strategy's plan reads."""
        return StrategySections(
            data=self.data,
            model=self.model,
            training=self.training,
            pipeline=self.pipeline,
            parallel=self.parallel,
            fsdp=self.fsdp,
        )

    @property
    def checkpoint_owner(self) -> str:
        """Whose checkpoints this run resumes from, writes and retains: ``checkpoint.run_id``,
        else the run's name (each manifest names it; workers/checkpoint.py)."""
        return self.checkpoint.run_id or self.name

    @property
    def _plan(self) -> StrategyPlan:
        """The plan of ``training.strategy``: its settings, checks and degrees (the spec's own:
        the client asks ``workers.spec.plans.get_plan``)."""
        return get_plan(self.training.strategy)

    @property
    def strategy_settings(self) -> BaseModel | None:
        """What ``training.strategy``'s ``prepare`` is given (None: it takes nothing)."""
        return self._plan.settings(self.sections)

    @property
    def world_size(self) -> int | None:
        """The ranks of a fixed-size run (None: the cluster decides, or an elastic range)."""
        if self.launch.elastic:
            return None
        return self._plan.world_size(self.launch.world_size)  # type: ignore[arg-type]

    def elastic_layouts(self) -> dict[int, Layout] | None:
        """An elastic run's layout for each world of ``launch.world_size``'s range, the same
        global batch on each (None: a fixed-size run); a ``ValueError`` naming the field for a
        range the strategy or the batch cannot hold."""
        if not isinstance(self.launch.world_size, tuple):
            return None
        low, high = self.launch.world_size
        given = f"launch.world_size: {low}:{high}"
        plan = self._plan
        if not plan.elastic:
            raise ValueError(
                f"{given} is a range, but training.strategy {self.training.strategy!r} lays its "
                "model out once, on a fixed number of ranks; give an int, or use strategy "
                "'ddp', 'fsdp' or 'hsdp'"
            )
        if not plan.replicated and (
            self.checkpoint.directory is None or self.checkpoint.resume != "auto"
        ):
            raise ValueError(
                f"{given} is a range, and an elastic {plan.name} run hands its shards from one "
                "world to the next through a checkpoint written at the step boundary; set "
                "checkpoint.directory (with checkpoint.resume = 'auto')"
            )
        per_rank = self.launch.elastic_batch == "per_rank"
        if per_rank:
            self._check_per_rank(low)
        layouts = {}
        for world in range(low, high + 1):
            sections = self.sections
            if per_rank:  # this world's global batch: each rank's times the ranks
                sections = sections.with_batch(self.training.batch_size // low * world)
            try:
                layouts[world] = plan.layout(sections, world, elastic=self.launch.elastic_batch)
            except ValueError as error:
                raise ValueError(f"{given} includes {world} ranks, and {error}") from None
        return layouts

    def _check_per_rank(self, low: int) -> None:
        """``launch.elastic_batch = "per_rank"``: each rank keeps ``training.batch_size / min``
        rows, so min must divide the batch; and the steps of an epoch follow the world, so a
        schedule over the run's steps needs them told (``training.max_steps``)."""
        batch, accum = self.training.batch_size, self.training.grad_accum_steps
        if batch % (low * accum):
            raise ValueError(
                f"launch.elastic_batch: 'per_rank' keeps each rank's batch, training.batch_size "
                f"/ the range's min = {batch} / {low}, which must be a whole multiple of "
                f"grad_accum_steps ({accum}); give a batch that {low} x {accum} divides"
            )
        schedule = self.training.lr_schedule
        if schedule in SCHEDULES_OVER_THE_RUN and self.training.max_steps is None:
            raise ValueError(
                f"launch.elastic_batch: 'per_rank' makes an epoch's steps follow the world, so "
                f"training.lr_schedule {schedule!r}, which spans the run's steps, cannot know "
                "them in advance; set training.max_steps, or use elastic_batch 'global'"
            )

    def layout(self, world_size: int) -> Layout:
        """How ``world_size`` ranks share this run's model and batch; a :class:`ConfigError`
        naming the field where they cannot."""
        try:
            return self._plan.layout(self.sections, world_size)
        except ValueError as error:
            raise ConfigError(str(error)) from None
