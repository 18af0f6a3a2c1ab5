"""Every strategy, checkpoint and resume, and batch inference on CUDA workers (nccl), each
against the same work in one process on the same GPU. Marked ``gpu``: skipped without CUDA.

A local CUDA cluster has one worker per GPU, so a one-GPU machine runs the one-rank cases (DDP
and DataParallel on one rank, resume, predict); the two-rank cases (DDP, model parallel,
pipeline, stock workers sharing a host's GPUs) need two GPUs and say so when skipped.

``make gpu-check`` (or ``.ci/gpu-check`` in an existing environment) runs these.
"""

import json
import os
import shutil

import numpy as np
import pytest
import torch

from tests.reference import assert_matches_one_process, train_in_one_process
from workers.checkpoint import MANIFEST, list_checkpoints
from workers.data import BatchShare, RankBatches, open_store
from workers.models import build_model
from workers.spec.launch import LaunchConfig
from workflows.cluster.training_cluster import start_cluster
from workflows.data.preprocess import prepare_store
from workflows.jobs.launcher import ProcessGroup
from workflows.prediction.batch_predict import predict
from workflows.runs.driver import train
from workflows.runs.run_directory import RunDirectory

pytestmark = pytest.mark.gpu

GPUS = torch.cuda.device_count()
needs_two_gpus = pytest.mark.skipif(
    GPUS < 2, reason=f"two ranks need two GPUs (one worker per GPU); this machine has {GPUS}"
)
BASE = {"lr": 0.1, "momentum": 0.9, "batch_size": 32, "epochs": 1, "seed": 3, "max_steps": 5}
# A resumed run against a straight one, both on the GPU in full fp32 (TF32 off, see
# gpu_cluster): the same kernels, but cuDNN's backward sums with atomics in no fixed order,
# grown over 5 steps of momentum SGD.
GPU_TOLERANCE = {"rtol": 1e-3, "atol": 1e-4}


def _full_fp32() -> None:
    # cuDNN convolutions may use TF32 by default: rounding that depends on the kernel chosen,
    # which differs with the batch shape. Off on both sides, the comparison is of the maths.
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False


@pytest.fixture(scope="module")
def gpu_cluster():
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    _full_fp32()
    try:
        with start_cluster(kind="cuda", n_workers=min(GPUS, 2), dashboard_port=0) as cluster:
            assert cluster.kind == "cuda"
            cluster.client.run(_full_fp32)
            yield cluster
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


@pytest.fixture
def gpu_config(make_config):
    def gpu_config(strategy="ddp", ranks=1, pipeline=None, checkpoint=None, **training):
        raw = {
            "name": f"gpu-{strategy}-{ranks}",
            "launch": {"world_size": ranks},
            "pipeline": pipeline or {},
            "checkpoint": checkpoint or {},
        }
        return make_config(raw, **(BASE | {"strategy": strategy} | training))

    return gpu_config


def _peak_gpu_bytes() -> int:
    return torch.cuda.max_memory_allocated()


def _assert_matches(result, config, *, world_size: int, steps: int = 5) -> None:
    # Against the same steps on the GPU in float32 and float64 (tests/reference.py): what the
    # GPU's own rounding allows, whatever cuDNN's atomics sum in which order.
    assert_matches_one_process(
        result.state_dict, config, world_size=world_size, steps=steps, device="cuda"
    )
    # The run moved the parameters: equality is not the initial state twice.
    untrained = train_in_one_process(config, world_size=world_size, steps=0)
    assert not torch.allclose(result.state_dict["fc2.weight"], untrained["fc2.weight"], atol=1e-3)


def _trained_on_the_gpu(cluster) -> None:
    peaks = cluster.client.run(_peak_gpu_bytes)
    assert peaks and all(peak > 0 for peak in peaks.values()), peaks


@pytest.mark.parametrize("strategy", ["ddp", "data_parallel"])
def test_one_rank_on_a_gpu_matches_one_process(gpu_cluster, gpu_config, strategy):
    config = gpu_config(strategy)
    result = train(config, cluster=gpu_cluster, on_event=None)
    assert result.world_size == 1 and result.history[-1]["step"] == 5
    _assert_matches(result, config, world_size=1)
    _trained_on_the_gpu(gpu_cluster)


@needs_two_gpus
def test_ddp_on_two_gpus_matches_one_process(gpu_cluster, gpu_config):
    config = gpu_config("ddp", ranks=2)
    result = train(config, cluster=gpu_cluster, on_event=None)
    assert result.world_size == 2
    _assert_matches(result, config, world_size=2)


@needs_two_gpus
@pytest.mark.parametrize(
    ("strategy", "pipeline"),
    [
        ("model_parallel", {"split_points": ["flatten"]}),
        ("pipeline", {"schedule": "1f1b", "n_microbatches": 4}),
    ],
    ids=["model_parallel", "pipeline-1f1b"],
)
def test_staged_strategies_on_two_gpus_match_one_process(
    gpu_cluster, gpu_config, strategy, pipeline
):
    config = gpu_config(strategy, ranks=2, pipeline=pipeline)
    result = train(config, cluster=gpu_cluster, on_event=None)
    assert result.strategy == strategy and result.world_size == 2
    _assert_matches(result, config, world_size=config.pipeline.dp)


