"""Single-process reference training: the yardstick every strategy must match."""

from collections.abc import Callable, Mapping

import torch
from torch import nn

from workers.data import as_features, open_store, rank_epoch_indices
from workers.losses import Criterion
from workers.models import build_model
from workflows.config import RunConfig


def train_in_one_process(
    config: RunConfig,
    *,
    world_size: int,
    steps: int,
    device: str = "cpu",
    factory: Callable[..., nn.Module] | None = None,
    then: tuple[int, int] | None = None,
) -> dict:
    """``steps`` SGD steps on the full global batches that ``world_size`` ranks would see, on
    ``device``; the parameters come back on the CPU. ``then=(world_size, steps)``: that many
    more steps on what another world size's ranks read from the same place in the epoch, as
    a run resumed at that size from a checkpoint continues.

    Each step takes the ranks' batches at that step, and each micro-batch of them (a
    pipeline's, or gradient accumulation's), through the model one by one, and averages their
    mean losses: what DDP optimizes, in the shapes the ranks compute. The model and the loss
    are the config's (``factory``: a model given in Python, as to ``train``).
    """
    t, d = config.training, config.data.resolved()
    pipelined = t.strategy == "pipeline"  # what each rank's share is cut into
    micro_batches = config.pipeline.n_microbatches if pipelined else t.grad_accum_steps
    store = open_store(d.store_url)
    images = torch.from_numpy(as_features(store.train.images[:], tokens=store.train.tokens))
    images = images.to(device)
    labels = torch.from_numpy(store.train.labels).to(device)
    criterion = Criterion.of(t)
    model = build_model(
        config.model,
        num_classes=criterion.outputs(store.num_classes),
        seed=t.seed,
        input_shape=tuple(images.shape[1:]),
        factory=factory,
    ).to(device)
    optimizer = torch.optim.SGD(
        model.parameters(), lr=t.lr, momentum=t.momentum, weight_decay=t.weight_decay
    )
    done, epoch, batch = 0, 0, 0  # batch: the next one of that epoch
    for ranks, phase_steps in [(world_size, steps), *([then] if then else [])]:
        per_rank, goal = t.batch_size // ranks, done + phase_steps
        while done < goal:
            shards = [
                rank_epoch_indices(
                    len(labels),
                    world_size=ranks,
                    rank=rank,
                    epoch=epoch,
                    seed=t.seed,
                    chunk_size=store.train.chunk_size,
                    shuffle_window=d.shuffle_window,
                    drop_last=d.drop_last,
                )
                for rank in range(ranks)
            ]
            n = len(shards[0])
            batches = n // per_rank if d.drop_last else -(-n // per_rank)
            while batch < batches and done < goal:
                start = batch * per_rank
                optimizer.zero_grad()
                # Each rank's share, and each micro-batch of it, through the model on its own as
                # the rank computes it: the same mean, and the same tensor shapes, so that the
                # kernels (whose choice and rounding follow the shapes) are the ranks'.
                pieces = [
                    piece
                    for share in shards
                    for piece in torch.from_numpy(share[start : start + per_rank]).chunk(
                        micro_batches
                    )
                ]
                for piece in pieces:
                    piece = piece.to(device)
                    (criterion(model(images[piece]), labels[piece]) / len(pieces)).backward()
                if t.grad_clip_norm is not None:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip_norm)
                optimizer.step()
                done, batch = done + 1, batch + 1
            if batch == batches:
                epoch, batch = epoch + 1, 0
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


# What "the same parameters" means after a few steps in float32. The strategy and the reference
# compute each rank's micro-batches in the same shapes (train_in_one_process), so that each
# picks the same kernels, and sum their gradients in another order (per rank, then across
# ranks): each step's parameters differ by a few float32 ulps (eps 1.2e-7) of the update, on
# every kernel path (AVX-512, AVX2, plain C: another CPU). Few steps (<= 5 here) and a moderate
# step (SGD_FEW_STEPS) keep that from growing. Measured on an AMD EPYC, native AVX2 and
# ATEN_CPU_CAPABILITY=default: the worst case is 1% of this tolerance at lr 0.02 and 10% at
# lr 0.1. A reference that ran each global batch as one (other shapes, other kernels: a
# max-pool's near-ties break the other way) reached 6e-5 at lr 0.1 (a pipeline's conv1; 1e-6
# is allowed) and 93% of the tolerance at lr 0.02 on the same machine. A strategy's real
# mistakes (a wrong shard, a resume from the wrong place) move parameters by 1e-4 or more.
SGD_FEW_STEPS = {"lr": 0.02, "momentum": 0.9}
FEW_STEPS_FLOAT32 = {"rtol": 1e-5, "atol": 1e-6}


def assert_same_parameters(
    got: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor], **tolerance: float
) -> None:
    """``got`` holds every tensor of ``expected`` under the same names, and no other, each equal
    within ``tolerance`` (``torch.testing.assert_close``'s rtol and atol; FEW_STEPS_FLOAT32 if
    none)."""
    tolerance = tolerance or FEW_STEPS_FLOAT32
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(
            got[name], value, msg=lambda detail, name=name: f"{name}: {detail}", **tolerance
        )
