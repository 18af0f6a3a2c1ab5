"""The per-rank training loop: config, build, train, close, top to bottom.

``run_rank`` is the Dask task each rank runs; ``train`` is the loop itself and only needs an
initialized process group, so the torchrun benchmark runs the very same code.
"""

import math
import time
from collections.abc import Callable, Iterable
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from workers.checkpoint import CheckpointConfig, Progress, load_checkpoint, save_checkpoint
from workers.config_models import STAGED, STRATEGIES, TrainingConfig
from workers.data import (
    DataConfig,
    RankBatches,
    StoreSplit,
    eval_batches,
    fixed_shape_eval_batches,
    open_store,
)
from workers.models import ModelConfig, build_model
from workers.process_group import Membership, current_membership
from workers.strategies.data_parallel import apply_data_parallel
from workers.strategies.ddp import apply_ddp
from workers.strategies.pipeline import (
    Pipeline,
    PipelineConfig,
    apply_pipeline,
    clip_grad_norm,
    full_state_dict,
)


@dataclass(frozen=True)
class TrainJob:
    """What every rank of one job receives."""

    data: DataConfig  # resolved: absolute paths, store URL filled in
    model: ModelConfig
    training: TrainingConfig
    generation: str
    event_topic: str
    # Staged strategies: split_points resolved by the client, so every rank cuts alike.
    pipeline: PipelineConfig | None = None
    # Where checkpoints go (None: nowhere), and the verified one to continue from.
    checkpoint: CheckpointConfig | None = None
    resume_from: str | None = None
    heartbeat_topic: str | None = None


@dataclass
class RankResult:
    rank: int
    history: list[dict[str, float]]
    steps: int
    samples_per_s: float
    steady_samples_per_s: float
    first_step_at: float
    state_dict: dict[str, torch.Tensor] | None = field(default=None, repr=False)


def run_rank(job: TrainJob) -> RankResult:
    """The Dask task of one rank: look up this worker's membership, then train."""
    from distributed import get_worker

    membership = current_membership(job.generation)
    worker = get_worker()

    def report(record: dict[str, Any]) -> None:
        worker.log_event(job.event_topic, record)

    last_beat, first_steps = [-math.inf, 0], set()
    staged = job.pipeline is not None and job.training.strategy in STAGED
    # The samples one step of this rank handles: a stage sees its whole replica's share.
    per_step = job.training.batch_size // (job.pipeline.dp if staged else membership.world_size)

    def heartbeat(step: int) -> None:
        # At most one event a second per rank, enough to see a stopped rank; but always the
        # first two steps, which end the long first-step bound on the client.
        now = time.monotonic()
        if job.heartbeat_topic and (now - last_beat[0] >= 1.0 or len(first_steps) < 2):
            beat = {"rank": membership.rank, "step": step}
            if first_steps and step > last_beat[1]:
                beat["samples_per_s"] = (step - last_beat[1]) * per_step / (now - last_beat[0])
            last_beat[:] = [now, step]
            first_steps.add(step)
            worker.log_event(job.heartbeat_topic, beat)

    return train(
        job.data,
        job.model,
        job.training,
        membership=membership,
        pipeline=job.pipeline,
        checkpoint=job.checkpoint,
        resume_from=job.resume_from,
        report=report,
        heartbeat=heartbeat,
    )


