"""What every model source shares: the :class:`Factory` it returns, the :class:`ModelError` it
raises, and how a callable's keyword arguments and an import path are read."""

import importlib
import inspect
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple


class ModelError(ValueError):
    """A model that cannot be built as configured; the message is one line naming the field."""


class Parameters(NamedTuple):
    """The keyword arguments a callable takes, as far as they can be known."""

    names: frozenset[str]  # those it names: in its signature, or in the class it returns
    more: bool  # it takes others besides (a bare **kwargs nothing resolves, no signature)


@dataclass(frozen=True)
class Factory:
    """A callable that builds the model, and what it is called with.

    ``parameters``: the keyword arguments it names; the data's facts (``num_classes``, the
    input shape) are filled in for these. ``more``: it takes keywords besides, behind a bare
    ``**kwargs`` that nothing resolves (or it has no signature to read): then ``model.kwargs``
    it does not name are passed on unchecked, and the call itself says what it refuses.
    """

    build: Callable[..., Any]
    label: str
    parameters: frozenset[str]
    more: bool = False

    @classmethod
    def of(cls, build: Callable[..., Any], label: str | None = None) -> "Factory":
        label = label or f"{build.__module__}:{getattr(build, '__qualname__', build)}"
        names, more = parameters_of(build)
        return cls(build=build, label=label, parameters=names, more=more)


def import_object(path: str, *, field: str) -> Any:
    """The object at ``package.module:attribute``; a :class:`ModelError` naming ``field`` and
    the module when it cannot be imported."""
    module_name, _, attribute = path.partition(":")
    try:
        found: Any = importlib.import_module(module_name)
    except ImportError as error:
        raise ModelError(f"{field}: cannot import module {module_name!r} ({error})") from None
    for part in attribute.split("."):
        if not hasattr(found, part):
            raise ModelError(f"{field}: module {module_name!r} has no attribute {attribute!r}")
        found = getattr(found, part)
    if not callable(found):
        raise ModelError(f"{field}: {path} is a {type(found).__name__}, not a callable")
    return found


def parameters_of(build: Callable[..., Any]) -> Parameters:
    """The keyword arguments ``build`` takes. Behind a bare ``**kwargs``, also the parameters of
    the class the callable says it returns (torchvision's and timm's builders are annotated);
    where nothing says what the ``**kwargs`` takes, the names in the signature are still known
    and ``more`` is set."""
    try:
        signature = inspect.signature(build)
    except (TypeError, ValueError):
        return Parameters(frozenset(), more=True)
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    names = frozenset(p.name for p in signature.parameters.values() if p.kind in kinds)
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values()):
        return Parameters(names, more=False)
    returned = _return_class(build)
    if returned is None or returned is build:
        return Parameters(names, more=True)
    behind = parameters_of(returned)
    return Parameters(names | behind.names, more=behind.more)


def _return_class(build: Callable[..., Any]) -> type | None:
    try:
        hint = typing.get_type_hints(build).get("return")
    except Exception:  # an annotation that does not resolve: nothing to learn from it
        return None
    return hint if isinstance(hint, type) and hint.__module__ != "builtins" else None
