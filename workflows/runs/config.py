"""A run's configuration read: TOML in, one validated, frozen :class:`RunConfig` out.

Every section, and the checks that span them, are the spec's (``workers/spec/run.py`` and a
module a section beside it); this module reads the file, applies ``--set`` overrides, turns
pydantic's errors into one line that names the field, and builds the model once to check it.
"""

import re
import tomllib
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from workers.spec.errors import ConfigError, one_line
from workers.spec.plans import StrategyPlan, StrategySections
from workers.spec.run import CUT_POINTS, RunConfig


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
        return RunConfig.model_validate(raw, context={CUT_POINTS: _cut_points})
    except ValidationError as error:
        raise ConfigError(one_line(error)) from None


def _cut_points(sections: StrategySections, plan: StrategyPlan) -> list[str]:
    """Where a staged run's model can be cut, by building it (imports torch): a model that
    does not trace, or a split point where no stage can begin, is a config error here."""
    from workers.stage_cuts import checked_cut

    return checked_cut(sections, plan)  # type: ignore[arg-type]


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
