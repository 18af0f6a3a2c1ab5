"""How any model is built from its ``[model]`` section, and the blocks a strategy splits it at.

Where a model comes from (built in, torchvision, timm, an import path) is a source's
(workers/model_sources/); the built-in models are ``workers/model_sources/builtin.py``.
"""

import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from workers.model_sources import Factory, ModelError, resolve

# Re-exported: the built-in models, by name and by class, for scripts and the reference.
from workers.model_sources.builtin import GPT as GPT
from workers.model_sources.builtin import MODELS

# Re-exported: the section's model lives in a torch-free module, for config checks.
from workers.spec.sections import ModelConfig as ModelConfig


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
