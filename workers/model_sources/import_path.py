"""``package.module:factory``: any importable callable (a function or an ``nn.Module`` class)
that returns an ``nn.Module``. Workers that cannot import the module get it shipped by the
client (workflows/jobs/code_shipping.py)."""

from workers.model_sources.base import Factory, import_object


def factory(target: str) -> Factory:
    return Factory.of(import_object(target, field="model.name"), label=target)
