"""The built-in models, by name: ``cifar_cnn``, ``small_resnet``, ``gpt``.

Models are plain ``nn.Module`` code: they never import torch.distributed, so the same class
trains in one process, under DDP, or split into stages.
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from workers.model_sources.base import Factory, ModelError


class CifarCNN(nn.Sequential):
    """The seed article's CIFAR-10 network: two conv/pool blocks and two linear layers.

    A flat ``nn.Sequential`` with named children so that later strategies can cut it into stages
    at named points (``conv1`` … ``fc2``).
    """

    def __init__(self, num_classes: int = 10, in_channels: int = 3, image_size: int = 32) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, 16, kernel_size=3, padding=1)
        self.relu1 = nn.ReLU()
        self.pool1 = nn.MaxPool2d(2)
        self.conv2 = nn.Conv2d(16, 32, kernel_size=3, padding=1)
        self.relu2 = nn.ReLU()
        self.pool2 = nn.MaxPool2d(2)
        self.flatten = nn.Flatten()
        self.fc1 = nn.Linear(32 * (image_size // 4) ** 2, 64)
        self.relu3 = nn.ReLU()
        self.fc2 = nn.Linear(64, num_classes)


class ResidualBlock(nn.Module):
    """Two 3x3 convolutions with a skip connection (no batch norm: micro-batches of a pipeline
    would each see other statistics than the whole batch, and the numbers would drift)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, kernel_size=3, padding=1)
        self.conv2 = nn.Conv2d(channels, channels, kernel_size=3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x + self.conv2(torch.relu(self.conv1(x))))


class SmallResNet(nn.Sequential):
    """A small residual network whose layers cost very different amounts.

    Most of the work sits in the four full-resolution blocks at the front and little in the
    downsampled tail, so cutting it into stages with equal numbers of layers leaves the later
    stages idle: the case the stage planner exists for.
    """

    def __init__(self, num_classes: int = 10, in_channels: int = 3, image_size: int = 32) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(in_channels, 32, kernel_size=3, padding=1), nn.ReLU())
        self.block1 = ResidualBlock(32)
        self.block2 = ResidualBlock(32)
        self.block3 = ResidualBlock(32)
        self.block4 = ResidualBlock(32)
        self.down1 = nn.Sequential(nn.Conv2d(32, 64, 3, stride=2, padding=1), nn.ReLU())
        self.block5 = ResidualBlock(64)
        self.down2 = nn.Sequential(nn.Conv2d(64, 128, 3, stride=2, padding=1), nn.ReLU())
        self.block6 = ResidualBlock(128)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.flatten = nn.Flatten()
        self.fc = nn.Linear(128, num_classes)


class CausalSelfAttention(nn.Module):
    """Multi-head attention over earlier positions only, with separate q, k, v projections so
    that a tensor-parallel plan can split them by heads (``workers/tensor_plans.py``)."""

    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        if dim % n_heads:
            raise ValueError(f"model.kwargs: dim {dim} is not a multiple of n_heads {n_heads}")
        self.n_heads, self.head_dim = n_heads, dim // n_heads
        self.wq, self.wk, self.wv = (nn.Linear(dim, dim) for _ in range(3))
        self.wo = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape

        def heads(projection: nn.Linear) -> torch.Tensor:
            # -1, not n_heads: under tensor parallelism a rank holds only its share of heads.
            return projection(x).view(batch, length, -1, self.head_dim).transpose(1, 2)

        out = F.scaled_dot_product_attention(
            heads(self.wq), heads(self.wk), heads(self.wv), is_causal=True
        )
        return self.wo(out.transpose(1, 2).reshape(batch, length, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden)
        self.w2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x)))


class TransformerBlock(nn.Module):
    """Pre-norm attention and feed-forward, each with a residual connection."""

    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.attention_norm = nn.LayerNorm(dim)
        self.attention = CausalSelfAttention(dim, n_heads)
        self.ffn_norm = nn.LayerNorm(dim)
        self.feed_forward = FeedForward(dim, 4 * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class GPT(nn.Module):
    """A small GPT-style language model: token and position embeddings, ``n_layers`` blocks,
    and a head giving next-token logits ``(batch, length, vocabulary)``.

    ``num_classes`` is the vocabulary and ``sequence_length`` the longest input, both filled in
    from a text store (``data.dataset = "text"``). Tokens may arrive as any dtype holding
    integers: they are indices, cast here.

    A pipeline cuts it between blocks by keeping, in each stage, a copy of it without the parts
    other stages hold (``pipeline_blocks``, torchtitan's way; ``workers/stage_cuts.py``): so the
    blocks are an ``nn.ModuleDict`` (a stage's keep their names, ``layers.3``), and ``forward``
    skips the embeddings and the head where they are None. The stages stay plain modules, which
    a tensor-parallel plan can split as it splits the whole model.
    """

    pipeline_blocks = "layers"

    def __init__(
        self,
        num_classes: int = 256,
        sequence_length: int = 64,
        dim: int = 64,
        n_layers: int = 2,
        n_heads: int = 4,
    ) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(num_classes, dim)
        self.pos_embeddings = nn.Embedding(sequence_length, dim)
        self.layers = nn.ModuleDict(
            {str(i): TransformerBlock(dim, n_heads) for i in range(n_layers)}
        )
        self.norm = nn.LayerNorm(dim)
        self.output = nn.Linear(dim, num_classes, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = tokens  # a later pipeline stage receives the activations instead
        if self.tok_embeddings is not None:
            tokens = tokens.long()
            positions = torch.arange(tokens.shape[1], device=tokens.device)
            x = self.tok_embeddings(tokens) + self.pos_embeddings(positions)
        for layer in self.layers.values():
            x = layer(x)
        if self.output is None:
            return x
        return self.output(self.norm(x))


MODELS: dict[str, Callable[..., nn.Module]] = {
    "cifar_cnn": CifarCNN,
    "small_resnet": SmallResNet,
    "gpt": GPT,
}


def factory(target: str) -> Factory:
    if target not in MODELS:
        raise ModelError(f"model.name: unknown model {target!r}; choose one of {sorted(MODELS)}")
    return Factory.of(MODELS[target], label=target)
