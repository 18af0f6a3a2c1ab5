"""The tensor-parallel plans of the built-in models (``model.tp_plan`` defaults to these).

A plan lives apart from its model: model code never imports torch.distributed, so the same
class trains in one process too.
"""

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from workers.model_sources import ModelError


def gpt(model: nn.Module, mesh: DeviceMesh) -> dict[str, ParallelStyle]:
    """Megatron's split of each block of the built-in ``GPT``: q, k, v and the feed-forward's
    first layer by columns (each rank a share of the heads and hidden units), the attention's
    output and the feed-forward's second layer by rows (their partial sums all-reduced). The
    embeddings, norms and head stay whole on every rank."""
    # A pipeline stage holds some of the blocks (keeping their names): the plan is for those.
    blocks = list(model.layers.items())
    heads = blocks[0][1].attention.n_heads if blocks else 0
    if heads % mesh.size():
        raise ModelError(
            f"model.kwargs: n_heads = {heads} does not split over parallel.tp = {mesh.size()}; "
            "choose n_heads a multiple of tp"
        )
    plan: dict[str, ParallelStyle] = {}
    for key, _ in blocks:
        block = f"layers.{key}"
        plan |= {f"{block}.attention.{name}": ColwiseParallel() for name in ("wq", "wk", "wv")}
        plan[f"{block}.attention.wo"] = RowwiseParallel()
        plan[f"{block}.feed_forward.w1"] = ColwiseParallel()
        plan[f"{block}.feed_forward.w2"] = RowwiseParallel()
    return plan
