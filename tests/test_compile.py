"""``training.compile`` (workers/compilation.py): the blocks compiled, trained as uncompiled."""

import os

import pytest
import torch
import torch.nn.functional as F

from tests import test_text as text
from tests.reference import Reference, assert_equivalent, assert_matches_one_process
from workers.compilation import apply_compile
from workers.models import build_model
from workflows.runs.config import ConfigError, check_model
from workflows.runs.driver import train

STEPS = 2


def _trained_gpt(dtype: torch.dtype, *, compiled: bool = False) -> dict[str, torch.Tensor]:
    """The test GPT, ``STEPS`` SGD steps in this process on fixed random tokens."""
    model = build_model("gpt", num_classes=64, seed=3, input_shape=(16,)).to(dtype)
    if compiled:
        assert len(apply_compile(model, backend="inductor")) == 2  # its two blocks
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    tokens = torch.randint(0, 64, (8, 17), generator=torch.Generator().manual_seed(0))
    for _ in range(STEPS):
        optimizer.zero_grad()
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        optimizer.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.slow
@pytest.mark.equivalence
def test_blocks_compiled_by_inductor_train_as_the_uncompiled_model(monkeypatch, tmp_path_factory):
    # Inductor's on-disk cache does not tell ATEN_CPU_CAPABILITY's paths apart: filled on the
    # native path, it gave NaN under avx2 (measured). One cache per path, kept across runs.
    path = os.environ.get("ATEN_CPU_CAPABILITY", "native")
    cache = tmp_path_factory.getbasetemp().parent / f"inductor-{path}"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache))
    # Inductor's generated kernels sum in their own order: held to float32's rounding against
    # float64, as every strategy is (tests/reference.py), on this CPU's kernels.
    reference = Reference.of(_trained_gpt, steps=STEPS)
    assert_equivalent(_trained_gpt(torch.float32, compiled=True), reference)


@pytest.mark.equivalence
def test_fsdp_over_compiled_blocks_matches_one_process(cluster, make_config):
    # The compiled blocks are the FSDP units: their hooks run outside the compiled code.
    # aot_eager traces and partitions as inductor does, without generating kernels (seconds
    # rather than minutes on this 2-core machine).
    raw = {"name": "gpt-compiled", "data": text.CORPUS, "model": text.GPT}
    training = {"compile": True, "compile_backend": "aot_eager", "strategy": "fsdp"}
    config = make_config(raw, **(text.BASE | training))
    result = train(config, cluster=cluster, on_event=None)
    assert_matches_one_process(result.state_dict, config, world_size=2, steps=4)


def test_a_backend_torch_does_not_know_is_refused_naming_the_field(make_config):
    config = make_config({}, compile=True, compile_backend="no-such-backend")
    with pytest.raises(ConfigError, match=r"training\.compile_backend: torch knows no backend"):
        check_model(config, num_classes=10)
