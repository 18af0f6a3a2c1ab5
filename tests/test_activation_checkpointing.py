"""Activation checkpointing: the same gradients, fewer activations kept for the backward.

What a forward keeps for its backward is counted exactly, as the bytes of the tensors autograd
saves (``saved_tensors_hooks``), not read from the process's memory, which a CPU's allocator
blurs. Distributed runs with it are in tests/test_fsdp.py.
"""

import pytest
import torch
from torch import nn

from tests.refusals import refusal
from workers.activation_checkpointing import (
    ActivationCheckpointingError,
    apply_activation_checkpointing,
    checkpointed_modules,
)
from workers.models import GPT


def _gpt(mode: str, **kwargs) -> GPT:
    torch.manual_seed(0)
    model = GPT(num_classes=64, sequence_length=32, dim=64, n_layers=3, n_heads=4)
    apply_activation_checkpointing(model, mode=mode, **kwargs)
    return model


def _step(model: nn.Module) -> tuple[int, dict[str, torch.Tensor]]:
    """One forward and backward on fixed tokens: the bytes autograd kept between them, and
    the gradients."""
    tokens = torch.randint(0, 64, (8, 32), generator=torch.Generator().manual_seed(1))
    kept = 0

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal kept
        kept += tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        logits = model(tokens)
    nn.functional.cross_entropy(logits.flatten(0, 1), tokens.roll(-1, 1).flatten()).backward()
    return kept, {n: p.grad for n, p in model.named_parameters()}


def test_full_and_selective_give_the_same_gradients_and_keep_less():
    kept, grads = {}, {}
    for mode in ("none", "full", "selective"):
        kept[mode], grads[mode] = _step(_gpt(mode))
    # The same computation run again on the same inputs: the same numbers, bit for bit.
    for mode in ("full", "selective"):
        assert grads[mode].keys() == grads["none"].keys()
        for name, grad in grads["none"].items():
            assert torch.equal(grads[mode][name], grad), (mode, name)
    # Full keeps each block's input alone (the embeddings' and the head's own stay), selective
    # the matrix products' outputs too: the order argued in workers/activation_checkpointing.
    assert kept["full"] < kept["selective"] < kept["none"], kept
    assert kept["full"] < 0.5 * kept["none"], kept


def test_the_gpts_blocks_are_checkpointed_by_default_or_the_classes_named():
    assert checkpointed_modules(_gpt("full")) == {f"layers.{i}": "full" for i in range(3)}
    # Every FeedForward; a class inside a named one is recomputed with it, not again.
    block = "workers.model_sources.builtin.TransformerBlock"
    named = _gpt("selective", module_classes=("FeedForward", block))
    assert checkpointed_modules(named) == {f"layers.{i}": "selective" for i in range(3)}
    named = _gpt("selective", module_classes=("FeedForward",))
    assert checkpointed_modules(named) == {
        f"layers.{i}.feed_forward": "selective" for i in range(3)
    }
    assert checkpointed_modules(_gpt("none")) == {}


def test_a_class_the_model_lacks_is_refused_naming_the_field_and_the_classes_it_has():
    with pytest.raises(ActivationCheckpointingError) as refused:
        _gpt("full", module_classes=("Blok",))
    message = str(refused.value)
    assert "training.activation_checkpointing_modules" in message
    assert "'Blok'" in message and "TransformerBlock" in message


def test_full_runs_each_blocks_forward_again_in_the_backward_and_evaluation_once():
    model = _gpt("full")
    calls = []
    for block in model.layers.values():
        block.attention.register_forward_pre_hook(lambda *_: calls.append(1))
    _step(model)
    assert len(calls) == 2 * 3  # each block's forward, then again in its backward
    calls.clear()
    with torch.no_grad():
        model(torch.zeros(2, 32, dtype=torch.long))
    assert len(calls) == 3


def test_a_copied_block_runs_its_own_parameters():
    # A pipeline stage holds a deep copy of its blocks: the copy's forward is its own.
    import copy

    model = _gpt("full")
    copied = copy.deepcopy(model)
    with torch.no_grad():
        for parameter in copied.parameters():
            parameter.zero_()
    tokens = torch.zeros(2, 32, dtype=torch.long)
    assert torch.count_nonzero(copied(tokens)) == 0
    assert type(copied.layers["0"]).__name__ == "TransformerBlock"
    assert checkpointed_modules(copied) == checkpointed_modules(model)


@pytest.mark.parametrize(
    ("training", "message"),
    [
        (
            {"activation_checkpointing": "partial"},
            "training.activation_checkpointing: must be 'none', 'full' or 'selective'",
        ),
        (
            {"activation_checkpointing_modules": ["TransformerBlock"]},
            "training.activation_checkpointing_modules: set training.activation_checkpointing "
            "to 'full' or 'selective' for them",
        ),
    ],
)
def test_a_bad_setting_is_refused_naming_the_field(training, message):
    assert message in refusal({"training": training}, base={"training": {}})
