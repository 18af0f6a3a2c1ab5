"""The built-in models, and how any model is built from its ``[model]`` section.

Models are plain ``nn.Module`` code: they never import torch.distributed, so the same class
trains in one process, under DDP, or split into stages. Where a model comes from (built in,
torchvision, timm, an import path) is a source's (workers/model_sources/).
"""

import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

# Re-exported: the section's model lives in a torch-free module, for config checks.
from workers.config_models import ModelConfig as ModelConfig
from workers.model_sources import Factory, ModelError, resolve


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


def data_arguments(num_classes: int, input_shape: tuple[int, ...]) -> dict[str, int]:
    """What the data says about a model's arguments, under the names factories use for them:
    filled in where a factory takes them and the user did not set them."""
    facts = {"num_classes": num_classes, "in_features": math.prod(input_shape)}
    if len(input_shape) == 1:  # a sequence of tokens, or a row of features
        facts["sequence_length"] = input_shape[0]
    if len(input_shape) == 3:  # (channels, height, width)
        facts |= {"in_channels": input_shape[0], "in_chans": input_shape[0]}  # timm: in_chans
        if input_shape[1] == input_shape[2]:
            facts |= {"image_size": input_shape[1], "img_size": input_shape[1]}
    return facts


def model_arguments(factory: Factory, kwargs: dict[str, Any], facts: dict[str, int]) -> dict:
    """``model.kwargs`` with the data's facts added where ``factory`` names them.

    A factory with a bare ``**kwargs`` (``Factory.more``) still gets the facts its signature
    names, and ``model.kwargs`` it does not name pass through to its ``**kwargs`` unchecked:
    the user chose them. The facts it does not name are not pushed into its ``**kwargs``: such
    a factory often forwards them to something strict (``nn.Linear(**kwargs)``, a library's
    builder), which would refuse ``in_channels`` or ``img_size`` it never asked for.
    """
    if not factory.more:
        unknown = sorted(set(kwargs) - factory.parameters)
        if unknown:
            raise ModelError(
                f"model.kwargs: factory {factory.label} takes no argument {unknown[0]!r}; it "
                f"takes {sorted(factory.parameters)}"
            )
    filled = {k: v for k, v in facts.items() if k in factory.parameters and k not in kwargs}
    return filled | kwargs


def model_blocks(model: nn.Module) -> Iterator[nn.Module]:
    """The model's blocks: the members of its top-level ``nn.ModuleList`` / ``nn.ModuleDict``
    (and of the containers in them: a container is never called); else the members of the
    outermost containers below the top whose members with parameters are two or more of one
    class (torchvision's ViT: ``encoder.layers``; a ResNet's ``layer1`` ... ``layer4``); else
    its top-level children that hold trainable parameters. FSDP shards them one unit each, and
    activation checkpointing recomputes them (a transformer's blocks, as torchtitan wraps
    them). Taken as top-level children, a ViT's encoder was one unit holding 99% of the model:
    FSDP on 2 ranks peaked at 0.89x DDP's memory (``make bench-fsdp --model vit``)."""
    if any(isinstance(c, nn.ModuleList | nn.ModuleDict) for c in model.children()):
        yield from _members(model)
        return
    nested = _nested_repeats(model)
    yield from nested if nested else _members(model)


def _members(module: nn.Module) -> Iterator[nn.Module]:
    """The children that hold trainable parameters, those of containers taken from inside."""
    for child in module.children():
        if isinstance(child, nn.ModuleList | nn.ModuleDict):
            yield from _members(child)
        elif _trainable(child):
            yield child


def _trainable(module: nn.Module) -> bool:
    return any(p.requires_grad for p in module.parameters())


def _nested_repeats(model: nn.Module) -> list[nn.Module]:
    """The members of the outermost containers below the top whose members with trainable
    parameters are two or more of one class, in the model's order."""
    found: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        for child in module.children():
            if isinstance(child, nn.Sequential | nn.ModuleList | nn.ModuleDict):
                members = [m for m in child.children() if _trainable(m)]
                if len(members) >= 2 and len({type(m) for m in members}) == 1:
                    found.extend(members)
                    continue
            visit(child)

    visit(model)
    return found


def largest_unit_bytes(model: nn.Module) -> int:
    """The bytes of the largest unit FSDP gathers whole: a block of :func:`model_blocks`, or
    what the root keeps of the rest (what ``dask-train plan`` counts per rank under FSDP)."""
    blocks = list(model_blocks(model))
    inside = {id(p) for block in blocks for p in block.parameters()}
    rest = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in inside)
    sizes = [sum(p.numel() * p.element_size() for p in block.parameters()) for block in blocks]
    return max([rest, *sizes])


def build_model(
    model: str | ModelConfig,
    *,
    num_classes: int,
    seed: int,
    image_size: int = 32,
    input_shape: tuple[int, ...] | None = None,
    factory: Callable[..., nn.Module] | None = None,
) -> nn.Module:
    """Build ``model`` (a name or the ``[model]`` section) with parameters drawn from ``seed``;
    ``factory`` (a callable given in Python) takes the place of the name.

    Seeding here (rather than relying on DDP's broadcast alone) makes the single-process
    reference and every rank start from the same numbers.
    """
    config = model if isinstance(model, ModelConfig) else ModelConfig(name=model)
    found = Factory.of(factory) if factory is not None else resolve(config.name)
    facts = data_arguments(num_classes, input_shape or (3, image_size, image_size))
    arguments = model_arguments(found, config.kwargs, facts)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            built = found.build(**arguments)
        except TypeError as error:
            # A factory behind **kwargs refuses a keyword only when called.
            raise ModelError(f"model.kwargs: factory {found.label}: {error}") from None
    if not isinstance(built, nn.Module):
        raise ModelError(
            f"model.name: factory {found.label} returned a {type(built).__name__}, not a "
            "torch.nn.Module"
        )
    return built


def check_model(
    model: ModelConfig,
    *,
    num_classes: int,
    input_shape: tuple[int, ...],
    factory: Callable[..., nn.Module] | None = None,
) -> nn.Module:
    """Build the model once without allocating it (on the meta device) to find what is wrong
    with its name or arguments before anything launches; a :class:`ModelError` naming the field.
    """
    with torch.device("meta"):
        try:
            return build_model(
                model, num_classes=num_classes, seed=0, input_shape=input_shape, factory=factory
            )
        except ModelError:
            raise
        except (NotImplementedError, RuntimeError):
            if model.in_place_init:  # workers/in_place_init.py builds it there
                raise ModelError(
                    f"model.init: {model.name} cannot be built on the meta device; set "
                    "model.init = 'factory'"
                ) from None
            # A factory that computes with its tensors: build it for real below.
    return build_model(
        model, num_classes=num_classes, seed=0, input_shape=input_shape, factory=factory
    )


def layer_names(name: str) -> list[str]:
    """The top-level modules of a registered model: where it can be cut into stages."""
    if name not in MODELS:
        raise ValueError(f"model.name: unknown model {name!r}; choose one of {sorted(MODELS)}")
    with torch.device("meta"):
        return [child for child, _ in MODELS[name]().named_children()]


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """The members of the model's containers (a transformer's blocks, not its embeddings and
    head) where it has any, else every block FSDP would shard: what activation checkpointing
    recomputes and ``training.compile`` compiles."""
    containers = [c for c in model.children() if isinstance(c, nn.ModuleList | nn.ModuleDict)]
    if containers:
        return [block for container in containers for block in model_blocks(container)]
    return list(model_blocks(model))