def test_a_gpu_run_resumes_from_its_checkpoint_where_it_left_off(gpu_cluster, gpu_config, tmp_path):
    directory = tmp_path / "checkpoints"
    config = gpu_config(
        checkpoint={"directory": str(directory), "every_steps": 3, "keep": 10}, max_steps=8
    )
    full = train(config, cluster=gpu_cluster, on_event=None)
    saved = list_checkpoints(directory)
    steps = [json.loads((p / MANIFEST).read_text())["step"] for p in saved]
    assert steps == [8, 6, 3]  # newest first
    for newer in saved[:2]:  # as if the run had stopped after step 3
        shutil.rmtree(newer)
    resumed = train(config, cluster=gpu_cluster, on_event=None)
    assert resumed.history[-1]["step"] == 8
    assert resumed.state_dict.keys() == full.state_dict.keys()
    for name, value in full.state_dict.items():
        torch.testing.assert_close(resumed.state_dict[name], value, msg=name, **GPU_TOLERANCE)


def test_predict_on_gpu_workers_equals_the_model_in_one_process(gpu_cluster, gpu_config, tmp_path):
    config = gpu_config(max_steps=8)
    run = RunDirectory.create(config, tmp_path / "run")
    with run:
        run.finish(train(config, cluster=gpu_cluster, on_event=None))
    store = config.data.resolved().store_url
    result = predict(
        model=run.path,
        input=store,
        output=tmp_path / "predictions",
        settings={"partition_size": 100, "batch_size": 32},
        cluster=gpu_cluster,
    )
    frame = result.read()
    val = open_store(store).val
    assert result.count == len(val) and frame["index"].tolist() == list(range(len(val)))

    model = build_model(config.model.name, num_classes=10, seed=1)
    model.load_state_dict(torch.load(run.path / "model.pt", weights_only=True))
    with torch.no_grad():
        want = torch.softmax(model.eval()(torch.from_numpy(np.asarray(val.images[:]))), 1)
    got = frame[[f"prob_{c}" for c in range(10)]].to_numpy()
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-3, atol=1e-5)
    _trained_on_the_gpu(gpu_cluster)


def test_training_batches_are_pinned_for_asynchronous_copies(gpu_cluster, make_config):
    config = make_config({"name": "gpu-pinned"})
    data = config.data.resolved()
    prepare_store(gpu_cluster.client, data, seed=config.training.seed)
    store = open_store(data.store_url)
    batches = RankBatches(
        store.train, data, BatchShare(rank=0, world_size=1, batch_size=16), seed=0
    )
    plain = RankBatches(
        store.train, data, BatchShare(rank=0, world_size=1, batch_size=16), seed=0, pin_memory=False
    )
    (x, y), (px, py) = next(iter(batches.epoch(0))), next(iter(plain.epoch(0)))
    assert x.is_pinned() and y.is_pinned()
    assert not px.is_pinned()
    assert torch.equal(x, px) and torch.equal(y, py)


def _rank_device(generation: str) -> str:
    from workers.process_group import current_membership

    return str(current_membership(generation).device)


@needs_two_gpus
@pytest.mark.skipif(
    bool(os.environ.get("CUDA_VISIBLE_DEVICES")), reason="stock workers must see every GPU"
)
def test_stock_workers_sharing_a_multi_gpu_host_get_one_gpu_each_under_nccl():
    # Plain `dask worker`s (no dask-cuda): each sees every GPU of the host in the same order.
    # Every rank on cuda:0 would make nccl refuse the group.
    with (
        start_cluster(kind="cpu", n_workers=2, dashboard_port=0) as stock,
        ProcessGroup(stock.client, LaunchConfig(world_size=2, backend="nccl")) as group,
    ):
        devices = group.run(_rank_device, group.spec.generation)
    assert devices == ["cuda:0", "cuda:1"]


def _gpu_rank_function(ctx, folder: str) -> dict:
    """A user's own loop on the rank API: its device, a checkpoint of CUDA tensors, restored."""
    model = torch.nn.Linear(4, 2).to(ctx.device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = {"model": model, "optimizer": optimizer}
    resumed = ctx.restore(state)
    x = torch.ones(8, 4, device=ctx.device)
    model(x).sum().backward()
    optimizer.step()
    ctx.report(step=1, weight=float(model.weight.sum()))
    ctx.save(state, step=1 if resumed is None else resumed + 1)
    return {
        "device": str(ctx.device),
        "backend": ctx.backend,
        "resumed": resumed,
        "on_gpu": next(model.parameters()).is_cuda,
    }


def test_the_rank_api_runs_on_the_workers_gpu_and_checkpoints_cuda_state(gpu_cluster, tmp_path):
    from workflows import launch

    first = launch(
        _gpu_rank_function,
        str(tmp_path),
        cluster=gpu_cluster,
        world_size=1,
        checkpoint_dir=tmp_path / "ckpt",
    )
    (rank0,) = first.results
    assert rank0["device"] == "cuda:0" and rank0["backend"] == "nccl" and rank0["on_gpu"]
    assert rank0["resumed"] is None
    again = launch(
        _gpu_rank_function,
        str(tmp_path),
        cluster=gpu_cluster,
        world_size=1,
        checkpoint_dir=tmp_path / "ckpt",
    )
    assert again.results[0]["resumed"] == 1  # the CUDA state came back from the checkpoint


def test_collections_written_into_the_store_train_on_the_gpu_as_in_one_process(
    gpu_cluster, make_config, tmp_path
):
    # data.collections = "store": uint8 samples from Dask arrays, read as float32 on the GPU.
    from tests.test_array_store import _image_data

    data = {"collections": "store", "store": str(tmp_path / "arrays"), "chunk_size": 64}
    config = make_config({"name": "gpu-store", "launch": {"world_size": 1}, "data": data}, **BASE)
    result = train(config, cluster=gpu_cluster, data=_image_data(), on_event=None)
    assert result.store is not None and result.history[-1]["step"] == 5
    _assert_matches(result, config, world_size=1)
    _trained_on_the_gpu(gpu_cluster)
