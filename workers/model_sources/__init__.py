"""Where a model comes from: one module per source, chosen by the prefix of ``model.name``.

- ``cifar_cnn``, ``small_resnet``: the built-in models (``builtin``, workers/models.py);
- ``torchvision:<name>``: any of ``torchvision.models.list_models()`` (``torchvision``);
- ``timm:<name>``: any timm model, with the ``[timm]`` extra installed (``timm``);
- ``package.module:factory``: any importable callable returning an ``nn.Module``
  (``import_path``).

Each source module has one function, ``factory(target) -> Factory``. This file imports no torch:
the config checks the syntax of a name with it. Adding a source means adding its module and its
prefix to ``PREFIXES``.
"""

import importlib
import inspect
import re
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

# Prefixes with a source module of the same name; any other "a.b:c" is an import path.
PREFIXES = ("torchvision", "timm")
# "package.module:attribute", for models and losses.
IMPORT_PATH = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")


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


def source_of(name: str) -> tuple[str, str]:
    """``model.name`` → (source module, the name within that source)."""
    prefix, colon, rest = name.partition(":")
    if not colon:
        return "builtin", name
    if prefix in PREFIXES:
        return prefix, rest
    return "import_path", name


def check_name(name: str, builtin: list[str]) -> None:
    """The syntax of ``model.name`` (no imports): a ValueError saying what is accepted."""
    source, target = source_of(name)
    accepted = (
        f"choose one of {builtin}, 'torchvision:<name>', 'timm:<name>' or an import path "
        "'package.module:factory'"
    )
    if source == "builtin" and name not in builtin:
        raise ValueError(f"unknown model {name!r}; {accepted}")
    if source in PREFIXES and not target:
        raise ValueError(f"{name!r} names no model after '{source}:'; {accepted}")
    if source == "import_path" and not IMPORT_PATH.match(name):
        raise ValueError(f"{name!r} is not an import path 'package.module:factory'; {accepted}")


def resolve(name: str) -> Factory:
    """The factory ``model.name`` names (imports the source, and what it names)."""
    source, target = source_of(name)
    module = importlib.import_module(f"{__package__}.{source}")
    return module.factory(target)


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
