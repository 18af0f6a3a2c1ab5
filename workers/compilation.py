"""``training.compile``: torch.compile each of the model's blocks, as torchtitan does.

Compiling block by block (rather than the whole model) keeps the graphs small and the same
for every block, which torch compiles once and reuses (its modules' parameters are inputs to
the graph, not constants); it composes with FSDP2, which shards the same blocks (its hooks run
outside the compiled code), with activation checkpointing, applied first, and with a pipeline
cut between blocks. Compiling is lazy: the first steps compile, then run the compiled code.
"""

from torch import nn

from workers.models import repeated_blocks


def apply_compile(model: nn.Module, *, backend: str) -> list[nn.Module]:
    """Compile ``model``'s blocks in place (``nn.Module.compile``: a transformer's blocks,
    as activation checkpointing finds them), the whole model where it has none; the modules
    compiled."""
    blocks = repeated_blocks(model) or [model]
    for block in blocks:
        block.compile(backend=backend)
    return blocks
