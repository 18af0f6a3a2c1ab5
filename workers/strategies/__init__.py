"""One module per parallelism, each registering one :class:`~workers.strategies.base.Strategy`.

This file imports nothing, so that a config validates without torch: it only names the
strategies. Adding one means adding its module ``workers/strategies/<name>.py`` (the registry
imports a strategy's module by its name) and its name below; a test checks they agree. A
parallelism that composes into strategies rather than being one (``tensor_parallel``, which
``fsdp``, ``hsdp`` and the staged strategies apply) registers nothing.
"""

STRATEGIES = ("ddp", "data_parallel", "model_parallel", "pipeline", "fsdp", "hsdp")
# Strategies that cut the model into stages on several ranks.
STAGED = ("model_parallel", "pipeline")
# Strategies that shard parameters, gradients and optimizer state over the data-parallel ranks.
SHARDED = ("fsdp", "hsdp")
# The RunConfig attribute whose settings a strategy's prepare() is given (none: it takes none).
SETTINGS_SECTION = {
    "model_parallel": "staging",
    "pipeline": "staging",
    "fsdp": "sharding",
    "hsdp": "sharding",
}
