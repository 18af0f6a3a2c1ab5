"""Training straight from Dask collections: ``launch(fn, data=...)`` and ``train(data=...)``.

Every sample once per epoch across ranks, equal steps on uneven partitions, partitions read
where they lie (Dask's own transfer accounting shows what moved), the same numbers as one
process, and a worker SIGKILLed mid-epoch.
"""

import itertools
import os
import signal
import subprocess

import dask.array as da
import dask.dataframe as dd
import numpy as np
import pandas as pd
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from tests.reference import Reference, assert_equivalent
from workers.collection_shard import RankRows, RankShard, SplitPlan, batch_sizes
from workers.spec.sections import DataConfig
from workflows import launch
from workflows.jobs.collections import DataError, assign_rows, balanced_shares

# Seven partitions of 1 to 1,000 rows.
UNEVEN = (1, 1000, 17, 250, 3, 600, 99)
FEATURES = 4


def _uneven(chunks=UNEVEN, features: int = FEATURES) -> tuple[da.Array, da.Array]:
    """X whose column 0 is each row's id, and y = id % 5."""
    n = sum(chunks)
    ids = np.arange(n, dtype=np.float32)
    x = np.column_stack([ids, *(np.sin(ids * (k + 1)) for k in range(features - 1))])
    return (
        da.from_array(x.astype(np.float32), chunks=(chunks, features)),
        da.from_array((np.arange(n) % 5).astype(np.int64), chunks=(chunks,)),
    )


def ids_per_epoch(ctx, epochs: int, batch_size: int) -> dict:
    """Each epoch's sample ids in visiting order, and the batch sizes, on this rank; the
    ranks meet in a collective every step, as DDP's would."""
    seen, sizes = [], []
    for epoch in range(epochs):
        batches = ctx.shard("train", batch_size=batch_size, epoch=epoch, seed=3)
        ids, epoch_sizes = [], []
        for x, y in batches:
            assert x.dtype == torch.float32 and y.dtype == torch.int64
            assert torch.equal(y, x[:, 0].long() % 5)  # X and y rows stay paired
            ids += x[:, 0].long().tolist()
            epoch_sizes.append(len(y))
            dist.all_reduce(torch.ones(1))
        seen.append(ids)
        sizes.append(epoch_sizes)
    return {"ids": seen, "sizes": sizes, "fetched": batches.rows.fetched_keys}


