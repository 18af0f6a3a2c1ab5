"""Hybrid sharded data parallelism: FSDP2 within groups of ``parallel.dp_shard`` ranks (a host's
GPUs), replicated across the ``parallel.dp_replicate`` groups. The layout gives the degrees and
:class:`~workers.strategies.fsdp.FSDP` builds the 2-D mesh from them."""

from workers.strategies.base import register
from workers.strategies.fsdp import FSDP


@register
class HSDP(FSDP):
    name = "hsdp"
