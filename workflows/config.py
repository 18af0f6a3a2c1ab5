"""A run's configuration: TOML in, one validated, frozen :class:`RunConfig` out.

The trainer's sections are the spec's (``workers/spec/sections.py``), the client's own are their
components' (cluster, launch, tracking), and each strategy's checks are its plan's
(``workers/spec/plans/``); this module only composes them, checks what spans sections, and turns
pydantic's errors into one line that names the field.
"""

import re
import tomllib
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from workers.spec.layout import Layout
from workers.spec.locations import bucket_of
from workers.spec.names import STRATEGIES
from workers.spec.plans import StrategyPlan, StrategySections, get_plan
from workers.spec.secrets import redact
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
from workflows.cluster import ClusterConfig
from workflows.launcher import LaunchConfig
from workflows.tracking import TrackingConfig


class ConfigError(ValueError):
    """Invalid configuration; the message names the field and what to change, every secret in
    it masked (a URL's password, a storage option's value: workers/spec/secrets.py)."""

    def __init__(self, message: object = "", *rest: object) -> None:
        super().__init__(redact(str(message)), *rest)


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
    def _sections_agree(self) -> "RunConfig":
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
        plan = self.strategy_plan
        plan.check_device(self.sections, kind=self.cluster.kind)
        plan.check_given_world(world)
        # An unknown world: the driver's resolve_run checks the layout once the cluster's
        # size is known.
        plan.check(self.sections, plan.world_size(world or workers), layer_names=self._layer_names)
        return self

    def _layer_names(self) -> list[str]:
        """Where a staged run's model can be cut, by building it (imports torch): a model that
        does not trace, or a split point where no stage can begin, is a config error here."""
        from workers.stage_cuts import checked_cut

        return checked_cut(self.sections, self.strategy_plan)  # type: ignore[arg-type]

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
    def strategy_plan(self) -> StrategyPlan:
        """The plan of ``training.strategy``: its settings, checks and degrees."""
        return get_plan(self.training.strategy)

    @property
    def strategy_settings(self) -> BaseModel | None:
        """What ``training.strategy``'s ``prepare`` is given (None: it takes nothing)."""
        return self.strategy_plan.settings(self.sections)

    @property
    def world_size(self) -> int | None:
        """The ranks of a fixed-size run (None: the cluster decides, or an elastic range)."""
        if self.launch.elastic:
            return None
        return self.strategy_plan.world_size(self.launch.world_size)  # type: ignore[arg-type]

    def elastic_layouts(self) -> dict[int, Layout] | None:
        """An elastic run's layout for each world of ``launch.world_size``'s range, the same
        global batch on each (None: a fixed-size run); a ``ValueError`` naming the field for a
        range the strategy or the batch cannot hold."""
        if not isinstance(self.launch.world_size, tuple):
            return None
        low, high = self.launch.world_size
        given = f"launch.world_size: {low}:{high}"
        plan = self.strategy_plan
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
            return self.strategy_plan.layout(self.sections, world_size)
        except ValueError as error:
            raise ConfigError(str(error)) from None


def check_model(
    config: RunConfig,
    *,
    num_classes: int,
    factory: Callable[..., Any] | None = None,
) -> None:
    """Resolve the loss and build the model once on the meta device (imports torch): a factory
    that is missing, refuses ``model.kwargs`` or returns no module is a :class:`ConfigError`
    here, before anything launches. So is an optimizer or schedule that torch refuses
    (``workers.optimizers.check``). ``factory``: a model given in Python."""
    from workers.in_place_init import InPlaceInit
    from workers.losses import Criterion
    from workers.model_sources import ModelError
    from workers.models import check_model as build_on_meta
    from workers.optimizers import OptimizerError
    from workers.optimizers import check as check_optimizer

    try:
        check_optimizer(config.training)
    except OptimizerError as error:
        raise ConfigError(str(error)) from None
    if config.training.compile:
        import torch

        backends = torch.compiler.list_backends(exclude_tags=())
        if config.training.compile_backend not in backends:
            raise ConfigError(
                f"training.compile_backend: torch knows no backend "
                f"{config.training.compile_backend!r}; it has {sorted(backends)}"
            )
    try:
        criterion = Criterion.of(config.training)
        built = build_on_meta(
            config.model,
            num_classes=criterion.outputs(num_classes),
            input_shape=config.data.sample_shape,
            factory=factory,
        )
        weights, options = config.model.weights, config.model.storage_options
        seen = weights is None or "://" in weights or Path(weights).exists()
        if config.model.in_place_init and seen:
            # Refuses a module whose values it cannot draw, or a weights file or checkpoint
            # that is not the model's (a URL's, from here; a path the client does not see,
            # on each rank).
            InPlaceInit(built, seed=0, weights=weights, storage_options=options)
    except ModelError as error:
        raise ConfigError(str(error)) from None


def model_builder(
    config: RunConfig, num_classes: int, factory: Callable[..., Any]
) -> Callable[[], Any]:
    """What builds ``factory``'s model as every rank of ``config``'s run builds it (its
    ``model.kwargs``, the data's facts, the seed): the client traces, checks and plans the cut
    of that model. Picklable, for the planner's profile on a worker."""
    from workers.losses import Criterion
    from workers.models import build_model

    return partial(
        build_model,
        config.model,
        num_classes=Criterion.of(config.training).outputs(num_classes),
        seed=config.training.seed,
        input_shape=config.data.sample_shape,
        factory=factory,
    )


