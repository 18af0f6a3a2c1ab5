"""A model laid out on the meta device and initialised in place (workers/in_place_init.py):
the same values as the model built whole with the same seed, on every strategy that splits
it, with no rank holding it whole, and handed back in pieces (workers/model_pieces.py)."""

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from tests import test_text as text
from workers.in_place_init import InPlaceInit, InPlaceInitError
from workers.model_pieces import Piece, assemble
from workers.models import ModelConfig, build_model
from workers.peak_memory import PeakMemory
from workers.precision import Precision
from workers.spec.errors import ConfigError
from workers.spec.plans import get_plan
from workers.strategies.base import RankPlacement, Strategy
from workers.train import lay_out_model
from workflows import launch
from workflows.runs.config import check_model

GPT = {"name": "gpt", "kwargs": {"dim": 32, "n_layers": 4, "n_heads": 4, "num_classes": 64}}
SEQUENCE = text.CORPUS["sequence_length"]


def _whole(name: str) -> dict[str, torch.Tensor]:
    shape = (SEQUENCE,) if name == "gpt" else (3, 32, 32)
    model = build_model(name, num_classes=10, seed=3, input_shape=shape)
    return model.state_dict()


def _meta_then_drawn(name: str) -> dict[str, torch.Tensor]:
    shape = (SEQUENCE,) if name == "gpt" else (3, 32, 32)
    with torch.device("meta"):
        model = build_model(name, num_classes=10, seed=3, input_shape=shape)
    InPlaceInit(model, seed=3).materialize([model], device=torch.device("cpu"))
    return model.state_dict()


class _Tabular(nn.Module):
    """torch's layers only, registered in the order they are made: their constructors draw
    through reset_parameters, so the in-place values are the constructor's."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(12, 8)
        self.body = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(self.embed(x).mean(1))


class _OwnParameter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))
        self.linear = nn.Linear(4, 4)


@pytest.mark.parametrize("name", ["gpt", "cifar_cnn", "small_resnet"])
def test_a_built_in_model_drawn_in_place_is_the_model_built_whole(name):
    whole, drawn = _whole(name), _meta_then_drawn(name)
    assert whole.keys() == drawn.keys()
    assert all(torch.equal(whole[k], drawn[k]) for k in whole), "other values than the whole"


def test_torch_layers_drawn_in_place_are_their_constructors_values():
    torch.manual_seed(3)
    whole = _Tabular().state_dict()
    with torch.device("meta"):
        model = _Tabular()
    InPlaceInit(model, seed=3).materialize([model], device=torch.device("cpu"))
    assert all(torch.equal(whole[k], v) for k, v in model.state_dict().items())
    # A seed is a seed: another draws other numbers.
    InPlaceInit(model, seed=4).materialize([model], device=torch.device("cpu"))
    assert not torch.equal(whole["body.0.weight"], model.state_dict()["body.0.weight"])


def test_a_module_holding_a_parameter_without_reset_parameters_is_named(make_config):
    with pytest.raises(InPlaceInitError, match=r"_OwnParameter at 'the root' holds scale"):
        InPlaceInit(_OwnParameter(), seed=0)
    # From a config: refused on the client, naming the field, before anything launches.
    raw = {"model": {"name": "tests.test_in_place_init:_OwnParameter", "init": "reset_parameters"}}
    config = make_config(raw)
    with pytest.raises(ConfigError, match=r"model.init: _OwnParameter .* set model.init"):
        check_model(config, num_classes=10)
    # 'auto' takes a factory's own values: nothing to refuse.
    check_model(make_config({"model": raw["model"] | {"init": "auto"}}), num_classes=10)


def _lay_out(ctx, config, *, input_shape=(SEQUENCE,), num_classes=64) -> Strategy:
    """The model laid out by ``config``'s strategy on this rank, its values drawn in place."""
    layout = config.layout(ctx.world_size)
    tokens = len(input_shape) == 1
    placement = RankPlacement(
        layout=layout,
        rank=ctx.rank,
        device=ctx.device,
        precision=Precision("fp32", ctx.device),
        settings=get_plan(config.training.strategy).settings(config),
        sample=torch.zeros(
            layout.micro_batch, *input_shape, dtype=torch.int64 if tokens else torch.float32
        ),
    )
    return lay_out_model(
        config.model,
        config.training,
        placement=placement,
        num_classes=num_classes,
        input_shape=input_shape,
    )


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _drawn_on_the_rank(ctx, config) -> tuple[dict[str, Piece], int]:
    """This rank's pieces of the GPT laid out and drawn, and the number of values it holds."""
    strategy = _lay_out(ctx, config)
    tensors = [*strategy.parameters(), *(b for m in strategy.modules for b in m.buffers())]
    return strategy.model_pieces(), sum(_local(t).numel() for t in tensors)


