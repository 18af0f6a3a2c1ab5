"""``torchvision:<name>``: a torchvision model, built with ``get_model(name, weights=None)``
(never downloads weights)."""

import difflib
import functools

import torchvision

from workers.model_sources.base import Factory, ModelError, parameters_of


def factory(target: str) -> Factory:
    names = torchvision.models.list_models()
    if target not in names:
        close = difflib.get_close_matches(target, names, n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise ModelError(
            f"model.name: torchvision {torchvision.__version__} has no model {target!r}{hint} "
            "(see torchvision.models.list_models())"
        )
    builder = torchvision.models.get_model_builder(target)
    parameters = parameters_of(builder)
    return Factory(
        build=functools.partial(torchvision.models.get_model, target, weights=None),
        label=f"torchvision:{target}",
        parameters=parameters.names - {"weights", "progress"},
        more=parameters.more,
    )
