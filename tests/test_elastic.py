"""Elastic jobs (``launch.world_size = "min:max"``) on real clusters: workers joining, retired,
closed by SIGTERM, SIGKILLed, taken back by a queued job and by an adaptive cluster; the
parameters equal one process's on the same global batches, with no step redone."""

import contextlib
import itertools
import os
import re
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import cloudpickle
import dask
import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from distributed import Client
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from tests.commands import stock_dask_worker
from tests.machine_local_store import LOCAL_STORE_URL, copy_store
from tests.reference import Reference, assert_equivalent, train_in_one_process
from tests.test_launch import _data, _model
from workers import elastic, preparation
from workers.data import (
    SampleOrder,
    as_features,
    epoch_blocks,
    epoch_order,
    open_store,
    rank_block_indices,
    rank_epoch_indices,
)
from workers.models import ModelConfig, build_model
from workers.rank_context import RankJob
from workers.spec.layout import Layout
from workers.train import TrainJob, run_rank
from workflows import launch, start_cluster, train
from workflows.cluster.training_cluster import live_workers
from workflows.data.preprocess import prepare_store
from workflows.jobs.admission import Request, WorkerQueue, WorkerSelection
from workflows.jobs.launcher import LaunchConfig, admit
from workflows.observe.monitoring import queue_snapshot
from workflows.runs.config import ConfigError, load_config

GLOBAL_BATCH = 60  # every world from 1 to 5 splits it evenly: DDP's mean is the batch's
WAIT_S = 60.0  # each phase of a test: the cluster and the job must get there within it


