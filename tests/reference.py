"""Single-process reference training: the yardstick every strategy must match."""

import torch
import torch.nn.functional as F
from torch.utils.data import DistributedSampler

from workers.data import load_dataset
from workers.models import build_model
from workflows.config import RunConfig


def train_in_one_process(config: RunConfig, *, world_size: int, steps: int) -> dict:
    """``steps`` SGD steps on the full global batches that ``world_size`` ranks would see.

    Each global batch is the concatenation of the ranks' DistributedSampler batches; the mean
    loss over it equals the mean of the ranks' mean losses, which is what DDP optimizes.
    """
    t = config.training
    data = load_dataset(config.data, seed=t.seed)
    model = build_model(config.model.name, num_classes=data.num_classes, seed=t.seed)
    optimizer = torch.optim.SGD(
        model.parameters(), lr=t.lr, momentum=t.momentum, weight_decay=t.weight_decay
    )
    per_rank = t.batch_size // world_size
    samplers = [
        DistributedSampler(
            range(len(data.train_x)), num_replicas=world_size, rank=r, shuffle=True, seed=t.seed
        )
        for r in range(world_size)
    ]
    done, epoch = 0, 0
    while done < steps:
        for sampler in samplers:
            sampler.set_epoch(epoch)
        shards = [list(sampler) for sampler in samplers]
        for start in range(0, len(shards[0]), per_rank):
            if done == steps or (config.data.drop_last and start + per_rank > len(shards[0])):
                break
            index = torch.tensor([i for shard in shards for i in shard[start : start + per_rank]])
            optimizer.zero_grad()
            F.cross_entropy(model(data.train_x[index]), data.train_y[index]).backward()
            optimizer.step()
            done += 1
        epoch += 1
    return {k: v.detach().clone() for k, v in model.state_dict().items()}
