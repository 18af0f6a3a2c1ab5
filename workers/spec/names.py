"""The names a config may use, one table each: strategies, data sources, built-in models, and
the syntax of a model's name. The registries that give the names their code (``workers/
strategies``, ``workers/sources``, ``workers/model_sources``, ``builtin.py`` there) check
themselves against these tables, and a test checks that every name has its module.
"""

import re

# training.strategy: each has a plan (workers/spec/plans/) and a runtime (workers/strategies/).
STRATEGIES = ("ddp", "data_parallel", "model_parallel", "pipeline", "fsdp", "hsdp")

# data.dataset: each has a module workers/sources/<name>.py.
SOURCES = ("digits", "synthetic", "cifar10", "imagefolder", "text", "parquet", "zarr")
# The sources read as Dask collections (store = "collections"): their configs name a target
# and skip the store, which the config and the driver know from the names alone.
COLLECTION_SOURCES = ("parquet", "zarr")

# The built-in models (workers/model_sources/builtin.py), named here so that a config validates
# without torch.
BUILTIN_MODELS = ("cifar_cnn", "small_resnet", "gpt")
# The top-level modules of the built-in nn.Sequential models: where each can be cut into stages.
# Written out so that checking split points needs no torch; a test compares them with the
# modules the models really have. (gpt is cut between its blocks, as many as model.kwargs
# gives it: its cut is checked by building it.)
# fmt: off
MODEL_LAYERS: dict[str, tuple[str, ...]] = {
    "cifar_cnn": (
        "conv1", "relu1", "pool1", "conv2", "relu2", "pool2", "flatten", "fc1", "relu3", "fc2",
    ),
    "small_resnet": (
        "stem", "block1", "block2", "block3", "block4", "down1", "block5", "down2", "block6",
        "pool", "flatten", "fc",
    ),
}
# fmt: on
# The built-in models with a tensor-parallel plan of their own.
BUILTIN_TP_PLANS = {"gpt": "workers.tensor_plans:gpt"}

# model.name prefixes with a source module of the same name (workers/model_sources/); any other
# "a.b:c" is an import path.
MODEL_PREFIXES = ("torchvision", "timm")
# "package.module:attribute", for models, losses, optimizers and schedules.
IMPORT_PATH = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")


def model_source(name: str) -> tuple[str, str]:
    """``model.name`` → (its source module in workers/model_sources/, the name within it)."""
    prefix, colon, rest = name.partition(":")
    if not colon:
        return "builtin", name
    if prefix in MODEL_PREFIXES:
        return prefix, rest
    return "import_path", name


def check_model_name(name: str) -> None:
    """The syntax of ``model.name`` (no imports): a ValueError saying what is accepted."""
    source, target = model_source(name)
    builtin = sorted(BUILTIN_MODELS)
    accepted = (
        f"choose one of {builtin}, 'torchvision:<name>', 'timm:<name>' or an import path "
        "'package.module:factory'"
    )
    if source == "builtin" and name not in builtin:
        raise ValueError(f"unknown model {name!r}; {accepted}")
    if source in MODEL_PREFIXES and not target:
        raise ValueError(f"{name!r} names no model after '{source}:'; {accepted}")
    if source == "import_path" and not IMPORT_PATH.match(name):
        raise ValueError(f"{name!r} is not an import path 'package.module:factory'; {accepted}")