def _batch(step: int, n: int) -> torch.Tensor:
    order = torch.randperm(n, generator=torch.Generator().manual_seed(step // (n // GLOBAL_BATCH)))
    start = (step % (n // GLOBAL_BATCH)) * GLOBAL_BATCH
    return order[start : start + GLOBAL_BATCH]


def elastic_loop(ctx, stop_file: str, delay_s: float) -> tuple[dict, int]:
    """A user's DDP loop for any world: each rank takes its share of every global batch. It
    trains until ``stop_file`` exists (the ranks agree on it every 5 steps), then returns its
    parameters and the steps taken."""
    x, y = _data()
    model = DistributedDataParallel(_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    step = ctx.restore({"model": model, "optimizer": optimizer}) or 0
    share = GLOBAL_BATCH // ctx.world_size
    while True:
        index = _batch(step, len(y))[ctx.rank * share : (ctx.rank + 1) * share]
        optimizer.zero_grad()
        F.cross_entropy(model(x[index]), y[index]).backward()
        optimizer.step()
        step += 1
        ctx.report(step=step, world=ctx.world_size)
        ctx.step_done(step)  # last in the step: the world may change here
        if step % 5 == 0:
            stop = torch.tensor([float(os.path.exists(stop_file))])
            dist.all_reduce(stop)
            if stop.item():
                return {k: v.detach().clone() for k, v in model.module.state_dict().items()}, step
        time.sleep(delay_s)


def _one_process(steps: int, dtype: torch.dtype, repeat: int | None = None) -> dict:
    """The reference: each global batch in one pass; ``repeat``: that step done twice (a
    resize that redid it)."""
    x, y = _data()
    x = x.to(dtype)
    model = _model().to(dtype)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    schedule = list(range(steps))
    if repeat is not None:
        schedule.insert(repeat, repeat)
    for step in schedule:
        index = _batch(step, len(y))
        optimizer.zero_grad()
        F.cross_entropy(model(x[index]), y[index]).backward()
        optimizer.step()
    return model.state_dict()


class Watch:
    """The job's records as they arrive, and bounded waits for what the test needs."""

    def __init__(self) -> None:
        self.records: list[dict] = []
        self._changed = threading.Condition()

    def __call__(self, record: dict) -> None:
        with self._changed:
            self.records.append(record)
            self._changed.notify_all()

    def until(self, what: str, ready: Callable[[list[dict]], bool]) -> None:
        with self._changed:
            failed = lambda: any(r["kind"] == "failed" for r in self.records)  # noqa: E731
            done = self._changed.wait_for(lambda: ready(self.records) or failed(), WAIT_S)
            if failed():
                error = next(r.get("error") for r in self.records if r["kind"] == "failed")
                raise AssertionError(f"the job failed before: {what}") from error
            if not done:
                kinds = [(r["kind"], r.get("world"), r.get("step")) for r in self.records[-5:]]
                raise AssertionError(f"not within {WAIT_S:g} s: {what} (last records: {kinds})")

    def resized_to(self, size: int) -> Callable[[list[dict]], bool]:
        """A resize record to a world of ``size``."""
        return lambda records: any(r["kind"] == "resized" and r["to"] == size for r in records)

    def world(self, size: int, *, after: int = 0) -> Callable[[list[dict]], bool]:
        """Reports from a world of ``size`` that come after ``after`` records."""
        return lambda records: any(
            r["kind"] == "report" and r["world"] == size for r in records[after:]
        )


class Background:
    """``job(on_event)`` (a ``launch`` or a ``train``) on a thread while the test changes the
    cluster. On leaving, ``release`` is touched (the job's stop file, or its pacing's), the
    job is waited for, and what it raised is raised here; ``result`` is what it returned."""

    def __init__(self, job: Callable[[Watch], object], release: "os.PathLike[str]") -> None:
        self.watch, self.release = Watch(), release
        self.result: object = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(job,))

    def _run(self, job: Callable[[Watch], object]) -> None:
        try:
            self.result = job(self.watch)
        except BaseException as error:
            self._error = error
            self.watch({"kind": "failed", "error": error})

    def __enter__(self) -> Watch:
        self._thread.start()
        return self.watch

    def __exit__(self, *exc: object) -> None:
        open(self.release, "a").close()
        self._thread.join(timeout=WAIT_S)
        if self._error is not None and exc[0] is None:
            raise self._error


def elastic_job(
    cluster, stop_file, world_size: str | int, delay_s: float = 0.02, **launch_kwargs
) -> Background:
    """``elastic_loop`` on ``cluster`` in the background until ``stop_file`` exists; each step
    sleeps ``delay_s`` besides (longer where the test waits for cold processes: fewer steps for
    the one-process reference to train again)."""
    return Background(
        lambda watch: launch(
            elastic_loop,
            str(stop_file),
            delay_s,
            cluster=cluster,
            world_size=world_size,
            on_event=watch,
            **launch_kwargs,
        ),
        stop_file,
    )


def _grown(resizes: list[tuple[int, int, str]], low: int, high: int) -> bool:
    """Whether ``resizes`` (from, to, cause) grew the job from ``low`` to ``high`` as workers
    joined: new workers of one scale-up may join over a while, a resize for each."""
    return (
        bool(resizes)
        and all(cause == "joined" for *_, cause in resizes)
        and resizes[0][0] == low
        and resizes[-1][1] == high
        and all(a[1] == b[0] for a, b in itertools.pairwise(resizes))
    )


def no_restart(dask_worker) -> None:
    """Run on a nanny: when its worker process dies, it closes instead of starting another."""
    dask_worker.close_gracefully(reason="a spot instance reclaimed")


def _victim(client) -> tuple[str, int]:
    """A worker holding a rank other than 0 (the last in rank order), and its process id."""
    workers = live_workers(client)
    address = max(workers, key=lambda a: int(workers[a]["name"]))
    return address, client.run(os.getpid, workers=[address])[address]


@pytest.mark.equivalence
@pytest.mark.timeout(240)
def test_a_job_grows_on_join_and_shrinks_by_sigkill_sigterm_and_retire_redoing_nothing(
    tmp_path,
):
    stop_file = tmp_path / "stop"
    with start_cluster(n_workers=2, dashboard_port=0) as training_cluster:
        client = training_cluster.client
        job = elastic_job(training_cluster, stop_file, "2:5", config={"worker_wait_s": 120.0})
        with job as watch:
            watch.until("2 ranks training", watch.world(2))
            training_cluster.cluster.scale(5)
            watch.until("grown to 5", watch.world(5))
            address, _ = _victim(client)
            seen = len(watch.records)
            client.retire_workers([address])
            watch.until("4 ranks after retire_workers", watch.world(4, after=seen))
            address, pid = _victim(client)
            seen = len(watch.records)
            os.kill(pid, signal.SIGTERM)  # a spot instance's notice
            watch.until("3 ranks after the SIGTERM", watch.world(3, after=seen))
            address, pid = _victim(client)
            # Gone for good, as a spot instance is: its nanny does not start it again.
            client.run(no_restart, nanny=True, workers=[address])
            seen = len(watch.records)
            os.kill(pid, signal.SIGKILL)
            watch.until("2 ranks after the SIGKILL", watch.world(2, after=seen))
    result = job.result
    causes = [(r["from"], r["to"], r["cause"]) for r in result.resizes]
    assert causes[-3:] == [(5, 4, "retired"), (4, 3, "retired"), (3, 2, "lost")], causes
    assert _grown(causes[:-3], 2, 5), causes
    # A live replica holds every step: none is done again, not even after the SIGKILL.
    assert {r["redone_steps"] for r in result.resizes} == {0}
    assert all(r["pause_s"] is not None and r["pause_s"] >= 0 for r in result.resizes)
    resized = [r for r in watch.records if r["kind"] == "resized"]
    assert [r["cause"] for r in resized] == [c for *_, c in causes]  # on_event saw each one
    # Rank 0 (never a victim) reported every step once, in order, across the five worlds.
    _, steps = result.results[0]
    assert [r["step"] for r in result.metrics[0]] == list(range(1, steps + 1))
    assert {r["world"] for r in result.metrics[0]} == {2, 3, 4, 5}
    reference = Reference.of(lambda dtype: _one_process(steps, dtype), steps=steps)
    planted = {
        "a step redone at a resize": _one_process(steps, torch.float64, repeat=steps // 2),
        "the last step skipped": _one_process(steps - 1, torch.float64),
    }
    for rank_parameters, rank_steps in result.results:
        assert rank_steps == steps
        assert_equivalent(rank_parameters, reference, planted=planted)


DIES_AT, LAST_STEP = 4, 10


def _rank_0_lost_after_its_step(ctx) -> int:
    """A user's DDP loop that reports before ``step_done``; in the first world, rank 0's
    worker process is SIGKILLed at step ``DIES_AT`` after the step's all-reduce, before its
    report: its peer finished the step and kept its state there."""
    x, y = _data()
    model = DistributedDataParallel(_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    step = ctx.restore({"model": model, "optimizer": optimizer}) or 0
    share = GLOBAL_BATCH // ctx.world_size
    while step < LAST_STEP:
        index = _batch(step, len(y))[ctx.rank * share : (ctx.rank + 1) * share]
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x[index]), y[index])
        loss.backward()
        optimizer.step()
        step += 1
        if step == DIES_AT and ctx.rank == 0 and ctx.attempt == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        ctx.report(step=step, loss=loss.item())
        ctx.step_done(step)
    return step


@pytest.mark.timeout(120)
def test_rank_0s_history_holds_every_step_once_after_its_worker_is_sigkilled(own_cluster):
    events: list[dict] = []
    result = launch(
        _rank_0_lost_after_its_step, cluster=own_cluster, world_size="1:2", on_event=events.append
    )
    assert result.results[0] == LAST_STEP
    assert result.recoveries[0]["resumed_from_step"] == DIES_AT  # the peer's state
    steps = list(range(1, LAST_STEP + 1))
    assert [r["step"] for r in result.metrics[0]] == steps
    # What on_event saw (what `dask-train launch` writes to metrics.jsonl): the same, once.
    reported = [r for r in events if r["kind"] == "report" and r["rank"] == 0]
    assert sorted(r["step"] for r in reported) == steps
    # The steps rank 0 never got out are its peer's records of them, saying so: the one it
    # died in, and those its worker had not sent yet (Dask batches a worker's events; seen: 3).
    stood_in = [
        (r["step"], r["reported_by_rank"]) for r in result.metrics[0] if "reported_by_rank" in r
    ]
    assert stood_in, "no stand-in: the step rank 0 died in is missing"
    assert stood_in == [(step, 1) for step in range(stood_in[0][0], DIES_AT + 1)], stood_in


@pytest.mark.equivalence
@pytest.mark.timeout(120)
def test_a_cold_stock_worker_prepares_while_the_job_trains_then_joins_it(tmp_path):
    # A `dask worker` process started mid-run, as a deployment adds one: torch and the job's
    # code are imported there while the two ranks train on; they stop only once it is ready.
    stop_file = tmp_path / "stop"
    with start_cluster(n_workers=2, dashboard_port=0) as training_cluster:
        client = training_cluster.client
        first = set(live_workers(client))
        job = elastic_job(training_cluster, stop_file, "2:3", 0.1)
        with job as watch:
            watch.until("2 ranks training", watch.world(2))
            scheduler = client.scheduler.address
            with stock_dask_worker(scheduler, tmp_path / "worker.log"):
                watch.until("grown to 3", watch.world(3))
                (newcomer,) = set(live_workers(client)) - first
                prepared = client.run(preparation.prepared, workers=[newcomer])[newcomer]
                open(stop_file, "a").close()
                job._thread.join(WAIT_S)
    result = job.result
    causes = [(r["from"], r["to"], r["cause"]) for r in result.resizes]
    assert causes == [(2, 3, "joined")], causes
    # Ready before the ranks were asked to stop for it: the switch did not wait for its imports.
    assert list(prepared) == [result.job_id]
    assert prepared[result.job_id]["at"] < result.resizes[0]["at"]
    assert set(prepared[result.job_id]) == {"at"}  # a launch(fn) job's: nothing opened ahead
    assert {r["redone_steps"] for r in result.resizes} == {0}
    _, steps = result.results[0]
    assert [r["step"] for r in result.metrics[0]] == list(range(1, steps + 1))
    reference = Reference.of(lambda dtype: _one_process(steps, dtype), steps=steps)
    planted = {"a step redone at the resize": _one_process(steps, torch.float64, repeat=steps // 2)}
    for rank_parameters, rank_steps in result.results:
        assert rank_steps == steps
        assert_equivalent(rank_parameters, reference, planted=planted)


def _broken_torch(tmp_path: Path) -> dict[str, str]:
    """The environment of a machine whose torch is broken (a library it cannot load): its
    `dask worker` starts, but cannot import torch."""
    broken = tmp_path / "broken-site" / "torch"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text(
        'raise ImportError("libtorch_cpu.so: cannot open shared object file")\n'
    )
    return {"PYTHONPATH": f"{broken.parent}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def _queued_1_rank_job(client: Client) -> tuple[list[str], dict[str, int]]:
    """What a 1-rank job arriving now is granted, and how many workers each job then holds."""
    queued = admit(
        client,
        LaunchConfig(world_size=1, queue_timeout_s=WAIT_S / 3),
        job_id="queued-1-rank",
        name="queued",
    )
    with queued:
        granted = queued.hold()
        holding = client.run_on_scheduler(queue_snapshot)["holding"]
    return granted, {h["job_id"]: h["workers"] for h in holding}


@pytest.mark.timeout(120)
def test_a_joining_worker_that_cannot_prepare_is_left_out_and_handed_back(tmp_path, caplog):
    # A broken machine's worker joins: the job must not stop for it, nor fail: it names it and
    # goes on. Nor may it hold it: a 2:3 job would sit at its maximum with the worker idle,
    # and a queued job would wait for it. It hands it back, and is not given it again.
    stop_file = tmp_path / "stop"
    with start_cluster(n_workers=2, dashboard_port=0) as training_cluster:
        client = training_cluster.client
        first = set(live_workers(client))
        job = elastic_job(training_cluster, stop_file, "2:3")
        with job as watch, caplog.at_level("WARNING", logger="workflows.jobs.controller"):
            watch.until("2 ranks training", watch.world(2))
            scheduler = client.scheduler.address
            log = tmp_path / "worker.log"
            with stock_dask_worker(scheduler, log, env=_broken_torch(tmp_path)):
                client.wait_for_workers(3, timeout=WAIT_S)
                (newcomer,) = set(live_workers(client)) - first
                deadline = time.monotonic() + WAIT_S
                while "failed to prepare" not in caplog.text and time.monotonic() < deadline:
                    time.sleep(0.1)
                seen = len(watch.records)
                watch.until("still training", lambda r: len(r) >= seen + 10)
                granted, held = _queued_1_rank_job(client)
    assert granted == [newcomer]
    assert caplog.text.count(f"leaving worker {newcomer} out, it failed to prepare") == 1
    assert "libtorch_cpu.so" in caplog.text
    assert job.result.resizes == []  # never stopped for it
    assert {r["world"] for r in job.result.metrics[0]} == {2}
    assert held == {job.result.job_id: 2, "queued-1-rank": 1}


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_first_generations_worker_that_cannot_prepare_is_left_out_and_handed_back(
    tmp_path, caplog
):
    # The broken machine's worker is there before the job: granted 3 of 2:3, the job prepares
    # it before its first group forms, forms on the 2 others, and hands it back.
    stop_file = tmp_path / "stop"
    with start_cluster(n_workers=2, dashboard_port=0) as training_cluster:
        client = training_cluster.client
        first = set(live_workers(client))
        scheduler = client.scheduler.address
        log = tmp_path / "worker.log"
        with stock_dask_worker(scheduler, log, env=_broken_torch(tmp_path)):
            client.wait_for_workers(3, timeout=WAIT_S)
            (broken,) = set(live_workers(client)) - first
            job = elastic_job(training_cluster, stop_file, "2:3")
            with caplog.at_level("WARNING", logger="workflows.jobs.controller"), job as watch:
                watch.until("2 ranks training", watch.world(2))
                granted, held = _queued_1_rank_job(client)
    assert f"leaving worker {broken} out, it failed to prepare" in caplog.text
    assert granted == [broken]
    assert held == {job.result.job_id: 2, "queued-1-rank": 1}
    assert job.result.resizes == []
    assert {r["world"] for r in job.result.metrics[0]} == {2}


LOCAL_STORE_PRELOAD = str(Path(__file__).with_name("machine_local_store.py"))


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_trainers_newcomer_opens_the_store_and_builds_the_model_first_one_without_it_is_left_out(
    make_config, cluster, tmp_path, caplog
):
    # The data on each machine's own disk (tests/machine_local_store.py: a copy in each
    # process's memory://): the cluster's workers hold one, a stock `dask worker` started
    # mid-run does not. Its preparation opens the store and fails: it is named and left out,
    # the job trains on. A worker of the cluster's that joins next opened the store and built
    # the model on the meta device before the ranks stopped for it.
    on_disk = make_config()
    prepare_store(cluster.client, on_disk.data.resolved(), seed=on_disk.training.seed)
    copy_store(on_disk.data.store_url)  # the client reads the store's manifest too
    config = make_config(
        {
            "name": "elastic-prepared",
            "launch": {"world_size": "2:4"},
            "data": {"drop_last": True, "store": LOCAL_STORE_URL},
            # 0.6 s a step until the test is done resizing: 34 s for it, whatever the load;
            # after, the steps left (fewer, the longer each waits) run at full speed.
            "model": {"kwargs": {"released": str(tmp_path / "released"), "pause_s": 0.6}},
        },
        epochs=2,
        batch_size=50,
        lr=0.05,
        log_every_steps=1,
    )
    settings = {
        "distributed.worker.preload": [LOCAL_STORE_PRELOAD],
        "distributed.nanny.environ.DASK_TRAIN_TEST_LOCAL_STORE": on_disk.data.store_url,
    }
    with dask.config.set(settings), start_cluster(n_workers=2, dashboard_port=0) as training:
        client = training.client
        first = set(live_workers(client))
        job = trainer_job(training, config, tmp_path)
        with job as watch, caplog.at_level("WARNING", logger="workflows.jobs.controller"):
            watch.until("training", lambda rs: any(r["kind"] == "step" for r in rs))
            with stock_dask_worker(client.scheduler.address, tmp_path / "worker.log"):
                client.wait_for_workers(3, timeout=WAIT_S)
                (stranger,) = set(live_workers(client)) - first
                deadline = time.monotonic() + WAIT_S
                while "failed to prepare" not in caplog.text and time.monotonic() < deadline:
                    time.sleep(0.1)
                seen = len(watch.records)
                watch.until("still training", lambda r: len(r) >= seen + 5)
                training.cluster.scale(3)
                watch.until("grown to 3", watch.resized_to(3))
                (joined,) = set(live_workers(client)) - first - {stranger}
                prepared = client.run(preparation.prepared, workers=[joined])[joined]
    assert f"leaving worker {stranger} out, it failed to prepare" in caplog.text
    assert f"data.store: {LOCAL_STORE_URL} cannot be read from this worker" in caplog.text
    result = job.result
    assert [(r["from"], r["to"], r["cause"]) for r in result.resizes] == [(2, 3, "joined")]
    (resize,) = result.resizes
    assert resize["redone_steps"] == 0
    # The state went to the newcomer by broadcast, within the pause (its share said apart).
    assert 0 < resize["broadcast_s"] < resize["pause_s"]
    found = prepared[result.job_id]
    assert found["at"] < result.resizes[0]["at"]  # ready before the ranks were asked to stop
    assert (found["store"], found["samples"]) == (LOCAL_STORE_URL, len(_digits_train(on_disk)))
    assert found["device"] == "meta"
    assert found["parameters"] == sum(v.numel() for v in result.state_dict.values())
    assert result.history[-1]["step"] == 2 * (len(_digits_train(on_disk)) // 50)


def _trainer_payload(config, **fields) -> bytes:
    """What the controller hands a worker to prepare for one rank of the built-in trainer's
    job on ``config``: its pickled `RankJob`; ``fields`` replace the `TrainJob`'s."""
    train_job = TrainJob(
        data=config.data.resolved(),
        model=config.model,
        training=config.training,
        layout=Layout(world_size=1, pp=1, dp=1, batch_size=config.training.batch_size),
    )
    return cloudpickle.dumps(
        RankJob(
            fn=run_rank,
            args=(replace(train_job, **fields),),
            kwargs={},
            name="prepared",
            generation="prepared-0",
            attempt=0,
            max_failures=0,
            event_topic="prepared-events",
            heartbeat_topic="prepared-heartbeats",
        )
    )


def test_a_worker_prepares_a_trainer_rank_by_its_store_and_model_and_names_what_fails(
    cluster, make_config
):
    # What the controller asks each newcomer (workers/preparation.py), on a real worker: the
    # store opened and read, the model built on the meta device; a model whose code this
    # worker lacks (a library not installed on its machine) fails naming the field.
    config = make_config()
    prepare_store(cluster.client, config.data.resolved(), seed=config.training.seed)
    client = cluster.client
    worker = sorted(live_workers(client))[0]

    def prepare(job_id: str, payload: bytes) -> object:
        answers = client.run(
            preparation.prepare, job_id, payload, None, 30.0, workers=[worker], on_error="return"
        )
        return answers[worker]

    took = prepare("prepared-ok", _trainer_payload(config))
    assert {"torch_s", "code_s", "data_s", "model_s"} <= set(took), took
    found = client.run(preparation.prepared, workers=[worker])[worker]["prepared-ok"]
    store = open_store(config.data.resolved().store_url)
    model = build_model(
        config.model, num_classes=store.num_classes, seed=0, input_shape=(3, 32, 32)
    )
    assert found["store"] == config.data.resolved().store_url
    assert found["samples"] == len(store.train)
    assert (found["device"], found["parameters"]) == (
        "meta",
        sum(p.numel() for p in model.parameters()),
    )
    missing = ModelConfig(name="a_library_not_installed_here:build")
    failed = prepare("prepared-bad", _trainer_payload(config, model=missing))
    assert isinstance(failed, preparation.PreparationFailed), failed
    assert str(failed).startswith(
        "model.name: a_library_not_installed_here:build cannot be built on this worker"
    )
    assert "prepared-bad" not in client.run(preparation.prepared, workers=[worker])[worker]


@pytest.mark.equivalence
@pytest.mark.timeout(120)
def test_a_sigkilled_worker_under_a_warm_stock_nanny_comes_back_needing_no_preparation(tmp_path):
    # `dask worker --preload-nanny workflows.cluster.warm_workers`: the nanny forks its worker
    # processes from a fork server that imported torch, so the process it starts after a
    # SIGKILL takes the lost rank without importing anything (a cold one is prepared first).
    stop_file = tmp_path / "stop"
    with start_cluster(n_workers=1, dashboard_port=0) as training_cluster:
        client = training_cluster.client
        (forked,) = live_workers(client)
        warm = ("--preload-nanny", "workflows.cluster.warm_workers")
        with (
            contextlib.ExitStack() as stack,
            stock_dask_worker(client.scheduler.address, tmp_path / "worker.log", *warm),
        ):
            client.wait_for_workers(2, timeout=WAIT_S)
            (stock,) = set(live_workers(client)) - {forked}
            # Connected by address, as to a cluster started by hand: it may have any workers.
            by_address = stack.enter_context(Client(client.scheduler.address))
            job = elastic_job(by_address, stop_file, 2, 0.1)
            with job as watch:
                watch.until("2 ranks training", watch.world(2))
                os.kill(client.run(os.getpid, workers=[stock])[stock], signal.SIGKILL)
                seen = len(watch.records)
                watch.until("recovered", lambda r: any(x["kind"] == "recovery" for x in r[seen:]))
                watch.until("training again", watch.world(2, after=seen + 1))
                (replacement,) = set(live_workers(client)) - {forked}
                prepared = client.run(preparation.prepared, workers=[replacement])[replacement]
    result = job.result
    assert [r["recovered_from"] for r in result.recoveries] == ["replica"]
    assert replacement != stock and prepared == {}  # no preparation: torch was loaded already
    _, steps = result.results[0]
    reference = Reference.of(lambda dtype: _one_process(steps, dtype), steps=steps)
    for rank_parameters, rank_steps in result.results:
        assert rank_steps == steps
        assert_equivalent(rank_parameters, reference)


def _fixed_job(ctx) -> int:
    ctx.report(world=ctx.world_size)
    return ctx.world_size


@pytest.mark.timeout(180)
def test_a_queued_job_then_an_adaptive_cluster_take_workers_from_an_elastic_job(tmp_path):
    stop_file = tmp_path / "stop"
    with start_cluster(n_workers=4, dashboard_port=0) as training_cluster:
        job = elastic_job(training_cluster, stop_file, "2:4")
        with job as watch:
            watch.until("4 ranks training", watch.world(4))
            seen = len(watch.records)
            queued = launch(_fixed_job, cluster=training_cluster, world_size=2)
            assert queued.results == [2, 2]
            # Its ranks started once the elastic job gave two workers back at a step boundary.
            assert 0 < queued.first_step_s <= queued.wall_s
            watch.until("the elastic job on 2", watch.world(2, after=seen))
            seen = next(i for i, r in enumerate(watch.records) if i >= seen and r.get("world") == 2)
            watch.until("grown back to 4", watch.world(4, after=seen))
            # An adaptive cluster may retire what an elastic job holds above its minimum.
            seen = len(watch.records)
            training_cluster.cluster.adapt(minimum=2, maximum=2, interval="200ms", wait_count=1)
            watch.until("the elastic job down to 2 again", watch.world(2, after=seen))
    causes = [(r["from"], r["to"], r["cause"]) for r in job.result.resizes]
    assert causes[0] == (4, 2, "yielded"), causes
    retired = [i for i, c in enumerate(causes) if c[2] == "retired"]
    assert _grown(causes[1 : retired[0]], 2, 4), causes
    assert causes[retired[0]][0] == 4 and causes[-1][1] == 2, causes
    assert all(c[2] == "retired" for c in causes[retired[0] :]), causes
    assert {r["redone_steps"] for r in job.result.resizes} == {0}


def _until_exists(ctx, path: str) -> int:
    """Runs until ``path`` exists, never passing a step boundary (no ``step_done``)."""
    ctx.report(world=ctx.world_size)
    while not os.path.exists(path):
        ctx.heartbeat()
        time.sleep(0.05)
    return ctx.world_size


def _holding(cluster, release, world_size) -> Background:
    return Background(
        lambda watch: launch(
            _until_exists, str(release), cluster=cluster, world_size=world_size, on_event=watch
        ),
        release,
    )


def _started(records: list[dict]) -> bool:
    return any(r["kind"] == "report" for r in records)


@pytest.mark.timeout(120)
def test_an_elastic_job_without_step_boundaries_is_not_given_a_worker_a_queued_job_needs(
    cluster, tmp_path
):
    first = _holding(cluster, tmp_path / "first", 1)
    job = _holding(cluster, tmp_path / "elastic", "1:2")
    with first as first_watch:
        first_watch.until("the first job on one worker", _started)
        with job as watch:
            watch.until("the elastic job on the other", _started)
            first.__exit__(None, None, None)  # its worker is free now
            # The elastic job could only use it by stopping at a step boundary, which it
            # never reaches: the worker stays free, for the job that needs it.
            queued = launch(
                _fixed_job, cluster=cluster, world_size=1, config={"queue_timeout_s": 20.0}
            )
            assert queued.results == [1]
    assert job.result.results == [1] and job.result.resizes == []


def _refuse_the_next_resize_request() -> None:
    """On a worker (``Client.run``): its next resize request fails, as on a worker too busy to
    take it, then requests are taken again."""
    taking = elastic.request_resize

    def refusing(*args, **kwargs):
        elastic.request_resize = taking
        raise RuntimeError("a worker too busy to take the request")

    refusing.taking = taking
    elastic.request_resize = refusing


def _take_resize_requests() -> None:
    elastic.request_resize = getattr(elastic.request_resize, "taking", elastic.request_resize)


@pytest.mark.timeout(120)
def test_a_resize_request_that_failed_is_sent_again(cluster, tmp_path):
    stop_file = tmp_path / "stop"
    client = cluster.client
    try:
        with elastic_job(cluster, stop_file, "1:2") as watch:
            watch.until("2 ranks training", watch.world(2))
            client.run(_refuse_the_next_resize_request)  # on both ranks' workers
            # The queued job needs a worker back: the first request reaches no rank.
            queued = launch(
                _fixed_job, cluster=cluster, world_size=1, config={"queue_timeout_s": 20.0}
            )
            assert queued.results == [1]
    finally:
        client.run(_take_resize_requests)
    causes = [(r["from"], r["to"], r["cause"]) for r in watch.records if r["kind"] == "resized"]
    assert causes[0] == (2, 1, "yielded"), causes


def _jobqueue_local_cluster() -> type:
    """dask-jobqueue's LocalCluster class, imported with this process's Ctrl-C left as it was:
    importing dask_jobqueue sets the importing process's SIGINT handler to ``sys.exit``
    (dask_jobqueue/runner.py, at import, 0.9.0), and every later Ctrl-C test of the suite then
    got SystemExit instead of KeyboardInterrupt (tests/conftest.py now fails a test that
    leaves the handler changed)."""
    handler = signal.getsignal(signal.SIGINT)
    try:
        from dask_jobqueue.local import LocalCluster
    finally:
        signal.signal(signal.SIGINT, handler)
    return LocalCluster


@pytest.mark.equivalence
@pytest.mark.timeout(180)
def test_on_a_dask_jobqueue_cluster_adapting_2_to_4_an_elastic_job_grows_and_shrinks(tmp_path):
    # dask-jobqueue's local cluster: the deployment library of HPC users, whose workers are
    # new `dask worker` processes started (and SIGKILLed) by the cluster as it adapts, the way
    # it submits batch jobs; picked over dask-gateway's local backend because it needs no
    # gateway server and starts a worker in one process. A queued 2-rank job raises the
    # adaptive target from 2 to 4; once it is done the 2:4 job grows into the two new
    # workers, and gives them back as the cluster adapts down to 2 (retiring them, then
    # SIGKILLing their processes, as dask-jobqueue cancels a batch job).
    JobQueueLocalCluster = _jobqueue_local_cluster()
    stop_file = tmp_path / "stop"
    with (
        JobQueueLocalCluster(
            cores=1,
            processes=1,
            memory="2GiB",
            local_directory=str(tmp_path),
            worker_extra_args=["--no-dashboard"],
            scheduler_options={"host": "127.0.0.1", "dashboard_address": ":0"},
        ) as cluster,
        Client(cluster) as client,
    ):
        # Down only after 5 s below target: the freed workers serve the elastic job meanwhile.
        cluster.adapt(minimum=2, maximum=4, interval="500ms", wait_count=10)
        client.wait_for_workers(2, timeout=WAIT_S)
        job = elastic_job(client, stop_file, "2:4", 0.1, config={"worker_wait_s": WAIT_S})
        with job as watch:
            watch.until("2 ranks training", watch.world(2))
            queued = launch(
                _fixed_job, cluster=client, world_size=2, config={"worker_wait_s": WAIT_S}
            )
            assert queued.results == [2, 2]
            watch.until("grown to 4", watch.world(4))
            # Its four running ranks keep the scheduler's own target at 4: a smaller maximum
            # takes the cluster down (the existing test's way, on a cluster that adapts).
            seen = len(watch.records)
            cluster.adapt(minimum=2, maximum=2, interval="200ms", wait_count=1)
            watch.until("back to 2 as the cluster adapts down", watch.world(2, after=seen))
    result = job.result
    causes = [(r["from"], r["to"], r["cause"]) for r in result.resizes]
    # Retired, and SIGKILLed at once: a rank that had not handed off yet is a lost worker.
    retired = [i for i, c in enumerate(causes) if c[2] in ("retired", "lost")]
    assert retired and _grown(causes[: retired[0]], 2, 4), causes
    assert causes[retired[0]][0] == 4 and causes[-1][1] == 2, causes
    assert all(c[2] in ("retired", "lost") for c in causes[retired[0] :]), causes
    assert {r["redone_steps"] for r in result.resizes} == {0}
    # (Rank 0's history is not checked here: the SIGKILL may take rank 0's worker, and its
    # in-flight step's report is issue 58's history hole, tested on its own.)
    _, steps = result.results[0]
    reference = Reference.of(lambda dtype: _one_process(steps, dtype), steps=steps)
    planted = {"a step redone at a resize": _one_process(steps, torch.float64, repeat=steps // 2)}
    for rank_parameters, rank_steps in result.results:
        assert rank_steps == steps
        assert_equivalent(rank_parameters, reference, planted=planted)


# -- the queue's decisions, on a real scheduler ------------------------------------------------


def _ask(requests: list[Request], dask_scheduler) -> dict:
    queue = dask_scheduler.plugins.get("dask-train-queue")
    if queue is None:
        queue = WorkerQueue()
        queue.scheduler = dask_scheduler
        dask_scheduler.plugins[queue.name] = queue
    queue.entries.clear()
    statuses = {}
    for request in requests:
        statuses[request.job_id] = queue.request(request)
        if request.elastic:  # its ranks passed a step boundary: it resizes when asked
            queue.resizes(request.job_id)
    return {job_id: queue.status(job_id) for job_id in statuses}


def _request(job_id: str, low: int, high: int, priority: int = 0) -> Request:
    return Request(
        job_id=job_id,
        name=job_id,
        client="test",
        minimum=low,
        maximum=high,
        selection=WorkerSelection(),
        priority=priority,
        elastic=low < high,
    )


def test_the_queue_asks_elastic_jobs_above_their_minimum_never_fixed_ones_by_priority(cluster):
    client = cluster.client  # 2 workers
    # An elastic 1:2 job holds both; a fixed 1-rank job arriving later gets one at its boundary.
    status = client.run_on_scheduler(_ask, [_request("e", 1, 2), _request("f", 1, 1)])
    assert len(status["e"]["granted"]) == 2 and len(status["e"]["yielding"]) == 1
    assert status["f"]["waiting"]
    # A fixed job is never asked to give a worker back.
    status = client.run_on_scheduler(_ask, [_request("a", 2, 2), _request("f", 1, 1)])
    assert status["a"]["yielding"] == [] and status["f"]["waiting"]
    # An elastic job of higher priority keeps its workers for a lower one ...
    status = client.run_on_scheduler(_ask, [_request("e", 1, 2, 5), _request("f", 1, 1, 0)])
    assert status["e"]["yielding"] == []
    # ... and a higher priority is served first: the later job gets what the earlier waits for.
    status = client.run_on_scheduler(
        _ask, [_request("a", 2, 2), _request("low", 2, 2, 0), _request("high", 2, 2, 1)]
    )
    queued = client.run_on_scheduler(
        lambda dask_scheduler: dask_scheduler.plugins["dask-train-queue"].queued()
    )
    assert [q["job_id"] for q in queued] == ["high", "low"]
    client.run_on_scheduler(_ask, [])  # leave the queue empty for the next test


def _downscaling(requests: list[Request], dask_scheduler) -> int:
    """How many of the cluster's workers ``cluster.adapt()`` may retire with ``requests``
    held (the queue's answer to the scheduler)."""
    _ask(requests, dask_scheduler)
    queue = dask_scheduler.plugins["dask-train-queue"]
    allowed = queue.valid_workers_downscaling(dask_scheduler, list(dask_scheduler.workers.values()))
    queue.entries.clear()
    return len(allowed)


def test_an_adaptive_cluster_retires_an_elastic_jobs_workers_above_its_minimum_only(cluster):
    run = cluster.client.run_on_scheduler  # 2 workers, both held by the elastic job
    assert run(_downscaling, [_request("at-min", 2, 3)]) == 0
    assert run(_downscaling, [_request("one-above", 1, 2)]) == 1


ASKED_AT, SAVED_AT, STEPS = 4, 2, 8


def _asked_by_rank_0(ctx) -> int:
    """Rank 0 alone asks for a resize during step ``ASKED_AT`` (as a worker that is leaving
    does); each rank reports the step it stopped at. A state no replica can stand in for
    (``replicated=False``): the next world continues from the checkpoint of ``SAVED_AT``."""
    model = nn.Linear(1, 1, bias=False)
    step = ctx.restore({"model": model}, replicated=False) or 0
    while step < STEPS:
        step += 1
        with torch.no_grad():
            model.weight.fill_(step)
        if step == SAVED_AT:
            ctx.save({"model": model}, step=step)
        if step == ASKED_AT and ctx.rank == 0 and ctx.attempt == 0:
            elastic.request_resize(ctx.boundary.generation, "joined")
        ctx.report(step=step)
        try:
            ctx.step_done(step)
        except elastic.ResizeBoundary:
            ctx.report(stopped_at=step)
            raise
    return int(model.weight.item())


# The vote taken without the peers' (each rank stopping where it was asked) left the rank
# nobody asked waiting for its peer until the hang bound: this bound fails it sooner.
@pytest.mark.timeout(120)
def test_one_rank_asked_stops_every_rank_one_step_later_and_a_checkpoint_counts_redone_steps(
    cluster, tmp_path
):
    result = launch(_asked_by_rank_0, cluster=cluster, world_size="1:2", checkpoint_dir=tmp_path)
    stopped = {r["rank"]: r["stopped_at"] for m in result.metrics for r in m if "stopped_at" in r}
    # The votes are summed: the rank nobody asked stops with the one asked, a step later.
    assert stopped == {0: ASKED_AT + 1, 1: ASKED_AT + 1}, stopped
    (resize,) = result.resizes
    # The next world continued from the checkpoint of SAVED_AT: the steps after it, redone.
    assert (resize["step"], resize["redone_steps"]) == (SAVED_AT, ASKED_AT + 1 - SAVED_AT)
    assert result.results == [STEPS, STEPS]


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ("3:2", "min (3) is above max (2)"),
        ("0:2", "at least 1 rank"),
        ("two:four", "neither a number of ranks nor a range"),
        ((2, 3, 4), "neither a number of ranks nor a range"),
    ],
)
def test_a_world_size_range_that_cannot_hold_is_refused_naming_the_field(given, message):
    with pytest.raises(ConfigError, match=rf"^launch\.world_size: .*{re.escape(message)}"):
        launch(_fixed_job, cluster=None, world_size=given)


def test_a_world_size_is_an_int_or_a_range():
    assert LaunchConfig(world_size="2:8").world_range == (2, 8)
    assert LaunchConfig(world_size=[2, 8]).elastic
    assert LaunchConfig(world_size="4").world_size == 4 and not LaunchConfig(world_size=4).elastic
    assert LaunchConfig(world_size="3:3").world_size == 3


# -- the built-in trainer -----------------------------------------------------------------------


class _Paced(nn.Module):
    """Lets the test act while the job trains: each forward waits ``pause_s`` until
    ``released`` exists (the one-process reference never waits)."""

    def __init__(self, released: str, pause_s: float) -> None:
        super().__init__()
        self.released, self.pause_s = released, pause_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not os.path.exists(self.released):
            time.sleep(self.pause_s)
        return x


def paced_model(num_classes: int, in_features: int, released: str = "", pause_s: float = 0.0):
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(in_features, 32),
        nn.Tanh(),
        nn.Linear(32, num_classes),
        _Paced(released, pause_s),
    )


def elastic_run(
    make_config, folder, world_size: str, strategy: str, elastic_batch: str = "global", **sections
) -> object:
    """A paced digits run of the built-in trainer on an elastic world: ``folder/released``
    ends its pacing."""
    return make_config(
        {
            "name": f"elastic-{strategy}",
            "launch": {"world_size": world_size, "elastic_batch": elastic_batch},
            "data": {"drop_last": True},
            # 0.2 s a step until the test is done resizing: 11 s for it, whatever the load.
            "model": {"kwargs": {"released": str(folder / "released"), "pause_s": 0.2}},
            **sections,
        },
        strategy=strategy,
        # Two epochs: over many more, float32's rounding of this model grows as large as the
        # difference between two orders of batches, and the check could tell nothing apart.
        epochs=2,
        # 3 ranks hold 17, 17 and 16 rows of each batch, 4 hold 13, 13, 12 and 12: the larger
        # shares weigh more, and the replicas' average is still the batch's mean loss.
        batch_size=50,
        lr=0.05,
        momentum=0.9,
        log_every_steps=1,
    )


def trainer_job(cluster, config, folder) -> Background:
    return Background(
        lambda watch: train(config, cluster=cluster, model=paced_model, on_event=watch),
        folder / "released",
    )


def assert_one_process_on_the_same_batches(result, config) -> None:
    """The same global batches in the same order as one process (an elastic epoch's order
    is one rank's alone): equal parameters. Had the ranks read a fixed world's shares (their
    own part of the epoch each, as a 2-rank run does), it would show."""
    steps = result.history[-1]["step"]
    assert steps == 2 * (len(_digits_train(config)) // 50)  # the epochs' every global batch

    def one_process(dtype: torch.dtype, world_size: int = 1) -> dict:
        return train_in_one_process(
            config, world_size=world_size, steps=steps, factory=paced_model, dtype=dtype
        )

    assert_equivalent(
        result.state_dict,
        Reference.of(one_process, steps=steps),
        planted={"a fixed 2-rank world's batches": one_process(torch.float64, world_size=2)},
    )


@pytest.mark.equivalence
@pytest.mark.timeout(240)
def test_the_trainer_resized_2_4_3_2_equals_one_process_on_the_same_global_batches(
    make_config, tmp_path
):
    config = elastic_run(make_config, tmp_path, "2:4", "ddp")
    with start_cluster(n_workers=2, dashboard_port=0) as training_cluster:
        client = training_cluster.client
        job = trainer_job(training_cluster, config, tmp_path)
        with job as watch:
            watch.until("training", lambda rs: any(r["kind"] == "step" for r in rs))
            training_cluster.cluster.scale(4)
            watch.until("grown to 4", watch.resized_to(4))
            address, _ = _victim(client)
            client.retire_workers([address])
            watch.until("3 after retire_workers", watch.resized_to(3))
            address, pid = _victim(client)
            client.run(no_restart, nanny=True, workers=[address])
            os.kill(pid, signal.SIGKILL)
            watch.until("2 after the SIGKILL", watch.resized_to(2))
    result = job.result
    causes = [(r["from"], r["to"], r["cause"]) for r in result.resizes]
    assert causes[-2:] == [(4, 3, "retired"), (3, 2, "lost")], causes
    assert _grown(causes[:-2], 2, 4), causes
    assert {r["redone_steps"] for r in result.resizes} == {0}
    assert_one_process_on_the_same_batches(result, config)


def _digits_train(config) -> np.ndarray:
    return open_store(config.data.resolved().store_url).train.labels


def test_every_sample_of_an_epoch_is_trained_once_across_resizes():
    n, global_batch = (
        1000,
        50,
    )  # 3 ranks take 17, 17 and 16 rows of each batch; 4 take 13, 13, 12, 12
    order = SampleOrder(n, seed=7, chunk_size=64, shuffle_window=4, drop_last=True)
    taken: list[int] = []
    # The world changes after batches 3 and 7 of the epoch: 2 ranks, then 4, then 3.
    for batch in range(n // global_batch):
        world = 2 if batch < 3 else 4 if batch < 7 else 3
        for rank in range(world):
            mine = rank_epoch_indices(
                order, epoch=1, rank=rank, world_size=world, global_batch=global_batch
            )
            share = len(mine) // (n // global_batch)
            taken += mine[batch * share : (batch + 1) * share].tolist()
    assert len(taken) == len(set(taken)) == (n // global_batch) * global_batch
    # ... in the order a fixed world reads them: one rank's order is the epoch's.
    alone = rank_epoch_indices(order, epoch=1, rank=0, world_size=1)
    assert taken == alone[: len(taken)].tolist()


def test_with_per_rank_batches_every_sample_of_an_epoch_is_trained_once_across_resizes():
    n, block = 1000, 25  # 40 blocks: 2 ranks take 2 a step, 4 take 4, 3 take 3
    samples = SampleOrder(n, seed=7, chunk_size=64, shuffle_window=4, drop_last=True)
    taken: list[int] = []
    position, step = 0, 0
    # The world changes after steps 3 and 7 of the epoch: 2 ranks, then 4, then 3; 3 ranks
    # end it with 40 - 6 - 16 = 18 blocks, 6 steps.
    while position < epoch_blocks(n, block=block, drop_last=True):
        world = 2 if step < 3 else 4 if step < 7 else 3
        for rank in range(world):
            mine = rank_block_indices(
                samples, epoch=1, rank=rank, replicas=world, start_block=position, block=block
            )
            taken += mine[:block].tolist()  # this step's block: the rest follow at this world
        position, step = position + world, step + 1
    assert step == 3 + 4 + 6 and position == 40
    order = epoch_order(n, epoch=1, seed=7, chunk_size=64, shuffle_window=4)
    assert taken == order.tolist()  # every sample once, in the epoch's order


@pytest.mark.parametrize(
    ("training", "message"),
    [
        ({"strategy": "fsdp"}, "an elastic fsdp run hands its shards from one world"),
        ({"strategy": "pipeline"}, "training.strategy 'pipeline' lays its model out once"),
        ({"batch_size": 3}, "includes 4 ranks, and training.batch_size: 3 is smaller than"),
    ],
)
def test_a_trainer_range_that_cannot_hold_is_refused_before_anything_runs(training, message):
    with pytest.raises(ConfigError, match=rf"^launch\.world_size: 2:4 .*{re.escape(message)}"):
        load_config({"launch": {"world_size": "2:4"}, "training": {"batch_size": 48} | training})
    assert load_config({"launch": {"world_size": [2, 4]}, "training": {"batch_size": 48}})


@pytest.mark.equivalence
@pytest.mark.timeout(240)
def test_fsdp_resized_hands_its_shards_on_through_a_checkpoint_redoing_nothing(
    make_config, tmp_path
):
    checkpoint = {"directory": str(tmp_path / "checkpoints")}
    config = elastic_run(make_config, tmp_path, "2:3", "fsdp", checkpoint=checkpoint)
    with start_cluster(n_workers=2, dashboard_port=0) as training_cluster:
        job = trainer_job(training_cluster, config, tmp_path)
        with job as watch:
            watch.until("training", lambda rs: any(r["kind"] == "step" for r in rs))
            training_cluster.cluster.scale(3)
            watch.until("grown to 3", watch.resized_to(3))
            training_cluster.cluster.scale(2)  # the newest worker retires
            watch.until("2 after scale(2)", watch.resized_to(2))
    result = job.result
    assert [(r["from"], r["to"], r["cause"]) for r in result.resizes] == [
        (2, 3, "joined"),
        (3, 2, "retired"),
    ]
    # The shards went to the next world through a checkpoint of the very step they stopped at.
    assert [r["redone_steps"] for r in result.resizes] == [0, 0]
    assert_one_process_on_the_same_batches(result, config)


def _one_process_on_blocks(config, worlds: list[int], dtype: torch.dtype) -> dict:
    """The reference of a run that keeps each rank's batch: step ``s`` on ``worlds[s]`` blocks
    of the epoch's order, from where the last step left it, each block's mean loss weighing 1 /
    the blocks (DDP's average of the replicas); an epoch ends where a step's blocks run out."""
    t, d = config.training, config.data.resolved()
    store = open_store(d.store_url)
    images = torch.from_numpy(as_features(store.train.images[:], tokens=False)).to(dtype)
    labels = torch.from_numpy(store.train.labels)
    model = build_model(
        config.model,
        num_classes=store.num_classes,
        seed=t.seed,
        input_shape=tuple(images.shape[1:]),
        factory=paced_model,
    ).to(dtype)
    optimizer = torch.optim.SGD(model.parameters(), lr=t.lr, momentum=t.momentum)
    block = t.batch_size // config.launch.world_size[0]
    blocks = epoch_blocks(len(labels), block=block, drop_last=True)
    epoch, position = 0, 0
    for world in worlds:
        if position + world > blocks:
            epoch, position = epoch + 1, 0
        order = epoch_order(
            len(labels),
            epoch=epoch,
            seed=t.seed,
            chunk_size=store.train.chunk_size,
            shuffle_window=d.shuffle_window,
        )
        optimizer.zero_grad()
        for b in range(position, position + world):
            rows = torch.from_numpy(order[b * block : (b + 1) * block])
            (F.cross_entropy(model(images[rows]), labels[rows]) / world).backward()
        optimizer.step()
        position += world
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _worlds(result) -> list[int]:
    """The world of each step, from the resize records: ``step`` is where the new one begins."""
    steps, resizes = result.history[-1]["step"], result.resizes
    worlds, world = [], resizes[0]["from"]
    for step in range(steps):
        while resizes and resizes[0]["step"] <= step:
            world = resizes.pop(0)["to"]
        worlds.append(world)
    return worlds


@pytest.mark.equivalence
@pytest.mark.timeout(240)
def test_the_trainer_keeping_each_ranks_batch_resized_2_3_2_equals_one_process_on_its_blocks(
    make_config, tmp_path
):
    config = elastic_run(make_config, tmp_path, "2:3", "ddp", elastic_batch="per_rank")
    with start_cluster(n_workers=2, dashboard_port=0) as training_cluster:
        job = trainer_job(training_cluster, config, tmp_path)
        with job as watch:
            watch.until("training", lambda rs: any(r["kind"] == "step" for r in rs))
            training_cluster.cluster.scale(3)
            watch.until("grown to 3", watch.resized_to(3))
            training_cluster.cluster.scale(2)
            watch.until("2 after scale(2)", watch.resized_to(2))
    result = job.result
    causes = [(r["from"], r["to"], r["cause"]) for r in result.resizes]
    assert causes == [(2, 3, "joined"), (3, 2, "retired")], causes
    worlds = _worlds(result)
    # Every step once in what on_event saw (metrics.jsonl), the steps the ranks stopped at too.
    logged = [r["step"] for r in watch.records if r["kind"] == "step"]
    assert logged == list(range(1, len(worlds) + 1))
    assert worlds.count(3) > 0 and worlds[0] == worlds[-1] == 2, worlds
    # Each rank kept its 25 rows: the epochs took fewer steps while 3 ranks trained.
    blocks = epoch_blocks(len(_digits_train(config)), block=25, drop_last=True)
    assert len(worlds) < 2 * (blocks // 2)

    def one_process(dtype: torch.dtype) -> dict:
        return _one_process_on_blocks(config, worlds, dtype)

    assert_equivalent(
        result.state_dict,
        Reference.of(one_process, steps=len(worlds)),
        # Had the ranks kept the global batch instead, each step would take 2 blocks.
        planted={
            "the global batch kept": _one_process_on_blocks(
                config, [2] * len(worlds), torch.float64
            )
        },
    )


def test_the_elastic_guides_program_trains_on_any_world_of_its_range(cluster):
    # The guide's loop read build_model, GLOBAL_BATCH and global_batch that no block defined.
    # Its program, as the page shows it, run on the suite's workers (its own cluster would
    # cost seconds more): a fixed world of 1 and the range, each to the asked step.
    from tests.test_docs import GUIDE_BLOCKS

    (block,) = [b for b in GUIDE_BLOCKS if b.page.name == "elastic.md" and "def loop(" in b.text]
    program: dict = {"__name__": "elastic_guide"}  # not __main__: its guard stays shut
    exec(compile(block.text, str(block), "exec"), program)
    alone = launch(program["loop"], 4, cluster=cluster, world_size=1)
    ranged = launch(program["loop"], 4, cluster=cluster, world_size=(1, 2))
    assert alone.results == [4] and ranged.results == [4] * ranged.world_size
    assert [r["step"] for r in ranged.metrics[0]] == [1, 2, 3, 4]