def train(
    data_config: DataConfig,
    model_config: ModelConfig,
    config: TrainingConfig,
    *,
    membership: Membership,
    pipeline: PipelineConfig | None = None,
    checkpoint: CheckpointConfig | None = None,
    resume_from: str | None = None,
    report: Callable[[dict[str, Any]], None] | None = None,
    heartbeat: Callable[[int], None] | None = None,
) -> RankResult:
    rank, world_size, device = membership.rank, membership.world_size, membership.device
    torch.manual_seed(config.seed + rank)
    precision = _Precision(config.precision, device)

    # Build: model and strategy, then this rank's data shard, optimizer and schedule.
    store = open_store(data_config.store_url, storage_options=data_config.storage_options)
    model = build_model(
        model_config.name,
        num_classes=store.num_classes,
        seed=config.seed,
        image_size=data_config.image_size,
    )
    pipe: Pipeline | None = None
    if config.strategy in STAGED:
        assert pipeline is not None and pipeline.split_points is not None
        # Model parallel is a pipeline of one micro-batch: one stage works at a time.
        pipe = apply_pipeline(
            model,
            config=pipeline,
            split_points=pipeline.split_points,
            n_microbatches=1 if config.strategy == "model_parallel" else pipeline.n_microbatches,
            loss_fn=F.cross_entropy,
            device=device,
        )
        # Replicas of the same stages read different data; the stages of a row read the same.
        data_rank, data_world = pipe.dp_rank, pipe.dp_size
        parameters = pipe.parameters()
        # The last stage knows the loss, so its first replica reports.
        reporter = rank == world_size - pipe.dp_size
    else:
        model = _apply_strategy(config.strategy, model, device=device)
        data_rank, data_world = rank, world_size
        parameters = list(model.parameters())
        reporter = rank == 0
    per_rank_batch = config.batch_size // data_world
    micro_batch = max(1, per_rank_batch // config.grad_accum_steps)
    batches = RankBatches(
        store.train,
        data_config,
        rank=data_rank,
        world_size=data_world,
        batch_size=per_rank_batch,
        seed=config.seed,
    )
    optimizer = torch.optim.SGD(
        parameters, lr=config.lr, momentum=config.momentum, weight_decay=config.weight_decay
    )
    total_steps = config.epochs * len(batches)
    if config.max_steps is not None:
        total_steps = min(total_steps, config.max_steps)
    # Continue where a checkpoint left off: parameters, optimizer, scaler, RNG, data position.
    modules = pipe.stages if pipe is not None else [model]
    progress = Progress()
    if resume_from is not None:
        progress = load_checkpoint(
            resume_from,
            modules=modules,
            optimizer=optimizer,
            scaler=precision.scaler,
            signing_key_file=getattr(checkpoint, "signing_key_file", None),
        )
    # last_epoch puts the schedule at the resumed step; it scales each group's initial_lr.
    for group in optimizer.param_groups:
        group.setdefault("initial_lr", config.lr)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, _lr_factor(config, total_steps), last_epoch=progress.step - 1
    )
    if heartbeat:
        heartbeat(progress.step)
    # Throughput is measured from the end of this step on: the first steps pay one-off costs.
    warm_step = min(3, (total_steps - progress.step) // 4)

    def save(at: Progress) -> None:
        assert checkpoint is not None and checkpoint.directory is not None
        save_checkpoint(
            checkpoint.directory,
            modules=modules,
            optimizer=optimizer,
            scaler=precision.scaler,
            progress=at,
            keep=checkpoint.keep,
            signing_key_file=checkpoint.signing_key_file,
        )
        if heartbeat:
            heartbeat(step)

    if report and reporter:
        report(
            {
                "kind": "start",
                "strategy": config.strategy,
                "world_size": world_size,
                "epochs": config.epochs,
                "total_steps": total_steps,
            }
        )

    # Train.
    history: list[dict[str, float]] = list(progress.history)
    step, samples_seen, warm_samples, run_steps = progress.step, 0, 0, 0
    first_step_at = math.nan
    saving = checkpoint is not None and checkpoint.directory is not None
    # Seconds spent in training loops (validation excluded), in total and up to the warm step.
    loop_seconds, warm_seconds = 0.0, math.nan
    for epoch in range(progress.epoch, config.epochs):
        if step >= total_steps:
            break
        (pipe or model).train()
        resumed = epoch == progress.epoch
        start_batch = progress.batch if resumed else 0
        # Running totals stay on the device: no host sync inside the step.
        sums0 = progress.sums if resumed else [0.0, 0.0, 0.0]
        loss_sum = torch.tensor(sums0[0], dtype=torch.float64, device=device)
        correct = torch.tensor(int(sums0[1]), dtype=torch.int64, device=device)
        count = counted_before = int(sums0[2])
        epoch_started = time.perf_counter()
        for batch, (x, y) in enumerate(batches.epoch(epoch, start_batch=start_batch), start_batch):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            optimizer.zero_grad(set_to_none=True)
            if pipe is not None:
                # The schedule cuts the batch into micro-batches, runs forward and backward
                # through every stage and averages the gradients over micro-batches.
                losses: list[torch.Tensor] = []
                with precision.autocast():
                    logits = pipe.schedule.step(
                        *([x] if pipe.is_first else []),
                        target=y if pipe.is_last else None,
                        losses=losses if pipe.is_last else None,
                    )
                if pipe.is_last:
                    # Micro-batches are equal in size, so their mean loss is the batch's.
                    loss = torch.stack(losses).detach().mean()
                    loss_sum += loss.double() * len(y)
                    correct += (logits.argmax(1) == y).sum()
                    count += len(y)
            else:
                micro_batches = list(zip(x.split(micro_batch), y.split(micro_batch), strict=True))
                for i, (mx, my) in enumerate(micro_batches):
                    # Only the last micro-batch all-reduces; the others accumulate locally.
                    last = i == len(micro_batches) - 1
                    sync = nullcontext() if last else getattr(model, "no_sync", nullcontext)()
                    with sync:
                        with precision.autocast():
                            logits = model(mx)
                            loss = F.cross_entropy(logits, my)
                        # Weight by share of the rank's batch: accumulation equals one batch.
                        precision.scale(loss * (len(my) / len(y))).backward()
                    loss_sum += loss.detach().double() * len(my)
                    correct += (logits.argmax(1) == my).sum()
                    count += len(my)
            if config.grad_clip_norm is not None:
                precision.unscale(optimizer)
                if pipe is not None:
                    clip_grad_norm(pipe, config.grad_clip_norm)
                else:
                    nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip_norm)
            precision.step(optimizer)
            schedule.step()
            step += 1
            run_steps += 1
            samples_seen += len(y) * data_world
            if heartbeat:
                heartbeat(step)
            if run_steps == 1:
                first_step_at = time.time()
            if run_steps == warm_step:
                warm_seconds = loop_seconds + time.perf_counter() - epoch_started
                warm_samples = samples_seen
            if (
                report
                and reporter
                and config.log_every_steps
                and step % config.log_every_steps == 0
            ):
                report({"kind": "step", "epoch": epoch + 1, "step": step, "loss": loss.item()})
            last_of_epoch = batch == len(batches) - 1
            if step >= total_steps:
                break
            # Every N steps, except at an epoch's end: that checkpoint follows in a moment.
            every = checkpoint.every_steps if saving else 0
            if every and step % every == 0 and not last_of_epoch:
                running = [loss_sum.item(), float(correct.item()), float(count)]
                save(Progress(epoch, batch + 1, step, running, history))
        train_seconds = time.perf_counter() - epoch_started
        loop_seconds += train_seconds

        # Ranks without the last stage add zeros: the sum counts each sample once.
        sums = torch.stack([loss_sum, correct.double(), loss_sum.new_tensor(float(count))])
        dist.all_reduce(sums)
        if pipe is not None:
            val = _evaluate_pipeline(
                pipe, store.val, batch_size=per_rank_batch, device=device, precision=precision
            )
        else:
            val = _evaluate(
                model,
                eval_batches(
                    store.val, rank=rank, world_size=world_size, batch_size=per_rank_batch
                ),
                device=device,
                precision=precision,
            )
        if heartbeat:
            heartbeat(step)  # validation is progress too
        loss_sum, correct, count = sums.tolist()
        record = {
            "kind": "epoch",
            "epoch": epoch + 1,
            "epochs": config.epochs,
            "step": step,
            "loss": loss_sum / count,
            "accuracy": correct / count,
            "val_loss": val["loss"],
            "val_accuracy": val["accuracy"],
            "samples_per_s": (count - counted_before) / train_seconds,
            "lr": schedule.get_last_lr()[0],
        }
        history.append(record)
        if report and reporter:
            report(record)
        if saving and (checkpoint.at_epoch_end or step >= total_steps):
            save(Progress(epoch + 1, 0, step, [0.0, 0.0, 0.0], history))

    # Close: one throughput figure for the whole run, and the parameters for the client: rank
    # 0's whole model, or each stage's from its first replica.
    # A run resumed from its final checkpoint has nothing left to train: it hands back the
    # checkpoint's parameters and history.
    overall = samples_seen / loop_seconds if loop_seconds else 0.0
    steady = (samples_seen - warm_samples) / (loop_seconds - warm_seconds) if warm_step else overall
    state_dict = None
    if pipe is not None:
        stage_state = full_state_dict(pipe)  # gathers FSDP shards: every replica takes part
        state_dict = stage_state if pipe.dp_rank == 0 else None
    elif rank == 0:
        state_dict = {k: v.detach().cpu().clone() for k, v in _unwrap(model).state_dict().items()}
    return RankResult(
        rank=rank,
        history=history,
        steps=step,
        samples_per_s=overall,
        steady_samples_per_s=steady,
        first_step_at=first_step_at,
        state_dict=state_dict,
    )


