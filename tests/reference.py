"""Single-process reference training: the yardstick every strategy must match."""

from collections.abc import Callable, Mapping

import numpy as np
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

    Each global batch is the concatenation of the ranks' batches at that step; the mean loss over
    it equals the mean of the ranks' mean losses, which is what DDP optimizes. The model and
    the loss are the config's (``factory``: a model given in Python, as to ``train``).
    """
    t, d = config.training, config.data.resolved()
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
                index = np.concatenate([s[start : start + per_rank] for s in shards])
                index = torch.from_numpy(index).to(device)
                optimizer.zero_grad()
                criterion(model(images[index]), labels[index]).backward()
                if t.grad_clip_norm is not None:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip_norm)
                optimizer.step()
                done, batch = done + 1, batch + 1
            if batch == batches:
                epoch, batch = epoch + 1, 0
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


# What "the same parameters" means after a few steps in float32. The strategy and the reference
# sum the same per-sample gradients in another order (per rank, then across ranks; or per
# micro-batch, or per stage), and each kernel path (AVX-512, AVX2, plain C: another CPU) blocks
# its reductions its own way: each step's parameters differ by a few float32 ulps (eps 1.2e-7)
# of the update. Few steps (<= 5 here, at the tests' lr 0.1 and momentum 0.9) keep that
# from growing: measured under ATEN_CPU_CAPABILITY=avx512 and =default, at most 3e-8 absolute
# (parameters are ~1e-3 to 1). Eight steps of batch 256 already reached 2e-5, and rounding
# then grows about tenfold every five steps: more steps test the CPU, not the strategy.
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
