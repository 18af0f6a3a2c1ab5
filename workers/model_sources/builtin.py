"""The built-in models of workers/models.py, by name."""

from workers.model_sources import Factory, ModelError


def factory(target: str) -> Factory:
    from workers.models import MODELS

    if target not in MODELS:
        raise ModelError(f"model.name: unknown model {target!r}; choose one of {sorted(MODELS)}")
    return Factory.of(MODELS[target], label=target)