# strategy, [parallel], [pipeline], the most of the model's values a rank may hold: a quarter
# where 4 ranks split all of it (a stage: its blocks, and the embeddings or the head), half
# where 2 copies of it are split.
LAYOUTS = {
    "fsdp-4": ("fsdp", {}, {}, 0.3),
    "hsdp-2x2": ("hsdp", {"dp_shard": 2}, {}, 0.55),
    "tp-2-fsdp-2": ("fsdp", {"tp": 2}, {}, 0.3),
    "pp-4": ("pipeline", {"pp": 4}, {"split_points": ["layers.1", "layers.2", "layers.3"]}, 0.3),
    "pp-2-fsdp-2": ("pipeline", {"pp": 2, "dp_shard": 2}, {"split_points": ["layers.2"]}, 0.3),
    "pp-2-ddp-2": ("pipeline", {"pp": 2, "dp_replicate": 2}, {"split_points": ["layers.2"]}, 0.55),
}


@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_every_strategy_that_splits_the_gpt_starts_from_the_whole_models_values(
    four_workers, make_config, layout
):
    strategy, parallel, pipeline, most = layout
    raw = {"data": text.CORPUS, "model": GPT, "parallel": parallel}
    if pipeline:
        raw["pipeline"] = pipeline | {"n_microbatches": 4}
    config = make_config(raw, strategy=strategy, batch_size=8, seed=3)
    ranks = launch(_drawn_on_the_rank, config, cluster=four_workers, world_size=4).results
    # Every value once (assemble refuses a tensor sent twice or left uncovered) ...
    got = assemble(pieces for pieces, _ in ranks)
    expected = build_model(config.model, num_classes=64, seed=3, input_shape=(SEQUENCE,))
    expected = expected.state_dict()
    assert got.keys() == expected.keys()
    differ = [k for k in expected if not torch.equal(got[k], expected[k])]
    assert not differ, f"drawn otherwise than the whole model: {differ}"
    # ... and no rank holds the whole model: only its share, drawn one module at a time.
    total = sum(v.numel() for v in expected.values())
    for _, held in ranks:
        assert held <= most * total, f"a rank holds {held} of the model's {total} values"


def _laid_out_peak(ctx, config, warm_up) -> tuple[float, float]:
    """This rank's peak memory while the GPT is built, laid out and drawn, and the values it
    then holds, in MiB. The code's own memory is not the model's: a worker's first layout of
    a kind imports and caches ~25 MiB of it (measured), so a small model is laid out first."""
    _lay_out(ctx, warm_up)
    peak = PeakMemory.start(ctx.device)
    strategy = _lay_out(ctx, config)
    held = sum(_local(t).numel() * t.element_size() for t in strategy.parameters())
    return peak.bytes() / 2**20, held / 2**20


@pytest.mark.parametrize(
    ("strategy", "parallel", "pipeline"),
    [
        ("fsdp", {}, {}),
        (
            "pipeline",
            {"pp": 4},
            {"n_microbatches": 4, "split_points": ["layers.2", "layers.4", "layers.6"]},
        ),
    ],
    ids=["fsdp-4", "pp-4"],
)
def test_no_rank_builds_the_whole_model_on_its_way_to_its_part(
    four_workers, make_config, strategy, parallel, pipeline
):
    """A GPT of 8 blocks 512 wide (25.5 M parameters, 97 MiB): each of 4 ranks peaks at its
    quarter (24 MiB) plus one module drawn whole (the widest, a block's 512 x 2048 layer,
    4 MiB) and the rest of the job (allowed 16 MiB). Built whole first, as every rank did
    before, the peak would be the whole model or more."""
    model = {"name": "gpt", "kwargs": {"dim": 512, "n_layers": 8, "n_heads": 8, "num_classes": 64}}
    raw = {"data": text.CORPUS, "model": model, "parallel": parallel}
    if pipeline:
        raw["pipeline"] = pipeline
    config = make_config(raw, strategy=strategy, batch_size=8, seed=3)
    small = {"name": "gpt", "kwargs": model["kwargs"] | {"dim": 32, "n_heads": 4}}
    warm_up = make_config(raw | {"model": small}, strategy=strategy, batch_size=8, seed=3)
    built = build_model(config.model, num_classes=64, seed=3, input_shape=(SEQUENCE,))
    whole = sum(p.numel() * 4 for p in built.parameters()) / 2**20
    ranks = launch(_laid_out_peak, config, warm_up, cluster=four_workers, world_size=4).results
    for peak, held in ranks:
        assert held < 0.3 * whole  # a quarter, give or take a stage's embeddings
        assert peak < held + 4 + 16, f"peaked at {peak:.0f} MiB holding {held:.0f} of {whole:.0f}"


