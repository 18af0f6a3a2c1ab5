"""Activation checkpointing (``training.activation_checkpointing``): blocks that keep only their
inputs for the backward and run their forward again to get the rest, as torchtitan offers.

- ``full``: each checkpointed block saves its inputs alone; its whole forward runs again in the
  backward. A transformer block's activations (attention scores, the MLP's wide hidden layer)
  then cost nothing between its forward and its backward.
- ``selective``: inside each block the outputs of attention and of every other matrix product
  (``mm``, ``addmm``, ``bmm``) are kept, the rest runs again: the costliest ops are repeated
  half the time, and a part of the memory is still saved (torchtitan's "op" policy).

Which modules are blocks: ``training.activation_checkpointing_modules`` names their classes;
unset, the members of the model's top-level ``nn.ModuleList`` or ``nn.ModuleDict`` (the GPT's
``layers``, not its embeddings and head), else its top-level children that hold parameters
(``workers.models.model_blocks``: what FSDP shards one by one).

The recomputed forward is the same computation on the same inputs, with the RNG state of the
first (``preserve_rng_state``): the parameters after training are the same as without it. The
blocks keep their names, parameters and class names (each becomes an instance of a subclass
that checkpoints its forward), so checkpoints, state dicts, FSDP and TP plans and pipeline cuts
see the same modules.
"""

import functools
import inspect
from typing import Any, Literal

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from workers.models import repeated_blocks
from workers.spec.sections import ACTIVATION_CHECKPOINTING

Mode = Literal["none", "full", "selective"]
MODES: tuple[Mode, ...] = ACTIVATION_CHECKPOINTING


def _ops(*names: str) -> frozenset[Any]:
    """The default overloads of those ``names`` this torch has (the attention kernels differ
    between versions and devices)."""
    return frozenset(
        getattr(torch.ops.aten, n).default for n in names if hasattr(torch.ops.aten, n)
    )


# The ops whose outputs ``selective`` keeps: attention, and every other one of the matrix
# products (torchtitan's "op" policy): the costly ops, half of whose outputs are kept.
MATRIX_PRODUCTS = _ops("mm", "addmm", "bmm", "baddbmm")
KEPT_OPS = MATRIX_PRODUCTS | _ops(
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_cudnn_attention",
)


# torch 2.14 has it; earlier versions keep selective's tensors out of saved_tensors_hooks.
_HOOKS_ARGUMENT = "respect_saved_tensors_hooks" in inspect.signature(checkpoint).parameters


class ActivationCheckpointingError(ValueError):
    """``training.activation_checkpointing`` cannot apply to this model as configured."""


def _selective_contexts() -> Any:
    """A fresh policy for one checkpointed call: it counts the matrix products of the
    forward and of the recompute apart, so both keep the same ones."""
    counts = {"forward": 0, "recompute": 0}

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if op not in KEPT_OPS:
            return CheckpointPolicy.PREFER_RECOMPUTE
        if op in MATRIX_PRODUCTS:
            phase = "recompute" if ctx.is_recompute else "forward"
            counts[phase] += 1
            if counts[phase] % 2 == 0:  # every second one is recomputed, as torchtitan does
                return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE

    return create_selective_checkpoint_contexts(policy)


def _options(mode: Mode) -> dict[str, Any]:
    options: dict[str, Any] = {"use_reentrant": False, "preserve_rng_state": True}
    if mode == "selective":
        options["context_fn"] = _selective_contexts
        if _HOOKS_ARGUMENT:
            # The tensors selective keeps go through saved_tensors_hooks like any other
            # (save_on_cpu offloads them too): torch's coming default, asked for now.
            options["respect_saved_tensors_hooks"] = True
    return options


@functools.cache
def checkpointed_class(cls: type[nn.Module], mode: Mode) -> type[nn.Module]:
    """``cls`` with its forward checkpointed in ``mode``: a subclass under the same name. A
    class, not a function set on the instance: a pipeline stage's copy of a block
    (``copy.deepcopy``) must run its own forward, not the original's."""
    options = _options(mode)

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        inner = super(checkpointed, self).forward
        if not torch.is_grad_enabled():  # evaluation: nothing is kept for a backward anyway
            return inner(*args, **kwargs)
        return checkpoint(inner, *args, **options, **kwargs)

    checkpointed = type(
        cls.__name__,
        (cls,),
        {
            "forward": forward,
            "activation_checkpointing": mode,
            "__module__": cls.__module__,
            "__qualname__": cls.__qualname__,
        },
    )
    return checkpointed


def apply_activation_checkpointing(
    model: nn.Module, *, mode: Mode, module_classes: tuple[str, ...] = ()
) -> list[str]:
    """Checkpoint ``model``'s blocks in ``mode`` (in place); the names of the modules
    checkpointed. ``module_classes``: the class names (``Block``) or qualified names
    (``package.module.Block``) of the modules to checkpoint instead of the model's blocks; one
    that names no module of the model is an error that says which classes it has."""
    if mode == "none":
        return []
    if mode not in MODES:
        raise ActivationCheckpointingError(
            f"training.activation_checkpointing: {mode!r}; choose one of {list(MODES)}"
        )
    if module_classes:
        chosen = _by_class(model, module_classes)
    else:
        blocks = {id(block) for block in repeated_blocks(model)}
        chosen = {name: m for name, m in model.named_modules() if id(m) in blocks}
    if not chosen:
        raise ActivationCheckpointingError(
            f"training.activation_checkpointing: {type(model).__name__} has no blocks (no "
            "children holding parameters); name the modules to checkpoint in "
            "training.activation_checkpointing_modules"
        )
    for module in chosen.values():
        module.__class__ = checkpointed_class(type(module), mode)
    return list(chosen)


def _by_class(model: nn.Module, module_classes: tuple[str, ...]) -> dict[str, nn.Module]:
    def names(module: nn.Module) -> set[str]:
        cls = type(module)
        return {cls.__name__, f"{cls.__module__}.{cls.__qualname__}"}

    chosen: dict[str, nn.Module] = {}
    for wanted in module_classes:
        found = {n: m for n, m in model.named_modules() if n and wanted in names(m)}
        if not found:
            present = sorted({type(m).__name__ for n, m in model.named_modules() if n})
            raise ActivationCheckpointingError(
                f"training.activation_checkpointing_modules: no module of "
                f"{type(model).__name__} is a {wanted!r}; its module classes: {present}"
            )
        chosen |= found
    # A module inside another chosen one is recomputed with it already.
    return {
        n: m
        for n, m in chosen.items()
        if not any(n.startswith(f"{outer}.") for outer in chosen if outer != n)
    }


def checkpointed_modules(model: nn.Module) -> dict[str, str]:
    """The modules of ``model`` whose forward is checkpointed, and how."""
    return {
        name: type(module).activation_checkpointing
        for name, module in model.named_modules()
        if hasattr(type(module), "activation_checkpointing")
    }
