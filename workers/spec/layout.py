"""How a job's ranks divide the work, computed once on the client and carried to every rank.

After torchtitan's ``ParallelDims``: a frozen dataclass that checks itself, with the derived
numbers as properties, so no other module divides the world or the batch again. Torch-free: the
config checks use it before anything starts. Each strategy's plan computes its degrees
(``StrategyPlan.degrees`` in ``workers/strategies``); ``RunConfig.layout`` asks the run's.
"""

from dataclasses import dataclass
from typing import Literal

# How an elastic job's batch follows its world (launch.elastic_batch); None: a fixed world.
ElasticBatch = Literal["global", "per_rank"] | None


@dataclass(frozen=True)
class Layout:
    """The ranks as a ``(pp, dp, tp)`` mesh, ``rank = (pp_rank * dp + dp_rank) * tp +
    tp_rank``, and the batch.

    A strategy that keeps the whole model on every rank is the ``pp = 1`` case: every rank is a
    replica. Replicas read different data; the ``pp`` ranks of a pipeline read the same. The
    ``dp`` ranks are ``dp_replicate`` groups of ``dp_shard`` ranks (``dp_rank = replica *
    dp_shard + shard``): FSDP shards the model within a group, HSDP also replicates across
    groups. The ``tp`` ranks of a replica split each layer and read the same data.
    """

    world_size: int
    pp: int  # ranks per pipeline, each holding stages_per_rank consecutive-in-turn stages
    dp: int  # replicas
    batch_size: int  # global, per optimizer step
    n_microbatches: int = 1  # forward passes per rank and step: accumulation or the pipeline's
    stages_per_rank: int = 1
    dp_shard: int = 1  # 1: every dp rank holds a whole copy
    tp: int = 1  # ranks that split each layer of one copy
    # An elastic job's world need not divide the batch: each replica's share is batch_size //
    # dp rows or one more (share_of), and its loss is weighted by its share of the batch.
    # "global": the batch is the same on every world of the job's range; "per_rank": each
    # rank's is, and batch_size is this world's (launch.elastic_batch). None: a fixed world.
    elastic: ElasticBatch = None

    def __post_init__(self) -> None:
        names = ("world_size", "pp", "dp", "batch_size", "n_microbatches", "stages_per_rank", "tp")
        for name in names:
            if getattr(self, name) < 1:
                raise ValueError(f"layout: {name} must be at least 1, not {getattr(self, name)}")
        if self.pp * self.dp * self.tp != self.world_size:
            raise ValueError(
                f"layout: pp x dp x tp = {self.pp} x {self.dp} x {self.tp} must equal the world "
                f"size {self.world_size}"
            )
        if self.dp % self.dp_shard:
            raise ValueError(
                f"layout: {self.dp} data-parallel ranks do not split into shards of {self.dp_shard}"
            )
        if self.elastic and self.batch_size < self.dp * self.n_microbatches:
            raise ValueError(
                f"layout: the batch of {self.batch_size} gives {self.dp} replicas x "
                f"{self.n_microbatches} micro-batches less than a row each"
            )
        if not self.elastic and self.batch_size % (self.dp * self.n_microbatches):
            raise ValueError(
                f"layout: the batch of {self.batch_size} does not split into {self.dp} replicas "
                f"x {self.n_microbatches} micro-batches"
            )

    @property
    def n_stages(self) -> int:
        return self.pp * self.stages_per_rank

    @property
    def per_rank_batch(self) -> int:
        """Rows one rank handles per step: a pipeline's stages all see their replica's share."""
        return self.batch_size // self.dp

    def share_of(self, dp_rank: int) -> int:
        """Rows replica ``dp_rank`` handles per step: ``per_rank_batch``, or one more for the
        first ``batch_size % dp`` replicas of an elastic job."""
        return self.batch_size // self.dp + (dp_rank < self.batch_size % self.dp)

    @property
    def micro_batch(self) -> int:
        return max(1, self.per_rank_batch // self.n_microbatches)

    @property
    def reporting_rank(self) -> int:
        """The first replica of the last stage, which knows the loss (rank 0 without stages)."""
        return self.rank(pp_rank=self.pp - 1, dp_rank=0, tp_rank=0)

    def rank(self, *, pp_rank: int, dp_rank: int, tp_rank: int) -> int:
        """The rank at a place of the ``(pp, dp, tp)`` mesh."""
        return (pp_rank * self.dp + dp_rank) * self.tp + tp_rank

    @property
    def dp_replicate(self) -> int:
        """Copies of the model (each sharded over ``dp_shard`` ranks)."""
        return self.dp // self.dp_shard

    def dp_rank(self, rank: int) -> int:
        """Which replica ``rank`` is, and so which shard of the data it reads."""
        return rank // self.tp % self.dp

    def tp_rank(self, rank: int) -> int:
        """Which part of each split layer ``rank`` holds."""
        return rank % self.tp
