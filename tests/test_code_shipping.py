"""Code shipping: stock ``dask worker`` processes, started in a folder that cannot import the
user's code, run it all the same (``workflows/jobs/code_shipping.py``): a function on ``launch``, a
module under ``dask-train launch``, a model factory by import path. One stock cluster serves the
module and stops with it (idle, it would cost the rest of the suite a share of a core)."""

import importlib.util
import os
import sys
import textwrap

import numpy as np
import pytest
import torch
from distributed import Client
from torch import nn

from tests.conftest import REPO as ROOT
from tests.reference import assert_matches_one_process
from tests.test_cli_launch import TORCHRUN_SCRIPT, _launch
from tests.test_launch import _write_package
from tests.test_models import BASE, _user_module
from workers.data import open_store
from workers.spec.sections import ModelConfig
from workflows import CodeNotShippable, launch
from workflows.prediction.batch_predict import predict
from workflows.runs.driver import train
from workflows.runs.run_directory import RunDirectory


@pytest.fixture(scope="module")
def stock_workers(tmp_path_factory):
    """``dask scheduler`` and two stock ``dask worker`` processes started in an empty folder,
    which cannot import the user code the tests write under their own ``tmp_path``: shared by
    the tests of code shipping (each writes modules under names of its own). Yields the
    scheduler's address and its scheduler file."""
    from tests.test_multihost import _stock_cluster

    folder = tmp_path_factory.mktemp("stock-workers")
    elsewhere = folder / "elsewhere"
    elsewhere.mkdir()
    with _stock_cluster(folder, {"w0": [], "w1": []}, cwd=elsewhere) as (address, scheduler_file):
        yield address, scheduler_file


@pytest.mark.slow
def test_a_module_the_stock_workers_cannot_import_is_shipped(tmp_path, stock_workers):
    user_code = tmp_path / "user_code" / "my_launch_pkg"
    user_code.mkdir(parents=True)
    (user_code / "__init__.py").write_text("")
    (user_code / "main.py").write_text(textwrap.dedent(TORCHRUN_SCRIPT))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    _, scheduler_file = stock_workers
    output = tmp_path / "out"
    output.mkdir()
    # The client imports the package from its own folder; the stock workers, started in
    # another directory, cannot.
    client_env = os.environ | {
        "PYTHONPATH": os.pathsep.join([str(user_code.parent), str(ROOT)]),
    }
    done = _launch(
        *("--scheduler-file", str(scheduler_file), "--world-size", "2"),
        *("-m", "my_launch_pkg.main", str(output)),
        cwd=elsewhere,
        env=client_env,
    )
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in output.iterdir()) == ["rank0.json", "rank1.json"]
    assert "[rank 1] hello from rank 1 of 2" in done.stdout


def test_code_the_stock_workers_cannot_import_is_shipped(tmp_path, monkeypatch, stock_workers):
    user_code = tmp_path / "user_code"
    _write_package(user_code, "my_research_pkg")
    (user_code / "my_single_module.py").write_text(
        "def times_rank(ctx, value):\n    return value * ctx.rank\n"
    )
    (user_code / "compiled_pkg").mkdir()
    (user_code / "compiled_pkg" / "__init__.py").write_text("def fn(ctx):\n    return 1\n")
    (user_code / "compiled_pkg" / "_speedups.cpython-311-x86_64-linux-gnu.so").write_bytes(b"")
    monkeypatch.syspath_prepend(str(user_code))
    from compiled_pkg import fn as compiled_fn
    from distributed import Client
    from my_research_pkg import user_loop
    from my_single_module import times_rank

    address, _ = stock_workers
    with Client(address, timeout=30) as client:
        assert launch(user_loop, 0.5, cluster=client, world_size=2).results == [15.0, 15.0]
        assert launch(times_rank, 7, cluster=client, world_size=2).results == [0, 7]
        with pytest.raises(CodeNotShippable, match=r"module 'compiled_pkg'.*compiled"):
            launch(compiled_fn, cluster=client, world_size=2)
    for module in [m for m in sys.modules if m.startswith(("my_", "compiled_pkg"))]:
        del sys.modules[module]


@pytest.mark.slow
def test_a_factory_outside_the_repository_is_shipped_to_stock_workers(
    tmp_path, monkeypatch, make_config, stock_workers
):
    by_name = _user_module(tmp_path / "user_code", monkeypatch)
    given = _user_module(tmp_path / "more_user_code", monkeypatch)
    address, _ = stock_workers
    config = make_config(
        {"name": "import-path", "model": {"name": f"{by_name}:make_mlp", "kwargs": {"hidden": 16}}},
        max_steps=3,
        **BASE,
    )
    try:
        with Client(address, timeout=30) as client:
            lacking = client.run(lambda: [importlib.util.find_spec(m) for m in (by_name, given)])
            assert all(specs == [None, None] for specs in lacking.values())
            run = RunDirectory.create(config, tmp_path / "run")
            with run:
                result = train(config, cluster=client, on_event=None)
                run.finish(result)
            # Batch prediction rebuilds the run's model from its config on the workers: code
            # named by the run's config.json, trusted since the caller names the same model.
            scored = predict(
                model=run.path,
                config=config,
                input=config.data.resolved().store_url,
                output=tmp_path / "predictions",
                settings={"partition_size": 200},
                cluster=client,
            )
            from_python = train(
                config.model_copy(update={"model": ModelConfig()}),
                model=importlib.import_module(given).make_mlp,
                cluster=client,
                on_event=None,
            )
    finally:
        for module in (by_name, given):
            sys.modules.pop(module, None)
    assert result.state_dict["1.weight"].shape == (16, 3 * 32 * 32)  # in_features, hidden
    assert result.state_dict["3.weight"].shape == (10, 16)  # num_classes
    assert_matches_one_process(result.state_dict, config, world_size=2, steps=3, bugs=())
    assert from_python.state_dict["1.weight"].shape == (32, 3 * 32 * 32)  # hidden's default
    val = open_store(config.data.resolved().store_url).val
    model = nn.Sequential(
        nn.Flatten(), nn.Linear(3 * 32 * 32, 16), nn.ReLU(), nn.Linear(16, 10)
    )  # make_mlp(10, 3 * 32 * 32, hidden=16), written out: the module is gone from here
    model.load_state_dict(torch.load(run.path / "model.pt", weights_only=True))
    with torch.no_grad():
        want = torch.softmax(model(torch.from_numpy(np.asarray(val.images[:]))), dim=1).numpy()
    got = scored.read()[[f"prob_{c}" for c in range(10)]].to_numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