def load_config(
    source: str | Path | dict[str, Any], overrides: list[str] | tuple[str, ...] = ()
) -> RunConfig:
    """Read a TOML file (or a dict), apply ``section.key=value`` overrides, validate.

    Nothing starts: a config is checked without a cluster.

    Args:
        source: A TOML file's path, or a dict of its sections.
        overrides: ``"section.key=value"`` strings, as ``--set`` takes them; the value is read
            as TOML (``training.lr=0.01``, ``pipeline.split_points=['layer3']``), else as a
            string.

    Returns:
        The validated, frozen configuration.

    Raises:
        ConfigError: The file is missing or not TOML, a key is unknown or a value invalid;
            one line naming the field (``training.epohcs: unknown key``).

    Example:
        ```python
        config = load_config("workflows/configs/digits_ddp.toml", ["training.epochs=3"])
        ```
    """
    raw = read_raw_config(source, overrides)
    try:
        return RunConfig.model_validate(raw)
    except ValidationError as error:
        raise ConfigError(one_line(error)) from None


def read_raw_config(
    source: str | Path | dict[str, Any],
    overrides: list[str] | tuple[str, ...] = (),
    *,
    overrides_named: str = "overrides",
) -> dict[str, Any]:
    """A TOML file's (or a dict's) sections with ``section.key=value`` overrides applied,
    before validation: commands with sections of their own take theirs out first. A bad
    override is told under ``overrides_named`` (the CLI's ``--set``)."""
    if isinstance(source, dict):
        raw = dict(source)
    else:
        path = Path(source)
        try:
            raw = tomllib.loads(_read_config_text(path))
        except tomllib.TOMLDecodeError as error:
            raise ConfigError(f"{path}: not valid TOML: {error}") from None
    return _apply_overrides(raw, overrides, overrides_named)


def _read_config_text(path: Path) -> str:
    try:
        if path.is_symlink() and not path.exists():
            raise ConfigError(f"{path}: a symbolic link to a missing file, not a config file")
        if path.exists() and not path.is_file():
            # A directory fails to open, but a FIFO or a device would block or stream forever.
            kind = "a directory" if path.is_dir() else "not a regular file"
            raise ConfigError(f"{path}: {kind}, not a config file")
        data = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config file") from None
    except OSError as error:
        raise ConfigError(f"{path}: cannot read the config file ({error.strerror})") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ConfigError(
            f"{path}: not UTF-8 text (byte {error.start}); a config file is TOML, which is UTF-8"
        ) from None


def _apply_overrides(
    raw: dict[str, Any], overrides: list[str] | tuple[str, ...], named: str
) -> dict[str, Any]:
    merged = {k: dict(v) if isinstance(v, dict) else v for k, v in raw.items()}
    for item in overrides:
        key, sep, text = item.partition("=")
        parts = key.strip().split(".")
        if not sep or not all(parts):
            raise ConfigError(f"{named} {item!r}: expected section.key=value")
        try:
            value = tomllib.loads(f"v = {text}")["v"]
        except tomllib.TOMLDecodeError:
            value = text  # a bare word: take it as a string
        target = merged
        for part in parts[:-1]:
            target = target.setdefault(part, {})
            if not isinstance(target, dict):
                raise ConfigError(f"{named} {item!r}: {part} is not a section")
        target[parts[-1]] = value
    named_anew = any(item.partition("=")[0].strip() == "name" for item in overrides)
    return merged if named_anew else _named_after_strategy(raw, merged)


def _named_after_strategy(raw: dict[str, Any], merged: dict[str, Any]) -> dict[str, Any]:
    """A name that says its strategy (``digits-ddp``) says the one an override set
    (``training.strategy='fsdp'``: ``digits-fsdp``), so its run directory is not named for
    what it does not run."""
    before, after = (
        section.get("strategy") if isinstance(section, dict) else None
        for section in (raw.get("training"), merged.get("training"))
    )
    name = merged.get("name")
    if not (isinstance(before, str) and isinstance(after, str) and isinstance(name, str)):
        return merged
    word = rf"(?<![A-Za-z0-9]){re.escape(before)}(?![A-Za-z0-9])"
    return merged | {"name": re.sub(word, after, name)}


# Keys an earlier release took, and what they are called now: told as such, not as unknown.
RENAMED_KEYS = {"training.grad_clip_norm": "training.max_grad_norm"}


def one_line(error: ValidationError) -> str:
    """A pydantic error as one line: each field named, with what to change."""
    messages = []
    for detail in error.errors():
        field = ".".join(str(part) for part in detail["loc"])
        message = detail["msg"].removeprefix("Value error, ")
        if detail["type"] == "extra_forbidden" and field in RENAMED_KEYS:
            message = f"now called {RENAMED_KEYS[field]} (the same setting); rename it"
        elif detail["type"] == "extra_forbidden":
            message = "unknown key (check the spelling)"
        elif detail["type"] == "literal_error":
            message = message.replace("Input should be", "must be")
        # A message naming its field already (``launch.world_size: ...`` for ``world_size``).
        named = message.split(":", 1)[0].endswith(field) if field else True
        if field and not named and not message.startswith(field.split(".")[0] + "."):
            messages.append(f"{field}: {message}")
        else:
            messages.append(message)
    return "; ".join(messages)
