"""MkDocs hook: the configuration reference, generated from the pydantic models at build time.

``docs/reference/configuration.md`` holds the marker ``<!-- configuration-tables -->``; this hook
replaces it with one table per section of :class:`workers.spec.run.RunConfig` (nested sections
included) and one for the ``[predict]`` section
(:class:`workers.spec.predict.PredictConfig`): key, type, default and the field's
``description``. A field without a description takes its
entry in its model's docstring ``Attributes:`` section. Nothing here is written by hand, so a
renamed or added key shows up on the next build.
"""

import inspect
import re
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal

# The checkout this hook belongs to, before any installed copy of the package.
REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from annotated_types import Ge, Gt, Le, Lt  # noqa: E402
from pydantic import BaseModel  # noqa: E402
from pydantic.fields import FieldInfo  # noqa: E402
from pydantic_core import PydanticUndefined  # noqa: E402

MARKER = "<!-- configuration-tables -->"


def sections() -> list[tuple[str, type[BaseModel]]]:
    """Every section as (dotted name, model), in the order of the models' fields."""
    from workers.spec.predict import PredictConfig
    from workers.spec.run import RunConfig

    found: list[tuple[str, type[BaseModel]]] = [("", RunConfig)]

    def walk(prefix: str, model: type[BaseModel]) -> None:
        for name, field in model.model_fields.items():
            nested = _model_of(field)
            if nested is not None:
                found.append((f"{prefix}{name}", nested))
                walk(f"{prefix}{name}.", nested)

    walk("", RunConfig)
    found.append(("predict", PredictConfig))
    return found


def keys() -> list[tuple[str, str, str, str]]:
    """Every configuration key: (dotted key, type, default, description)."""
    rows = []
    for section, model in sections():
        for name, field in model.model_fields.items():
            if _model_of(field) is not None:
                continue
            key = f"{section}.{name}" if section else name
            rows.append((key, _type(field), _default(field), _description(model, name, field)))
    return rows


def render() -> str:
    """The Markdown of every section's table."""
    rows = keys()
    out = []
    for section, model in sections():
        title = f"`[{section}]`" if section else "Top level"
        anchor = section.replace(".", "-") if section else "top-level"
        out.append(f"## {title} {{#{anchor}}}\n")
        out.append(_summary(model) + "\n")
        own = [row for row in rows if row[0].rpartition(".")[0] == section]
        if not own:
            out.append("This section holds only the sections below.\n")
            continue
        out.append("| key | type | default | description |")
        out.append("| --- | --- | --- | --- |")
        for key, kind, default, description in own:
            out.append(f"| `{key}` | {kind} | {default} | {_cell(description)} |")
        out.append("")
    return "\n".join(out)


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    if MARKER not in markdown:
        return markdown
    return markdown.replace(MARKER, render())


# -- rendering ---------------------------------------------------------------------------------


def _model_of(field: FieldInfo) -> type[BaseModel] | None:
    kind = field.annotation
    return kind if inspect.isclass(kind) and issubclass(kind, BaseModel) else None


def _summary(model: type[BaseModel]) -> str:
    doc = inspect.getdoc(model) or ""
    first = doc.split("\n\n", 1)[0].replace("\n", " ").strip()
    return f"{_rst_to_md(first)} (`{model.__module__}.{model.__name__}`)"


def _description(model: type[BaseModel], name: str, field: FieldInfo) -> str:
    if field.description:
        return field.description
    return _docstring_attributes(model).get(name, "")


def _docstring_attributes(model: type[BaseModel]) -> dict[str, str]:
    """The ``Attributes:`` section of a model's docstring (Google style), by name."""
    doc = inspect.getdoc(model) or ""
    match = re.search(r"^Attributes:\n((?:[ ]{4}.*\n?|\n)+)", doc, flags=re.M)
    if not match:
        return {}
    entries: dict[str, str] = {}
    current = None
    for line in match.group(1).splitlines():
        head = re.match(r"^ {4}(\w+)(?: \([^)]*\))?: (.*)$", line)
        if head:
            current = head.group(1)
            entries[current] = head.group(2).strip()
        elif current and line.strip():
            entries[current] += " " + line.strip()
    return entries


def _type(field: FieldInfo) -> str:
    text = _annotation(field.annotation)
    bounds = []
    for item in field.metadata:
        for kind, attribute, sign in (
            (Ge, "ge", "≥"),
            (Gt, "gt", ">"),
            (Le, "le", "≤"),
            (Lt, "lt", "<"),
        ):
            if isinstance(item, kind):
                bounds.append(f"{sign} {getattr(item, attribute)}")
    return text + (f" ({', '.join(bounds)})" if bounds else "")


def _annotation(kind: Any) -> str:
    origin = typing.get_origin(kind)
    if origin is Literal:
        return " \\| ".join(f'`"{value}"`' for value in typing.get_args(kind))
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(_annotation(arg) for arg in typing.get_args(kind))
    if kind is type(None):
        return "none"
    if origin is tuple:
        return f"list of {_annotation(typing.get_args(kind)[0])}"
    if origin is dict:
        key, value = typing.get_args(kind)
        return f"table ({_annotation(key)} → {_annotation(value)})"
    names = {str: "string", int: "integer", float: "number", bool: "boolean", Any: "any"}
    return names.get(kind, getattr(kind, "__name__", str(kind)))


def _default(field: FieldInfo) -> str:
    if field.default_factory is not None:
        value = field.default_factory()
    elif field.default is PydanticUndefined:
        return "required"
    else:
        value = field.default
    return _toml(value)


def _toml(value: Any) -> str:
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, str):
        return f'`"{value}"`'
    if isinstance(value, dict):
        return "`{}`" if not value else f"`{value}`"
    return f"`{value}`"


def _rst_to_md(text: str) -> str:
    text = re.sub(r":\w+:`~?([^`]+)`", r"`\1`", text)
    return text.replace("``", "`")


def _cell(text: str) -> str:
    return _rst_to_md(text).replace("|", "\\|").replace("\n", " ")
