"""A sweep's search space: Optuna distributions from short forms, and the CLI's SPEC text.

>>> space = {
...     "lr": ("log", 1e-4, 1e-1),  # log-uniform float
...     "dropout": (0.0, 0.5),  # uniform float
...     "layers": (1, 4),  # two ints: an int range, both ends included
...     "depth": ("int", 1, 8),  # an int range, said so
...     "hidden": [32, 64, 128],  # choices
... }

An Optuna distribution is taken as it is. On the command line (``--param KEY=SPEC``) the same
forms read ``log:1e-4:1e-1``, ``0.0:0.5``, ``int:1:8`` and ``32,64,128``.

Optuna is imported inside the functions: ``import workflows`` never needs it.
"""

import json
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from optuna.distributions import BaseDistribution
    from optuna.trial import Trial

KINDS = ("log", "int", "float")
SAMPLERS = ("tpe", "random", "grid")
PRUNERS = ("median", "hyperband", "successive_halving")
SHORT_FORMS = (
    "('log', low, high), ('int', low, high), ('float', low, high), (low, high) or a list of choices"
)


def search_space(space: Mapping[str, Any]) -> dict[str, "BaseDistribution"]:
    """Each key's Optuna distribution; a ``ValueError`` naming the key whose form is wrong."""
    if not isinstance(space, Mapping) or not space:
        raise ValueError(f"space: give a dict of at least one key -> {SHORT_FORMS}")
    distributions = {}
    for key, form in space.items():
        if not isinstance(key, str) or not key:
            raise ValueError(f"space: keys are parameter names (strings), got {key!r}")
        try:
            distributions[key] = distribution_of(form)
        except ValueError as error:
            raise ValueError(f"space[{key!r}]: {error}") from None
    return distributions


def distribution_of(form: Any) -> "BaseDistribution":
    from optuna.distributions import BaseDistribution, CategoricalDistribution

    if isinstance(form, BaseDistribution):
        return form
    if isinstance(form, list):
        if not form:
            raise ValueError("an empty list of choices")
        unusable = [c for c in form if not isinstance(c, None | bool | int | float | str)]
        if unusable:
            raise ValueError(f"choices are numbers, strings, booleans or None, not {unusable[0]!r}")
        return CategoricalDistribution(form)
    if isinstance(form, tuple):
        return _range_of(form)
    raise ValueError(f"{form!r} is not a distribution; use {SHORT_FORMS}")


def _range_of(form: tuple[Any, ...]) -> "BaseDistribution":
    from optuna.distributions import FloatDistribution, IntDistribution

    kind, bounds = (form[0], form[1:]) if form and isinstance(form[0], str) else (None, form)
    if kind is not None and kind not in KINDS:
        raise ValueError(f"{kind!r} is not a kind of range; use one of {list(KINDS)}")
    if len(bounds) != 2 or not all(is_number(b) for b in bounds):
        raise ValueError(f"{form!r}: a range is two numbers, low and high; use {SHORT_FORMS}")
    low, high = bounds
    if not low <= high:
        raise ValueError(f"{form!r}: low must not exceed high")
    integers = kind == "int" or (kind != "float" and all(isinstance(b, int) for b in bounds))
    if kind == "int" and not all(float(b).is_integer() for b in bounds):
        raise ValueError(f"{form!r}: an int range needs whole numbers")
    if kind == "log" and low <= 0:
        raise ValueError(f"{form!r}: a log range needs low > 0")
    if integers:
        return IntDistribution(int(low), int(high), log=kind == "log")
    return FloatDistribution(float(low), float(high), log=kind == "log")


def is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def parse_param(text: str) -> tuple[str, Any]:
    """``KEY=SPEC`` from the command line as ``(key, short form)``; ``ValueError`` if not."""
    key, sep, spec = text.partition("=")
    key, spec = key.strip(), spec.strip()
    if not sep or not key or not spec:
        raise ValueError(f"{text!r}: expected KEY=SPEC, e.g. training.lr=log:1e-4:1e-1")
    if "," in spec or ":" not in spec:
        return key, [_scalar(part.strip()) for part in spec.split(",")]
    parts = spec.split(":")
    kind = parts[0] if parts[0] in KINDS else None
    bounds = [_scalar(part.strip()) for part in parts[1 if kind else 0 :]]
    form = (kind, *bounds) if kind else tuple(bounds)
    try:
        distribution_of(form)
    except ValueError:
        raise ValueError(
            f"{text!r}: SPEC is log:LOW:HIGH, int:LOW:HIGH, LOW:HIGH or A,B,C"
        ) from None
    return key, form


def _scalar(text: str) -> Any:
    """A number where the text is one, else the text."""
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            continue
    return text


def suggest(trial: "Trial", name: str, distribution: "BaseDistribution") -> Any:
    """The trial's value of ``name``: the one it holds already (a trial taken over from a
    client that died), else a new one from the sampler."""
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    if isinstance(distribution, FloatDistribution):
        d = distribution
        return trial.suggest_float(name, d.low, d.high, log=d.log, step=d.step)
    if isinstance(distribution, IntDistribution):
        d = distribution
        return trial.suggest_int(name, d.low, d.high, log=d.log, step=d.step)
    if isinstance(distribution, CategoricalDistribution):
        return trial.suggest_categorical(name, distribution.choices)
    raise ValueError(f"space[{name!r}]: {type(distribution).__name__} is not supported")


def first_value(distribution: "BaseDistribution") -> Any:
    """A value the distribution holds: its first choice, or its low end."""
    from optuna.distributions import CategoricalDistribution

    if isinstance(distribution, CategoricalDistribution):
        return distribution.choices[0]
    return distribution.low  # type: ignore[attr-defined]


def config_override(key: str, value: Any) -> str:
    """``key=value`` as ``--set`` takes it (the value a TOML literal)."""
    if value is None:
        raise ValueError(f"space[{key!r}]: None cannot be a config value (TOML has no null)")
    if isinstance(value, bool):
        literal = "true" if value else "false"
    elif isinstance(value, int | float):
        literal = repr(value) if math.isfinite(value) else str(value).lower()
    else:
        literal = json.dumps(str(value))  # a TOML basic string: JSON's escapes are TOML's
    return f"{key}={literal}"
