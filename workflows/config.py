"""A run's configuration: TOML in, one validated, frozen :class:`RunConfig` out.

Each component owns its section's model (cluster, launch, data, model, training); this module
only composes them, checks what spans sections, and turns pydantic's errors into one line that
names the field.
"""

import tomllib
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from workers.data import DataConfig
from workers.models import ModelConfig
from workers.train import TrainingConfig
from workflows.cluster import ClusterConfig
from workflows.launcher import LaunchConfig


class ConfigError(ValueError):
    """Invalid configuration; the message names the field and what to change."""


class RunConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(default="run", pattern=r"^[A-Za-z0-9_.-]+$")
    cluster: ClusterConfig = ClusterConfig()
    launch: LaunchConfig = LaunchConfig()
    data: DataConfig = DataConfig()
    model: ModelConfig = ModelConfig()
    training: TrainingConfig = TrainingConfig()

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
        if self.data.image_size % 4:
            raise ValueError(
                f"data.image_size: {self.model.name} pools twice, so the size must be a "
                f"multiple of 4 (got {self.data.image_size})"
            )
        ranks = 1 if self.training.strategy == "data_parallel" else (world or workers or 1)
        self.check_batch(ranks)
        return self

    @property
    def world_size(self) -> int | None:
        if self.training.strategy == "data_parallel":
            return 1
        return self.launch.world_size

    def check_batch(self, world_size: int) -> None:
        """The global batch must split evenly into ranks and accumulation micro-batches."""
        t = self.training
        if t.batch_size < world_size:
            raise ConfigError(
                f"training.batch_size: {t.batch_size} is smaller than the world size "
                f"{world_size}; every rank needs at least one sample per step"
            )
        if t.batch_size % (world_size * t.grad_accum_steps):
            raise ConfigError(
                f"training.batch_size: {t.batch_size} must be a multiple of world size x "
                f"grad_accum_steps = {world_size} x {t.grad_accum_steps}"
            )


def load_config(
    source: str | Path | dict[str, Any], overrides: list[str] | tuple[str, ...] = ()
) -> RunConfig:
    """Read a TOML file (or a dict), apply ``section.key=value`` overrides, validate."""
    if isinstance(source, dict):
        raw = source
    else:
        path = Path(source)
        try:
            raw = tomllib.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"{path}: no such config file") from None
        except tomllib.TOMLDecodeError as error:
            raise ConfigError(f"{path}: not valid TOML: {error}") from None
    raw = _apply_overrides(raw, overrides)
    try:
        return RunConfig.model_validate(raw)
    except ValidationError as error:
        raise ConfigError(_one_line(error)) from None


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