@torch.no_grad()
def _evaluate(
    model: nn.Module,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    *,
    device: torch.device,
    precision: "_Precision",
) -> dict[str, float]:
    model.eval()
    # The plain module: DDP's forward would try to sync buffers in the middle of uneven shards.
    module = _unwrap(model)
    sums = torch.zeros(3, dtype=torch.float64, device=device)
    for x, y in batches:
        x, y = x.to(device), y.to(device)
        with precision.autocast():
            logits = module(x)
        sums[0] += F.cross_entropy(logits.float(), y, reduction="sum").double()
        sums[1] += (logits.argmax(1) == y).sum().double()
        sums[2] += len(y)
    if dist.is_initialized():
        dist.all_reduce(sums)
    loss_sum, correct, count = sums.tolist()
    return {"loss": loss_sum / max(count, 1), "accuracy": correct / max(count, 1)}


@torch.no_grad()
def _evaluate_pipeline(
    pipe: Pipeline,
    split: StoreSplit,
    *,
    batch_size: int,
    device: torch.device,
    precision: "_Precision",
) -> dict[str, float]:
    pipe.train(False)
    sums = torch.zeros(3, dtype=torch.float64, device=device)
    for x, y, real in fixed_shape_eval_batches(
        split, rank=pipe.dp_rank, world_size=pipe.dp_size, batch_size=batch_size
    ):
        with precision.autocast():
            # Forward only: no activations are kept for a backward that never comes.
            # The schedule computes its loss_fn on the last stage too; padded rows make that
            # loss wrong, so the sums below come from the real rows of the logits instead.
            logits = pipe.schedule.eval(
                *([x.to(device)] if pipe.is_first else []),
                target=y.to(device) if pipe.is_last else None,
            )
        if pipe.is_last:
            logits, y = logits[:real].float(), y[:real].to(device)
            sums[0] += F.cross_entropy(logits, y, reduction="sum").double()
            sums[1] += (logits.argmax(1) == y).sum().double()
            sums[2] += real
    dist.all_reduce(sums)
    loss_sum, correct, count = sums.tolist()
    return {"loss": loss_sum / max(count, 1), "accuracy": correct / max(count, 1)}