def _check_exactly_once(results: list[dict], n: int, epochs: int, batch_size: int) -> None:
    for epoch in range(epochs):
        everything = sorted(i for r in results for i in r["ids"][epoch])
        assert everything == list(range(n)), f"epoch {epoch}: not every sample exactly once"
        # The same number of steps on every rank, none empty, none above the batch size.
        steps = {len(r["sizes"][epoch]) for r in results}
        largest_share = -(-n // len(results))
        assert steps == {-(-largest_share // batch_size)}
        assert all(0 < s <= batch_size for r in results for s in r["sizes"][epoch])
    # A fresh order every epoch, the same rows per rank (they stay where they lie).
    for r in results:
        assert r["ids"][0] != r["ids"][1]
        assert sorted(r["ids"][0]) == sorted(r["ids"][1])


def test_every_sample_once_per_epoch_on_two_ranks_from_uneven_partitions(cluster):
    x, y = _uneven()
    result = launch(ids_per_epoch, 2, 64, cluster=cluster, world_size=2, data={"train": (x, y)})
    _check_exactly_once(result.results, sum(UNEVEN), epochs=2, batch_size=64)
    assert [r["fetched"] for r in result.results] == [[], []]  # every read was local


@pytest.mark.slow
def test_every_sample_once_per_epoch_on_three_ranks_from_dataframes():
    from workflows.cluster.training_cluster import start_cluster

    n = sum(UNEVEN)
    frame = pd.DataFrame({"id": np.arange(n, dtype=np.float64), "b": np.arange(n) % 7})
    frame["label"] = np.arange(n) % 5
    bounds = np.cumsum((0, *UNEVEN))
    parts = [frame.iloc[a:b] for a, b in itertools.pairwise(bounds)]
    df = dd.from_delayed([_delayed_frame(p) for p in parts], meta=frame.iloc[:0])
    with start_cluster(n_workers=3, dashboard_port=0) as three:
        result = launch(
            ids_per_epoch,
            2,
            50,
            cluster=three,
            world_size=3,
            data={"train": (df[["id", "b"]], df["label"])},
        )
    assert result.world_size == 3
    _check_exactly_once(result.results, n, epochs=2, batch_size=50)


@pytest.mark.parametrize("kinds", ["frame and array", "array and series"])
def test_x_and_y_partitioned_differently_still_pair_up(cluster, kinds):
    n = sum(UNEVEN)
    x, y = _uneven()
    if kinds == "frame and array":
        x = dd.from_dask_array(x, columns=[f"f{i}" for i in range(FEATURES)]).repartition(
            npartitions=3
        )
        y = y.rechunk(500)
    else:
        y = dd.from_dask_array(y).repartition(npartitions=4)
    result = launch(ids_per_epoch, 2, 64, cluster=cluster, world_size=2, data={"train": (x, y)})
    _check_exactly_once(result.results, n, epochs=2, batch_size=64)


def _delayed_frame(part: pd.DataFrame):
    import dask

    return dask.delayed(lambda: part.copy())()


# -- the assignment ---------------------------------------------------------------------------


def test_ranks_keep_their_own_partitions_and_only_the_shortfall_moves():
    lengths = list(UNEVEN)
    # Everything on rank 0's worker: rank 1 takes half, and only that half moves.
    ranges = assign_rows(lengths, [{0}] * 7, balanced_shares(1970, 2, [1970, 0]))
    assert [sum(b - a for _, a, b in r) for r in ranges] == [985, 985]
    # Split evenly already: nothing moves.
    holders = [{0}, {1}, {0}, {0}, {0}, {0}, {1}]  # 1+17+250+3+600 = 871 vs 1099
    shares = balanced_shares(1970, 2, [871, 1099])
    ranges = assign_rows(lengths, holders, shares)
    moved = sum(b - a for rank, r in enumerate(ranges) for p, a, b in r if rank not in holders[p])
    assert moved == 985 - 871  # rank 0's shortfall, the least any assignment moves
    rows = sorted((p, i) for r in ranges for p, a, b in r for i in range(a, b))
    assert rows == [(p, i) for p, length in enumerate(lengths) for i in range(length)]


@pytest.mark.parametrize(("count", "expected"), [(3, [2, 1]), (4, [3, 1]), (6, [3, 3])])
def test_batches_are_never_empty(count, expected):
    # Shares of 3 and 4 samples, batches of 3: both ranks take 2 steps.
    assert batch_sizes(count, steps=2, batch_size=3) == expected


def test_a_steps_rows_for_the_job_add_every_ranks_batch_of_uneven_shares():
    # Shares of 5 and 4 samples in batches of 2 take 3 steps: rank 0's batches are 2, 2, 1 and
    # rank 1's 2, 1, 1, so rank 1's own batch times the ranks would count 4, 2, 2.
    split = SplitPlan(
        name="train",
        n=9,
        n_partitions=2,
        counts=(5, 4),
        pieces=((), ()),
        x_frame=False,
        sample_shape=(1,),
        integral_target=True,
        target_range=(0.0, 1.0),
        moved_rows=0,
        moved_bytes=0,
        dataset="unused",
    )
    shard = RankShard(RankRows([], []), split, rank=1, batch_size=2, seed=0)
    assert [shard.job_rows(step) for step in range(len(shard))] == [4, 3, 2]


# -- locality ---------------------------------------------------------------------------------


def _incoming_bytes(dask_worker) -> int:
    """What this worker fetched from other workers, by Dask's own transfer accounting."""
    return sum(entry["total"] for entry in dask_worker.transfer_incoming_log)


def plan_and_reads(ctx) -> dict:
    batches = ctx.shard("train", batch_size=128, epoch=0)
    count = sum(len(y) for _, y in batches)
    plan = ctx.data_plan("train")
    return {
        "count": count,
        "fetched": batches.rows.fetched_keys,
        "moved_rows": plan.moved_rows,
        "moved_bytes": plan.moved_bytes,
    }


def test_only_the_rows_balancing_needs_move_between_workers(own_cluster):
    client = own_cluster.client
    first = sorted(client.scheduler_info()["workers"])[0]
    x, y = _uneven()
    # Every partition on one worker: the other rank's half of the rows must move, no more.
    x, y = client.persist([x, y], workers=[first])
    from distributed import wait

    wait([x, y], timeout=60)
    before = sum(client.run(_incoming_bytes).values())
    result = launch(plan_and_reads, cluster=own_cluster, world_size=2, data={"train": (x, y)})
    moved = sum(client.run(_incoming_bytes).values()) - before
    n = sum(UNEVEN)
    assert [r["count"] for r in result.results] == [n // 2, n // 2]
    assert result.results[0]["moved_rows"] == n // 2  # the shortfall of the empty worker
    needed = (n // 2) * (FEATURES * 4 + 8)  # float32 features and an int64 label per row
    assert result.results[0]["moved_bytes"] == needed
    # Dask saw exactly those bytes go between workers: no whole partition moved, and the
    # ranks read everything else from their own worker's memory.
    assert moved == needed
    assert [r["fetched"] for r in result.results] == [[], []]


# -- one process ------------------------------------------------------------------------------


def _regression(n: int = 1970) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, FEATURES)).astype(np.float32)
    x[:, 0] = np.arange(n)  # the row id
    y = (x[:, 1:] @ np.array([0.5, -1.0, 2.0]) + 0.1).astype(np.float32)
    return x, y


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES - 1, 16), nn.Tanh(), nn.Linear(16, 1))


def ddp_regression(ctx, steps: int, batch_size: int) -> dict:
    model = DistributedDataParallel(_mlp())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    order = []
    batches = iter(ctx.shard("train", batch_size=batch_size, epoch=0, seed=1))
    for _ in range(steps):
        x, y = next(batches)
        optimizer.zero_grad()
        F.mse_loss(model(x[:, 1:]).squeeze(1), y).backward()
        optimizer.step()
        order.append(x[:, 0].long())
    return {"ids": order, "state": {k: v.clone() for k, v in model.module.state_dict().items()}}


def test_ddp_on_collection_data_matches_one_process(cluster):
    x, y = _regression()
    data = {"train": (da.from_array(x, chunks=(UNEVEN, FEATURES)), da.from_array(y, chunks=UNEVEN))}
    result = launch(ddp_regression, 6, 32, cluster=cluster, world_size=2, data=data)

    def one_process(dtype: torch.dtype) -> dict:
        model = _mlp().to(dtype)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        for step in range(6):
            # The global batch: every rank's batch of this step (equal sizes, so the mean of
            # the ranks' means is the mean over the global batch).
            ids = torch.cat([r["ids"][step] for r in result.results]).numpy()
            optimizer.zero_grad()
            prediction = model(torch.from_numpy(x[ids, 1:]).to(dtype)).squeeze(1)
            F.mse_loss(prediction, torch.from_numpy(y[ids]).to(dtype)).backward()
            optimizer.step()
        return model.state_dict()

    reference = Reference.of(one_process, steps=6)
    for r in result.results:
        assert_equivalent(r["state"], reference)


# -- bad input --------------------------------------------------------------------------------


def never_called(ctx) -> None:
    raise AssertionError("launched despite bad data")


def _bad_inputs() -> dict:
    x, y = _uneven()
    words = dd.from_pandas(pd.DataFrame({"a": [1.0, 2.0], "w": ["x", "y"]}), npartitions=1)
    with_nan = da.from_array(np.array([0.0, np.nan] * 985, dtype=np.float32), chunks=UNEVEN)
    unknown = x[x[:, 0] >= 0]  # boolean indexing: unknown chunk sizes
    return {
        "lengths": ({"train": (x, y[:-1])}, r"data\['train'\]: X has 1970 rows but y has 1969"),
        "text": ({"train": (words, words["a"])}, r"X column 'w' is of type .*not numeric"),
        "nan": ({"train": (x, with_nan)}, r"y has 985 rows with NaN"),
        "split": ({"test": (x, y)}, r"unknown split 'test'"),
        "chunks": ({"train": (unknown, y)}, r"unknown chunk sizes.*compute_chunk_sizes"),
        "pair": ({"train": x}, r"give a pair \(X, y\)"),
    }


@pytest.mark.parametrize("case", ["lengths", "text", "nan", "split", "chunks", "pair"])
def test_bad_data_is_one_line_before_anything_launches(cluster, case):
    data, message = _bad_inputs()[case]
    with pytest.raises(DataError, match=message) as raised:
        launch(never_called, cluster=cluster, world_size=2, data=data)
    assert "\n" not in str(raised.value)


# -- a worker lost mid-epoch ------------------------------------------------------------------


def resumable(ctx, epochs: int, batch_size: int, save_every: int, die_at: int) -> dict:
    """Trains, checkpoints every few steps with the samples each epoch has seen so far (on
    every rank alike), and rank 1's worker SIGKILLs itself at step ``die_at``."""
    model = DistributedDataParallel(_mlp())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    state = {
        "model": model,
        "optimizer": optimizer,
        "epoch": 0,
        "next": 0,
        "step": 0,
        "seen": [[] for _ in range(epochs)],
    }
    ctx.restore(state)
    resumed_at = state["step"]
    for epoch in range(state["epoch"], epochs):
        start = state["next"] if epoch == state["epoch"] else 0
        batches = ctx.shard("train", batch_size=batch_size, epoch=epoch, start_step=start)
        for index, (x, y) in enumerate(batches, start):
            optimizer.zero_grad()
            F.mse_loss(model(x[:, 1:4]).squeeze(1), y.float()).backward()
            optimizer.step()
            everyone: list = [None] * ctx.world_size
            dist.all_gather_object(everyone, x[:, 0].long().tolist())
            state["seen"][epoch] += [i for ids in everyone for i in ids]
            state["step"] += 1
            if ctx.attempt == 0 and ctx.rank == 1 and state["step"] == die_at:
                os.kill(os.getpid(), signal.SIGKILL)
            if state["step"] % save_every == 0:
                last = index + 1 == batches.steps
                state["epoch"], state["next"] = (epoch + 1, 0) if last else (epoch, index + 1)
                ctx.save(state, step=state["step"])
    return {"seen": state["seen"], "resumed_at": resumed_at, "steps": state["step"]}


@pytest.mark.slow
def test_a_worker_sigkilled_mid_epoch_still_sees_every_sample_once(own_cluster, tmp_path):
    x, y = _uneven()
    result = launch(
        resumable,
        2,
        100,  # 985 samples per rank: 10 steps per epoch
        5,
        13,  # in the second epoch, three steps after the checkpoint of step 10
        cluster=own_cluster,
        world_size=2,
        checkpoint_dir=tmp_path / "checkpoints",
        data={"train": (x, y)},
    )
    assert result.attempts == 2 and result.recoveries[0]["resumed_from_step"] == 10
    # The loop never says where its state stands (ctx.step_done): the checkpoint it is.
    assert result.recoveries[0]["recovered_from"] == "checkpoint"
    for r in result.results:
        assert r["resumed_at"] == 10 and r["steps"] == 20
        for epoch in range(2):
            assert sorted(r["seen"][epoch]) == list(range(sum(UNEVEN)))


# -- the built-in trainer ---------------------------------------------------------------------


def _images(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 4, n)
    x = rng.normal(size=(n, 3, 8, 8)).astype(np.float32)
    x[:, y % 3, :4, :4] += 2.0  # learnable: a bright quarter in the label's channel
    return x, y


def test_train_from_dask_arrays_validates_on_every_sample_once(cluster, make_config):
    from workers.models import build_model
    from workflows.runs.driver import train

    x, y = _images(700, 0)
    x_val, y_val = _images(301, 1)
    data = {
        "train": (da.from_array(x, chunks=(100, 3, 8, 8)), da.from_array(y, chunks=100)),
        "val": (da.from_array(x_val, chunks=(37, 3, 8, 8)), da.from_array(y_val, chunks=37)),
    }
    config = make_config(epochs=2, batch_size=64, lr=0.05)
    result = train(config, cluster=cluster, data=data, on_event=None)
    assert [r["epoch"] for r in result.history] == [1, 2] and result.store is None
    # The last validation covered every sample of the split exactly once: the same accuracy
    # as the returned model scores here, on the whole split.
    model = build_model("cifar_cnn", num_classes=4, seed=0, image_size=8)
    model.load_state_dict(result.state_dict)
    with torch.no_grad():
        predicted = model(torch.from_numpy(x_val)).argmax(1).numpy()
    assert result.final["val_accuracy"] == pytest.approx((predicted == y_val).mean())


def tabular_regressor(in_features: int, num_classes: int) -> nn.Module:
    """A factory by import path (tests.test_collections:tabular_regressor): the trainer fills
    in the feature count from the data, and one output for a regression loss."""
    return nn.Sequential(nn.Linear(in_features, 16), nn.Tanh(), nn.Linear(16, num_classes))


def test_a_tabular_regressor_trains_from_a_dask_dataframe_with_mse(cluster, make_config):
    from sklearn.metrics import mean_squared_error, r2_score

    from workers.models import build_model
    from workflows.runs.driver import train

    rng = np.random.default_rng(0)
    frame = pd.DataFrame(rng.normal(size=(900, 3)), columns=["a", "b", "c"]).astype("float32")
    frame["price"] = (2 * frame.a - frame.b + 0.5 * frame.c).astype("float32")
    train_frame = dd.from_pandas(frame[:600], npartitions=5)
    val_frame = dd.from_pandas(frame[600:], npartitions=3)
    features = ["a", "b", "c"]
    data = {
        "train": (train_frame[features], train_frame.price),
        "val": (val_frame[features], val_frame.price),
    }
    name = "tests.test_collections:tabular_regressor"
    config = make_config({"model": {"name": name}}, epochs=2, batch_size=60, lr=0.05, loss="mse")
    result = train(config, cluster=cluster, data=data, on_event=None)
    final = result.final
    assert {"val_mse", "val_mae", "val_r2"} <= set(final) and "val_accuracy" not in final
    # The validation figures are the returned model's on every validation row, once.
    model = build_model(config.model, num_classes=1, seed=0, input_shape=(3,))
    model.load_state_dict(result.state_dict)
    with torch.no_grad():
        predicted = model(torch.tensor(frame[features][600:].to_numpy())).squeeze(1)
    truth = frame.price[600:].to_numpy()
    assert final["val_mse"] == pytest.approx(mean_squared_error(truth, predicted), rel=1e-4)
    assert final["val_r2"] == pytest.approx(r2_score(truth, predicted), rel=1e-4)


def test_train_refuses_targets_that_are_not_class_labels(cluster, make_config):
    from workflows.runs.driver import train

    x, _ = _images(100, 0)
    floats = da.from_array(np.linspace(0, 1, 100), chunks=50)
    images = da.from_array(x, chunks=(50, 3, 8, 8))
    pair = (images, floats)
    with pytest.raises(DataError, match=r"y must hold class labels.*training.loss = 'mse'"):
        train(make_config(), cluster=cluster, data={"train": pair, "val": pair})
    with pytest.raises(DataError, match=r"give a 'val' split too"):
        train(make_config(), cluster=cluster, data={"train": (images, floats)})


# -- a user's parquet files and zarr arrays ---------------------------------------------------


def ids_of_both_splits(ctx) -> list[int]:
    return [
        i
        for split in ("train", "val")
        for x, _ in ctx.shard(split, batch_size=100, epoch=0)
        for i in x[:, 0].long().tolist()
    ]


def test_parquet_files_train_and_validate_on_every_row_once(cluster, make_config, tmp_path):
    from workers.sources import SourceError, get_source
    from workflows.runs.driver import train

    n = sum(UNEVEN)
    frame = pd.DataFrame({"id": np.arange(n, dtype=np.float64), "b": np.arange(n) % 7})
    frame["label"] = np.arange(n) % 5
    frame["note"] = "text the features leave out"
    dd.from_pandas(frame, npartitions=5).to_parquet(tmp_path / "table")
    config = DataConfig(
        dataset="parquet", root=str(tmp_path / "table"), features=("id", "b"), target="label"
    )
    data = get_source("parquet").collections(config, seed=0)
    result = launch(ids_of_both_splits, cluster=cluster, world_size=2, data=data)
    assert sorted(i for r in result.results for i in r) == list(range(n))
    wrong = config.model_copy(update={"target": "labels"})
    with pytest.raises(SourceError, match=r"data.target: no column 'labels'"):
        get_source("parquet").collections(wrong, seed=0)
    # train() refuses it as it refuses any collection it cannot train on, before a task runs.
    with pytest.raises(DataError, match=r"data.target: no column 'labels'"):
        raw = {"dataset": "parquet", "root": config.root, "features": ["id"], "target": "labels"}
        train(make_config({"data": raw}), cluster=cluster, on_event=None)


def test_a_source_not_read_as_collections_says_which_are():
    from workers.sources import get_source

    # Which sources are read as collections, and that each module agrees, is checked with the
    # whole registry (tests/test_preprocess.py).
    with pytest.raises(ValueError, match=r"data\.dataset: 'digits' is not one of"):
        get_source("digits").collections(DataConfig(dataset="digits"), seed=0)


def test_dask_train_run_trains_from_zarr_arrays_by_config_and_refuses_bad_ones(cluster, tmp_path):
    # Through the CLI: its data-root check before anything starts once refused "zarr" as an
    # unknown dataset, though train() took it.
    import json

    import zarr

    from tests.commands import run_dask_train

    x, y = _images(500, 0)
    group = zarr.open_group(str(tmp_path / "arrays.zarr"), mode="w")
    group.create_array("images", data=x, chunks=(64, 3, 8, 8))
    group.create_array("labels", data=y, chunks=(64,))
    config = tmp_path / "zarr.toml"
    config.write_text(
        "[data]\n"
        'dataset = "zarr"\n'
        f"root = {str(tmp_path / 'arrays.zarr')!r}\n"
        'features = ["images"]\n'
        'target = "labels"\n'
        "[training]\n"
        "epochs = 1\n"
        "batch_size = 64\n"
    )
    on_cluster = ("--scheduler", cluster.client.scheduler.address)

    def run(*args: str) -> subprocess.CompletedProcess:
        return run_dask_train(*args, *on_cluster, timeout=180)

    output = tmp_path / "run"
    done = run("run", str(config), "--output", str(output))
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((output / "summary.json").read_text())
    assert summary["epochs"] == 1 and summary["samples"] > 0, summary

    # Bad input is exit 2 and one line naming the field: an array the group lacks (found once
    # the run reads it), a root that does not exist (before a cluster is asked for anything),
    # and a store to preprocess, which collections do not have.
    cases = {
        ("run", "--set", "data.target='labelz'"): "data.target: no zarr array 'labelz'",
        ("run", "--set", f"data.root='{tmp_path / 'gone.zarr'}'"): "data.root: ",
        ("preprocess",): "data.dataset: zarr is read as Dask collections",
    }
    for i, ((command, *overrides), message) in enumerate(cases.items()):
        extra = ("--output", str(tmp_path / f"refused-{i}")) if command == "run" else ()
        refused = run(command, str(config), *overrides, *extra)
        assert refused.returncode == 2, (command, overrides, refused.stderr[-3000:])
        (line,) = refused.stderr.strip().splitlines()
        assert message in line, line