def _weights_on_the_rank(ctx, config) -> tuple[dict[str, Piece], float]:
    """This rank's pieces of the GPT laid out from ``config.model.weights``, and what it
    holds, in MiB."""
    strategy = _lay_out(ctx, config)
    held = sum(_local(t).numel() * t.element_size() for t in strategy.parameters())
    return strategy.model_pieces(), held / 2**20


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")  # dcp.save here
@pytest.mark.parametrize("suffix", [".pt", ".safetensors", ".dcp"])
def test_a_weights_file_gives_each_rank_its_part(four_workers, make_config, tmp_path, suffix):
    """The 97 MiB GPT of the test above, saved with other values (seed 11) and mapped by each
    of 4 FSDP ranks (a DCP checkpoint, as a run writes its own: each loads its part): every
    value is the file's, each rank holding its quarter."""
    model = {"name": "gpt", "kwargs": {"dim": 512, "n_layers": 8, "n_heads": 8, "num_classes": 64}}
    saved = build_model(ModelConfig(**model), num_classes=64, seed=11, input_shape=(SEQUENCE,))
    state = saved.state_dict()
    whole = sum(v.numel() * v.element_size() for v in state.values()) / 2**20
    path = tmp_path / f"gpt{suffix}"
    if suffix == ".pt":
        torch.save(state, path)
    elif suffix == ".dcp":
        import torch.distributed.checkpoint as dcp

        # A run's checkpoint keeps the model under "model", beside the optimizer's state.
        dcp.save(
            {"model": state, "optim": {"step": torch.zeros(1)}}, checkpoint_id=path, no_dist=True
        )
    else:
        safetensors = pytest.importorskip("safetensors.torch")
        safetensors.save_file(state, path)
    raw = {"data": text.CORPUS, "model": model | {"weights": str(path)}}
    config = make_config(raw, strategy="fsdp", batch_size=8, seed=3)
    ranks = launch(_weights_on_the_rank, config, cluster=four_workers).results
    got = assemble(pieces for pieces, _ in ranks)
    assert got.keys() == state.keys()
    assert all(torch.equal(got[k], state[k]) for k in state), "other values than the file's"
    # Each rank holds its quarter. Its peak is not asserted: the file's pages it touches
    # count in its resident set while the file is mapped, as the kernel leaves them there
    # (measured 53-100 MiB a rank, against the 121 MiB or more of a load of the whole file
    # and the quarter), so the peak cannot tell a mapped read from a whole load for certain.
    for _, held in ranks:
        assert held < 0.3 * whole


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")  # dcp.save here
def test_a_runs_checkpoint_in_a_bucket_starts_a_four_stage_pipeline(
    four_workers, make_config, s3, tmp_path
):
    """A run's checkpoint (the model under "model", the optimizer's state beside it) kept in
    a bucket: each of 4 pipeline stages reads its own blocks from the bucket through DCP,
    nothing mapped from a disk, and holds the file's values, a quarter of them or so."""
    import torch.distributed.checkpoint as dcp

    model = {"name": "gpt", "kwargs": {"dim": 64, "n_layers": 4, "n_heads": 4, "num_classes": 64}}
    state = build_model(ModelConfig(**model), num_classes=64, seed=11, input_shape=(SEQUENCE,))
    state = state.state_dict()
    dcp.save(
        {"model": state, "optim": {"step": torch.zeros(1)}},
        checkpoint_id=tmp_path / "s",
        no_dist=True,
    )
    url = f"{s3.bucket('weights')}/runs/gpt/checkpoints/step-00000100"
    s3.filesystem().put(str(tmp_path / "s"), url, recursive=True)
    raw = {
        "data": text.CORPUS,
        "model": model | {"weights": url, "storage_options": s3.storage_options},
        "parallel": {"pp": 4},
        "pipeline": {"n_microbatches": 4, "split_points": ["layers.1", "layers.2", "layers.3"]},
    }
    config = make_config(raw, strategy="pipeline", batch_size=8, seed=3)
    assert s3.storage_options["secret"] not in config.model_dump_json()  # never written out
    ranks = launch(_weights_on_the_rank, config, cluster=four_workers).results
    got = assemble(pieces for pieces, _ in ranks)
    assert got.keys() == state.keys()
    assert all(torch.equal(got[k], state[k]) for k in state), "other values than the bucket's"
    whole = sum(v.numel() * v.element_size() for v in state.values()) / 2**20
    assert all(held < 0.5 * whole for _, held in ranks)  # a stage's blocks, never the model


