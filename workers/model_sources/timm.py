"""``timm:<name>``: a timm model, built with ``timm.create_model(name, pretrained=False)``;
timm is the optional extra ``dask-train[timm]``."""

import difflib
import functools

from workers.model_sources.base import Factory, ModelError, parameters_of


def factory(target: str) -> Factory:
    try:
        import timm
    except ImportError:
        raise ModelError(
            f"model.name: timm:{target} needs timm, which is not installed; "
            "pip install 'dask-train[timm]'"
        ) from None
    if not timm.is_model(target):
        close = difflib.get_close_matches(target, timm.list_models(), n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise ModelError(
            f"model.name: timm {timm.__version__} has no model {target!r}{hint} "
            "(see timm.list_models())"
        )
    parameters = parameters_of(timm.models.model_entrypoint(target))
    return Factory(
        build=functools.partial(timm.create_model, target, pretrained=False),
        label=f"timm:{target}",
        parameters=parameters.names - {"pretrained"},
        more=parameters.more,
    )
