"""How a job's ranks divide the work, computed once on the client and carried to every rank.

After torchtitan's ``ParallelDims``: a frozen dataclass that checks itself, with the derived
numbers as properties, so no other module divides the world or the batch again. Torch-free: the
config checks use it before anything starts.
"""

from dataclasses import dataclass
from typing import TYPE_CHECKING

from workers.strategies import STAGED

if TYPE_CHECKING:
    from workers.strategies.pipeline import PipelineConfig
    from workers.train import TrainingConfig


@dataclass(frozen=True)
class Layout:
    """The ranks as a ``(pp, dp)`` mesh, ``rank = pp_rank * dp + dp_rank``, and the batch.

    A strategy that keeps the whole model on every rank is the ``pp = 1`` case: every rank is a
    replica. Replicas read different data; the ``pp`` ranks of a pipeline read the same.
    """

    world_size: int
    pp: int  # ranks per pipeline, each holding stages_per_rank consecutive-in-turn stages
    dp: int  # replicas
    batch_size: int  # global, per optimizer step
    n_microbatches: int = 1  # forward passes per rank and step: accumulation or the pipeline's
    stages_per_rank: int = 1

    def __post_init__(self) -> None:
        for name in ("world_size", "pp", "dp", "batch_size", "n_microbatches", "stages_per_rank"):
            if getattr(self, name) < 1:
                raise ValueError(f"layout: {name} must be at least 1, not {getattr(self, name)}")
        if self.pp * self.dp != self.world_size:
            raise ValueError(
                f"layout: pp x dp = {self.pp} x {self.dp} must equal the world size "
                f"{self.world_size}"
            )
        if self.batch_size % (self.dp * self.n_microbatches):
            raise ValueError(
                f"layout: the batch of {self.batch_size} does not split into {self.dp} replicas "
                f"x {self.n_microbatches} micro-batches"
            )

    @classmethod
    def of(
        cls, training: "TrainingConfig", pipeline: "PipelineConfig", *, world_size: int
    ) -> "Layout":
        """The layout of ``training.strategy`` on ``world_size`` ranks; a ``ValueError`` naming
        the config field where they cannot share the work."""
        strategy, batch = training.strategy, training.batch_size
        if strategy not in STAGED:
            if batch < world_size:
                raise ValueError(
                    f"training.batch_size: {batch} is smaller than the world size "
                    f"{world_size}; every rank needs at least one sample per step"
                )
            if batch % (world_size * training.grad_accum_steps):
                raise ValueError(
                    f"training.batch_size: {batch} must be a multiple of world size x "
                    f"grad_accum_steps = {world_size} x {training.grad_accum_steps}"
                )
            return cls(
                world_size=world_size,
                pp=1,
                dp=world_size,
                batch_size=batch,
                n_microbatches=training.grad_accum_steps,
            )
        dp = pipeline.dp
        if world_size % dp:
            raise ValueError(
                f"pipeline.dp: {world_size} workers do not split into replicas of {dp}; "
                f"pp x dp must equal the worker count (set launch.world_size to a multiple "
                f"of {dp})"
            )
        pp = world_size // dp
        if strategy == "model_parallel" and pp < 2:
            raise ValueError(
                "launch.world_size: model_parallel needs at least 2 workers to hold 2 stages"
            )
        # Model parallel is a pipeline of one micro-batch: one stage works at a time.
        m = pipeline.n_microbatches if strategy == "pipeline" else 1
        if batch % (dp * m):
            raise ValueError(
                f"training.batch_size: {batch} must be a multiple of pipeline.dp x "
                f"pipeline.n_microbatches = {dp} x {m}, so every micro-batch has the same shape"
            )
        return cls(
            world_size=world_size,
            pp=pp,
            dp=dp,
            batch_size=batch,
            n_microbatches=m,
            stages_per_rank=pipeline.stages_per_rank,
        )

    @property
    def n_stages(self) -> int:
        return self.pp * self.stages_per_rank

    @property
    def per_rank_batch(self) -> int:
        """Rows one rank handles per step: a pipeline's stages all see their replica's share."""
        return self.batch_size // self.dp

    @property
    def micro_batch(self) -> int:
        return max(1, self.per_rank_batch // self.n_microbatches)

    @property
    def reporting_rank(self) -> int:
        """The first replica of the last stage, which knows the loss (rank 0 without stages)."""
        return (self.pp - 1) * self.dp

    def dp_rank(self, rank: int) -> int:
        """Which replica ``rank`` is, and so which shard of the data it reads."""
        return rank % self.dp