def test_a_weights_url_is_a_checkpoint_or_refused_naming_it(make_config, s3):
    options = s3.storage_options
    bucket = s3.bucket("no-weights")
    for url, message in (
        (f"{bucket}/gpt.safetensors", "is a file at a URL, which no rank can map"),
        (f"{bucket}/runs/none", "is no readable checkpoint"),
    ):
        raw = {"data": text.CORPUS, "model": GPT | {"weights": url, "storage_options": options}}
        with pytest.raises(ConfigError, match=f"model.weights: {url} {message}"):
            check_model(make_config(raw, strategy="fsdp"), num_classes=64)


@pytest.mark.parametrize(
    ("saved", "message"),
    [
        ({"output.weight": None}, r"gpt.pt has no output.weight"),
        ({"norm.weight": torch.ones(3)}, r"norm.weight is \(3,\), the model's is \(32,\)"),
        ({"extra.bias": torch.ones(3)}, r"holds extra.bias, which the model has not"),
    ],
    ids=["missing", "shape", "unexpected"],
)
def test_a_weights_file_that_is_not_the_models_is_refused_naming_the_key(
    make_config, tmp_path, saved, message
):
    state = build_model(ModelConfig(**GPT), num_classes=64, seed=3, input_shape=(SEQUENCE,))
    state = state.state_dict() | saved
    torch.save({k: v for k, v in state.items() if v is not None}, tmp_path / "gpt.pt")
    raw = {"data": text.CORPUS, "model": GPT | {"weights": str(tmp_path / "gpt.pt")}}
    with pytest.raises(ConfigError, match=f"model.weights: .*{message}"):
        check_model(make_config(raw, strategy="fsdp"), num_classes=64)


TINY_VIT = {
    "name": "torchvision.models.vision_transformer:VisionTransformer",
    "kwargs": {
        "image_size": 32,
        "patch_size": 16,
        "num_layers": 2,
        "num_heads": 2,
        "hidden_dim": 32,
        "mlp_dim": 64,
    },
}


def _pieces_on_the_rank(ctx, config) -> dict[str, Piece]:
    strategy = _lay_out(ctx, config, input_shape=(3, 32, 32), num_classes=10)
    assert all(not p.is_meta for p in strategy.parameters())
    return strategy.model_pieces()


def test_a_vit_whose_modules_cannot_draw_their_values_is_sharded_from_its_weights(
    cluster, make_config, tmp_path
):
    """torchvision's ViT holds a class token and position embedding of its own, and torch's
    MultiheadAttention has no public reset_parameters: refused in place, it is laid out on the
    meta device all the same when a file gives every value."""
    from torchvision.models.vision_transformer import VisionTransformer

    torch.manual_seed(7)
    state = VisionTransformer(**TINY_VIT["kwargs"], num_classes=10).state_dict()
    torch.save(state, tmp_path / "vit.pt")
    raw = {"data": {"dataset": "synthetic"}, "model": TINY_VIT | {"init": "reset_parameters"}}
    with pytest.raises(ConfigError, match="VisionTransformer at 'the root' holds class_token"):
        check_model(make_config(raw, strategy="fsdp"), num_classes=10)  # before any launch
    raw["model"] = TINY_VIT | {"weights": str(tmp_path / "vit.pt")}
    config = make_config(raw, strategy="fsdp", batch_size=8)
    check_model(config, num_classes=10)
    got = assemble(launch(_pieces_on_the_rank, config, cluster=cluster).results)
    assert got.keys() == state.keys()
    assert all(torch.equal(got[k], state[k]) for k in state)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")  # dcp.save here
def test_a_checkpoint_of_the_state_dict_alone_gives_the_models_names(tmp_path):
    import torch.distributed.checkpoint as dcp

    from workers.weight_files import checkpoint_tensors

    state = build_model(ModelConfig(**GPT), num_classes=64, seed=3, input_shape=(SEQUENCE,))
    state = state.state_dict()
    dcp.save(state, checkpoint_id=tmp_path / "plain", no_dist=True)
    tensors, prefix = checkpoint_tensors(tmp_path / "plain")
    assert prefix == "" and tensors.keys() == state.keys()
    assert all((tensors[k].shape, tensors[k].dtype) == (v.shape, v.dtype) for k, v in state.items())
