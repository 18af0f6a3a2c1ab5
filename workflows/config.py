"""A run's configuration: TOML in, one validated, frozen :class:`RunConfig` out.

Each component owns its section's model (cluster, launch, data, model, training); this module
only composes them, checks what spans sections, and turns pydantic's errors into one line that
names the field.
"""

import tomllib
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from workers.config_models import (
    MODEL_LAYERS,
    CheckpointConfig,
    DataConfig,
    FSDPConfig,
    ModelConfig,
    ParallelConfig,
    PipelineConfig,
    ShardingSettings,
    StagingSettings,
    TrainingConfig,
)
from workers.layout import Layout, given_stage_replicas
from workers.strategies import SETTINGS_SECTION, SHARDED, STAGED
from workflows.cluster import ClusterConfig
from workflows.launcher import LaunchConfig
from workflows.tracking import TrackingConfig


class ConfigError(ValueError):
    """Invalid configuration; the message names the field and what to change."""


class RunConfig(BaseModel):
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
    def _staged_batches_have_one_shape(cls, raw: Any) -> Any:
        # Stages exchange fixed-shape buffers: staged strategies drop the last partial batch
        # unless the user says otherwise (which _sections_agree then refuses, by name).
        if not isinstance(raw, dict):
            return raw
        training, data = raw.get("training") or {}, raw.get("data") or {}
        strategy = getattr(training, "strategy", None) or (
            training.get("strategy") if isinstance(training, dict) else None
        )
        if strategy in STAGED and isinstance(data, dict) and "drop_last" not in data:
            raw = {**raw, "data": {**data, "drop_last": True}}
        return raw

    @model_validator(mode="after")
    def _sections_agree(self) -> "RunConfig":
        world = self.launch.world_size
        workers = self.cluster.n_workers
        if world is not None and workers is not None and world > workers:
            raise ValueError(
                f"launch.world_size: {world} ranks need {world} workers, but cluster.n_workers "
                f"is {workers}"
            )
        if self.training.strategy == "data_parallel" and world not in (None, 1):
            raise ValueError(
                "launch.world_size: data_parallel runs in one worker (over the GPUs it sees); "
                "set world_size = 1, or use strategy = 'ddp'"
            )
        if self.model.builtin and self.data.image_size % 4:
            raise ValueError(
                f"data.image_size: {self.model.name} pools twice, so the size must be a "
                f"multiple of 4 (got {self.data.image_size})"
            )
        ranks = 1 if self.training.strategy == "data_parallel" else (world or workers)
        if self.training.strategy in STAGED:
            # An unknown world is checked again by the driver, once the cluster's size is known.
            self._check_staged(ranks)
        elif self.training.strategy in SHARDED:
            self._check_sharded(ranks)
        else:
            self.layout(ranks or 1)
        if self.parallel.tp > 1 and self.training.strategy not in SHARDED + STAGED:
            self.layout(self.parallel.tp)  # says which strategies tensor parallelism composes with
        return self

    def _check_sharded(self, world_size: int | None) -> None:
        strategy, parallel = self.training.strategy, self.parallel
        if self.training.precision == "fp16":
            raise ValueError(
                f"training.precision: {strategy} has no loss scaling for fp16; use 'bf16'"
            )
        self._check_tp_plan()
        if self.fsdp.cpu_offload and self.cluster.kind == "cpu":
            raise ValueError(
                "fsdp.cpu_offload: a CPU cluster's shards are in host memory already; set "
                "cpu_offload = false (it moves a GPU's shards to the host)"
            )
        if world_size is None and parallel.dp_replicate and parallel.dp_shard:
            world_size = parallel.dp_replicate * parallel.dp_shard * parallel.tp
        if world_size is not None:
            self.layout(world_size)
        elif strategy == "hsdp" and not parallel.given:
            self.layout(1)  # says which degree hsdp needs, whatever the world size

    def _check_tp_plan(self) -> None:
        tp = self.parallel.tp
        if tp > 1 and self.model.resolved_tp_plan is None:
            raise ValueError(
                f"model.tp_plan: parallel.tp = {tp} splits the model's layers by its "
                "tensor-parallel plan; set model.tp_plan = 'package.module:plan' (plan(model, "
                "mesh) returns it), or parallel.tp = 1"
            )

    def _check_staged(self, world_size: int | None) -> None:
        t, p, strategy = self.training, self.pipeline, self.training.strategy
        if not self.data.drop_last:
            raise ValueError(
                f"data.drop_last: {strategy} needs every batch the same shape; set "
                "drop_last = true (the last partial batch of an epoch is left out)"
            )
        if t.grad_accum_steps > 1:
            raise ValueError(
                f"training.grad_accum_steps: {strategy} accumulates over "
                "pipeline.n_microbatches already; set grad_accum_steps = 1"
            )
        if t.precision == "fp16":
            raise ValueError(
                f"training.precision: {strategy} has no loss scaling for fp16; use 'bf16'"
            )
        replicas = given_stage_replicas(p, self.parallel)
        self._check_tp_plan()
        if strategy == "model_parallel" and ((replicas or 1) > 1 or p.stages_per_rank > 1):
            field = "pipeline.dp" if p.dp > 1 or p.stages_per_rank > 1 else "parallel"
            raise ValueError(
                f"{field}: model_parallel runs one copy of the model, one stage per rank; "
                "for replicas or interleaving use strategy = 'pipeline'"
            )
        layers = MODEL_LAYERS.get(self.model.name)
        names = self._checked_cut() if layers is None else list(layers)
        if layers is not None and p.split_points is not None:
            unknown = [point for point in p.split_points if point not in names]
            if unknown:
                # The config cannot know of a model given to train(model=...): say so where
                # the model is the default one, which such a config leaves as it is.
                given = "name" in self.model.model_fields_set
                raise ValueError(
                    f"pipeline.split_points: {unknown} name no top-level module of "
                    f"{self.model.name}; its modules are {names}"
                    + (
                        ""
                        if given
                        else " (a model given as train(model=...) is checked when it is cut: "
                        "leave split_points to the planner)"
                    )
                )
        if world_size is None:
            return
        layout = self.layout(world_size)
        if layout.n_stages > len(names):
            field, fewer = (
                ("parallel.pp", "lower parallel.pp")
                if self.parallel.pp is not None
                else ("pipeline", "use fewer workers")
            )
            raise ValueError(
                f"{field}: {layout.pp} ranks x {layout.stages_per_rank} stages per rank need "
                f"at least {layout.n_stages} layers, and {self.model.name} has {len(names)}; "
                f"{fewer} or stages_per_rank"
            )

    def _checked_cut(self) -> list[str]:
        """The cut points of a model whose layers are not written out in MODEL_LAYERS: it is
        built (and, unless it names its blocks, traced) here, which imports torch, so that a
        model that does not trace, or a split point where no stage can begin, is a config error
        before anything launches."""
        from workers.data import zero_samples
        from workers.models import build_model
        from workers.stage_cuts import check_cut, check_tensor_parallel_stages

        p, data = self.pipeline, self.data
        m = p.n_microbatches if self.training.strategy == "pipeline" else 1
        replicas = given_stage_replicas(p, self.parallel) or 1  # whatever the world
        micro_batch = max(1, self.training.batch_size // replicas // m)
        # The class count only sizes the last layer; before preprocessing, assume CIFAR-10's.
        model = build_model(
            self.model, num_classes=10, seed=self.training.seed, input_shape=data.sample_shape
        )
        if self.parallel.tp > 1:
            check_tensor_parallel_stages(model)
        sample = zero_samples(micro_batch, data.sample_shape, tokens=data.tokens)
        return check_cut(model, sample, p.split_points)

    @property
    def staging(self) -> StagingSettings:
        """What ``pipeline`` and ``model_parallel`` are given: ``[pipeline]`` and the model's
        TP plan."""
        return StagingSettings(pipeline=self.pipeline, tp_plan=self.model.resolved_tp_plan)

    @property
    def sharding(self) -> ShardingSettings:
        """What ``fsdp`` and ``hsdp`` are given: ``[fsdp]`` and the model's TP plan."""
        return ShardingSettings(fsdp=self.fsdp, tp_plan=self.model.resolved_tp_plan)

    @property
    def strategy_settings(self) -> BaseModel | None:
        """The section ``training.strategy``'s ``prepare`` is given (None: it takes none)."""
        section = SETTINGS_SECTION.get(self.training.strategy)
        return None if section is None else getattr(self, section)

    @property
    def world_size(self) -> int | None:
        if self.training.strategy == "data_parallel":
            return 1
        return self.launch.world_size

    def layout(self, world_size: int) -> Layout:
        """How ``world_size`` ranks share this run's model and batch; a :class:`ConfigError`
        naming the field where they cannot."""
        try:
            layout = Layout.of(
                self.training, self.pipeline, world_size=world_size, parallel=self.parallel
            )
        except ValueError as error:
            raise ConfigError(str(error)) from None
        points = self.pipeline.split_points
        staged = self.training.strategy in STAGED
        if staged and points is not None and len(points) + 1 != layout.n_stages:
            raise ConfigError(
                f"pipeline.split_points: {len(points)} points make {len(points) + 1} stages, "
                f"but {world_size} workers as pp={layout.pp} x dp={layout.dp} with "
                f"{layout.stages_per_rank} stage(s) per rank hold {layout.n_stages}; "
                "change split_points or launch.world_size"
            )
        return layout

    def check_batch(self, world_size: int) -> None:
        """The global batch must split evenly into ranks and accumulation micro-batches."""
        self.layout(world_size)


def check_model(
    config: RunConfig,
    *,
    num_classes: int,
    factory: Callable[..., Any] | None = None,
) -> None:
    """Resolve the loss and build the model once on the meta device (imports torch): a factory
    that is missing, refuses ``model.kwargs`` or returns no module is a :class:`ConfigError`
    here, before anything launches. ``factory``: a model given in Python."""
    from workers.losses import Criterion
    from workers.model_sources import ModelError
    from workers.models import check_model as build_on_meta

    try:
        criterion = Criterion.of(config.training)
        build_on_meta(
            config.model,
            num_classes=criterion.outputs(num_classes),
            input_shape=config.data.sample_shape,
            factory=factory,
        )
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
        raise ConfigError(_one_line(error)) from None


def read_raw_config(
    source: str | Path | dict[str, Any], overrides: list[str] | tuple[str, ...] = ()
) -> dict[str, Any]:
    """A TOML file's (or a dict's) sections with ``section.key=value`` overrides applied,
    before validation: commands with sections of their own take theirs out first."""
    if isinstance(source, dict):
        raw = dict(source)
    else:
        path = Path(source)
        try:
            raw = tomllib.loads(_read_config_text(path))
        except tomllib.TOMLDecodeError as error:
            raise ConfigError(f"{path}: not valid TOML: {error}") from None
    return _apply_overrides(raw, overrides)


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


def _apply_overrides(raw: dict[str, Any], overrides: list[str] | tuple[str, ...]) -> dict[str, Any]:
    merged = {k: dict(v) if isinstance(v, dict) else v for k, v in raw.items()}
    for item in overrides:
        key, sep, text = item.partition("=")
        parts = key.strip().split(".")
        if not sep or not all(parts):
            raise ConfigError(f"--set {item!r}: expected section.key=value")
        try:
            value = tomllib.loads(f"v = {text}")["v"]
        except tomllib.TOMLDecodeError:
            value = text  # a bare word: take it as a string
        target = merged
        for part in parts[:-1]:
            target = target.setdefault(part, {})
            if not isinstance(target, dict):
                raise ConfigError(f"--set {item!r}: {part} is not a section")
        target[parts[-1]] = value
    return merged


def _one_line(error: ValidationError) -> str:
    messages = []
    for detail in error.errors():
        field = ".".join(str(part) for part in detail["loc"])
        message = detail["msg"].removeprefix("Value error, ")
        if detail["type"] == "extra_forbidden":
            message = "unknown key (check the spelling)"
        elif detail["type"] == "literal_error":
            message = message.replace("Input should be", "must be")
        if field and not message.startswith(field.split(".")[0] + "."):
            messages.append(f"{field}: {message}")
        else:
            messages.append(message)
    return "; ".join(messages)
