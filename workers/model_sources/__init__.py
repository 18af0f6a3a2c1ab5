"""Where a model comes from: one module per source, chosen by the prefix of ``model.name``.

- ``cifar_cnn``, ``small_resnet``: the built-in models (``builtin``);
- ``torchvision:<name>``: any of ``torchvision.models.list_models()`` (``torchvision``);
- ``timm:<name>``: any timm model, with the ``[timm]`` extra installed (``timm``);
- ``package.module:factory``: any importable callable returning an ``nn.Module``
  (``import_path``).

Each source module has one function, ``factory(target) -> Factory``. This file imports no torch.
Adding a source means adding its module and its
prefix to ``MODEL_PREFIXES`` in ``workers/spec/names.py``, where the config checks a name's
syntax without importing anything.
"""

import importlib

from workers.model_sources.base import Factory, ModelError, import_object, parameters_of
from workers.spec.names import model_source

__all__ = ["Factory", "ModelError", "import_object", "parameters_of", "resolve"]


def resolve(name: str) -> Factory:
    """The factory ``model.name`` names (imports the source, and what it names)."""
    source, target = model_source(name)
    module = importlib.import_module(f"{__package__}.{source}")
    return module.factory(target)
