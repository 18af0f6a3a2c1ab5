"""How a job's ranks divide the work, computed once on the client and carried to every rank.

After torchtitan's ``ParallelDims``: a frozen dataclass that checks itself, with the derived
numbers as properties, so no other module divides the world or the batch again. Torch-free: the
config checks use it before anything starts.
"""

from dataclasses import dataclass
from typing import TYPE_CHECKING

from workers.strategies import SHARDED, STAGED

if TYPE_CHECKING:
    from workers.config_models import ParallelConfig, PipelineConfig, TrainingConfig


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
        if self.batch_size % (self.dp * self.n_microbatches):
            raise ValueError(
                f"layout: the batch of {self.batch_size} does not split into {self.dp} replicas "
                f"x {self.n_microbatches} micro-batches"
            )

    @classmethod
    def of(
        cls,
        training: "TrainingConfig",
        pipeline: "PipelineConfig",
        *,
        world_size: int,
        parallel: "ParallelConfig | None" = None,
    ) -> "Layout":
        """The layout of ``training.strategy`` on ``world_size`` ranks; a ``ValueError`` naming
        the config field where they cannot share the work."""
        strategy, batch = training.strategy, training.batch_size
        tp = _tp_degree(strategy, parallel, world_size=world_size)
        if strategy in STAGED:
            return cls._staged(training, pipeline, parallel, world_size=world_size, tp=tp)
        if parallel is not None and (parallel.pp or 1) > 1:
            raise ValueError(
                f"parallel.pp: {strategy} keeps the whole model on every rank; stages are "
                "strategy = 'pipeline' or 'model_parallel'"
            )
        dp = world_size // tp
        shard = _shard_degree(strategy, parallel, world_size=dp)
        # Each data-parallel rank reads its own share; the tp ranks of one read the same.
        readers = "world size" if tp == 1 else "data-parallel ranks (world size / tp)"
        if batch < dp:
            raise ValueError(
                f"training.batch_size: {batch} is smaller than the {readers} {dp}; every "
                "rank needs at least one sample per step"
            )
        if batch % (dp * training.grad_accum_steps):
            raise ValueError(
                f"training.batch_size: {batch} must be a multiple of {readers} x "
                f"grad_accum_steps = {dp} x {training.grad_accum_steps}"
            )
        return cls(
            world_size=world_size,
            pp=1,
            dp=dp,
            batch_size=batch,
            n_microbatches=training.grad_accum_steps,
            dp_shard=shard,
            tp=tp,
        )

    @classmethod
    def _staged(
        cls,
        training: "TrainingConfig",
        pipeline: "PipelineConfig",
        parallel: "ParallelConfig | None",
        *,
        world_size: int,
        tp: int,
    ) -> "Layout":
        strategy, batch = training.strategy, training.batch_size
        # The tp ranks of each stage's replica split its layers: the stages and their
        # replicas share what is left.
        pp, dp, shard = _stage_degrees(pipeline, parallel, world_size=world_size, tp=tp)
        if strategy == "model_parallel" and pp < 2:
            raise ValueError(
                "launch.world_size: model_parallel needs at least 2 workers to hold 2 stages"
            )
        if strategy == "model_parallel" and dp > 1:
            field = "parallel.pp" if parallel is not None and parallel.pp else "pipeline.dp"
            raise ValueError(
                f"{field}: model_parallel runs one copy of the model, one stage per rank, and "
                f"{pp} stages on {world_size // tp} ranks leave {dp} copies; set parallel.pp = "
                f"{world_size // tp}, or use strategy = 'pipeline' for replicas"
            )
        # Model parallel is a pipeline of one micro-batch: one stage works at a time.
        m = pipeline.n_microbatches if strategy == "pipeline" else 1
        if batch % (dp * m):
            replicas = "pipeline.dp" if parallel is None or not parallel.given else "replicas"
            raise ValueError(
                f"training.batch_size: {batch} must be a multiple of {replicas} x "
                f"pipeline.n_microbatches = {dp} x {m}, so every micro-batch has the same shape"
            )
        return cls(
            world_size=world_size,
            pp=pp,
            dp=dp,
            batch_size=batch,
            n_microbatches=m,
            stages_per_rank=pipeline.stages_per_rank,
            dp_shard=shard,
            tp=tp,
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
        return (self.pp - 1) * self.dp * self.tp

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


def _stage_degrees(
    pipeline: "PipelineConfig", parallel: "ParallelConfig | None", *, world_size: int, tp: int = 1
) -> tuple[int, int, int]:
    """A staged run's ranks per row of stages (``pp``), its replicas of each stage, and how many
    of those FSDP2 shards each copy over (``dp_shard``: 1 where DDP averages whole copies; the
    replicas itself where they are all shards of one; between, HSDP's replicas of shards), on
    the ``world_size / tp`` ranks that ``tp`` leaves (each of them ``tp`` ranks splitting its
    stages' layers)."""
    whole = f"the world size {world_size}"
    if tp > 1:
        whole = f"world size / tp = {world_size} / {tp}"
        world_size //= tp
    given_pp = parallel.pp if parallel is not None else None
    shard = parallel.dp_shard if parallel is not None else None
    replicate = parallel.dp_replicate if parallel is not None else None
    given = given_stage_replicas(pipeline, parallel)
    if parallel is not None and parallel.given:
        if pipeline.dp > 1:
            raise ValueError(
                "pipeline.dp: the stages' replicas are given once; parallel.dp_shard (FSDP2) "
                "or parallel.dp_replicate (DDP) replaces pipeline.dp and pipeline.dp_mode"
            )
        # Shards (FSDP2), copies of shards (HSDP) or whole copies (DDP, dp_shard unset).
        sharded = replicate in (None, 1) or (shard or 1) > 1
        dp, field = given, "parallel.dp_shard" if sharded else "parallel.dp_replicate"
    elif given is None:  # parallel.pp alone: the replicas are what the world leaves
        if world_size % given_pp:
            raise ValueError(f"parallel.pp: {given_pp} does not divide {whole}")
        dp, sharded, field = world_size // given_pp, pipeline.dp_mode == "fsdp", "parallel.pp"
    else:
        dp, sharded, field = given, pipeline.dp_mode == "fsdp", "pipeline.dp"
    if given_pp is not None and given_pp * dp != world_size:
        raise ValueError(f"parallel: pp x replicas = {given_pp} x {dp} must equal {whole}")
    if world_size % dp:
        raise ValueError(
            f"{field}: {world_size} {'workers' if tp == 1 else 'ranks of world size / tp'} do "
            f"not split into replicas of {dp}; pp x dp{' x tp' if tp > 1 else ''} must equal "
            f"the worker count (set launch.world_size to a multiple of {dp * tp})"
        )
    if dp > 1 and not sharded:
        if tp > 1:
            raise ValueError(
                f"{field}: DDP does not average stages whose layers parallel.tp splits; give "
                "the replicas as parallel.dp_shard (FSDP2)"
            )
        pipeline.check_ddp_stages(field, "use parallel.dp_shard")
    if not sharded:
        return world_size // dp, dp, 1
    return world_size // dp, dp, dp // (replicate or 1)


def given_stage_replicas(
    pipeline: "PipelineConfig", parallel: "ParallelConfig | None"
) -> int | None:
    """A staged run's replicas of each stage as its config gives them, before any world size:
    ``parallel.dp_replicate x dp_shard``, else ``pipeline.dp``; None where ``parallel.pp``
    alone leaves them to the world size."""
    if parallel is not None and parallel.given:
        return (parallel.dp_replicate or 1) * (parallel.dp_shard or 1)
    if parallel is not None and parallel.pp is not None:
        return None
    return pipeline.dp


def _tp_degree(strategy: str, parallel: "ParallelConfig | None", *, world_size: int) -> int:
    """How many ranks split each layer (``parallel.tp``), checked against ``strategy``."""
    tp = parallel.tp if parallel is not None else 1
    if tp == 1:
        return 1
    if strategy not in SHARDED + STAGED:
        raise ValueError(
            f"parallel.tp: tensor parallelism composes with strategy = 'fsdp' or 'hsdp' (with "
            f"parallel.tp = {world_size} FSDP has one rank and only TP splits), 'pipeline' or "
            f"'model_parallel', not {strategy}"
        )
    if world_size % tp:
        raise ValueError(f"parallel.tp: {tp} does not divide the world size {world_size}")
    return tp


def _shard_degree(strategy: str, parallel: "ParallelConfig | None", *, world_size: int) -> int:
    """How many ranks ``strategy`` shards one copy of the model over, on ``world_size``."""
    given = parallel is not None and parallel.given
    if strategy not in SHARDED:
        if given:
            raise ValueError(
                f"parallel: {strategy} replicates the whole model on every rank; the "
                "dp_replicate and dp_shard degrees are for strategy = 'fsdp' or 'hsdp'"
            )
        return 1
    replicate = parallel.dp_replicate if parallel is not None else None
    shard = parallel.dp_shard if parallel is not None else None
    if strategy == "fsdp":
        if (replicate or 1) != 1 or shard not in (None, world_size):
            raise ValueError(
                f"parallel: fsdp shards over all {world_size} ranks (dp_replicate = 1, "
                f"dp_shard = {world_size}); for replicas of shards use strategy = 'hsdp'"
            )
        return world_size
    if replicate is None and shard is None:
        raise ValueError(
            "parallel.dp_shard: hsdp needs the ranks one copy is sharded over (e.g. the GPUs "
            "of one host), or parallel.dp_replicate"
        )
    for name, degree in (("dp_replicate", replicate), ("dp_shard", shard)):
        if degree is not None and world_size % degree:
            raise ValueError(
                f"parallel.{name}: {degree} does not divide the world size {world_size}"
            )
    replicate = replicate if replicate is not None else world_size // shard
    shard = shard if shard is not None else world_size // replicate
    if replicate * shard != world_size:
        raise ValueError(
            f"parallel: dp_replicate x dp_shard = {replicate} x {shard} must equal the world "
            f"size {world_size}"
        )
    return shard