def _apply_strategy(strategy: str, model: nn.Module, *, device: torch.device) -> nn.Module:
    if strategy == "ddp":
        return apply_ddp(model, device=device)
    if strategy == "data_parallel":
        return apply_data_parallel(model, device=device)
    raise ValueError(
        f"training.strategy: unknown strategy {strategy!r}; choose one of {STRATEGIES}"
    )


def _unwrap(model: nn.Module) -> nn.Module:
    return model.module if hasattr(model, "module") else model


def _lr_factor(config: TrainingConfig, total_steps: int) -> Callable[[int], float]:
    def factor(step: int) -> float:
        if step < config.warmup_steps:
            return (step + 1) / config.warmup_steps
        if config.lr_schedule == "cosine":
            span = max(1, total_steps - config.warmup_steps)
            return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - config.warmup_steps) / span)))
        return 1.0

    return factor


class _Precision:
    """Autocast and loss scaling for one precision setting on one device."""

    def __init__(self, precision: str, device: torch.device) -> None:
        if precision == "fp16" and device.type != "cuda":
            raise ValueError(
                "training.precision: fp16 needs a CUDA device (it uses a GradScaler); "
                "use 'bf16' on CPU"
            )
        self.dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
        self.device = device
        self.scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")

    def autocast(self):  # type: ignore[no-untyped-def]
        if self.dtype is None:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss)

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        self.scaler.step(optimizer)
        self.scaler.update()
