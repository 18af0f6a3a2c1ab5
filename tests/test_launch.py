"""The rank API: a user's own training function on real worker processes with gloo.

``launch(fn, ...)`` must give the same numbers as one process, survive a SIGKILL through the
user's own checkpoints, never retry the user's bugs, and leave a warm cluster as it found it.
"""

import _thread
import gc
import logging
import os
import signal
import sys
import textwrap
import time
import traceback
import types
import uuid
import weakref
from pathlib import Path

import psutil
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from distributed import get_worker
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from tests.reference import Reference, assert_equivalent
from workers.compat.distributed_private import sampling_profiler_running
from workers.malloc import release_free_memory
from workers.records import parse_record
from workflows import LaunchError, launch, start_cluster
from workflows.cluster.training_cluster import live_workers
from workflows.jobs.admission import WorkerSelection
from workflows.jobs.launch import TrainingFailed
from workflows.jobs.launcher import select_workers
from workflows.runs.config import ConfigError

GLOBAL_BATCH, FEATURES, CLASSES = 32, 12, 4


def _data(seed: int = 0, n: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, FEATURES, generator=generator)
    y = (x[:, :CLASSES].argmax(1) + (x[:, -1] > 1).long()) % CLASSES
    return x, y


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(FEATURES, 32), nn.Tanh(), nn.Linear(32, CLASSES))


def _global_batch(step: int, n: int) -> torch.Tensor:
    """The sample indices of global step ``step``: a fixed permutation per pass over the data."""
    per_pass = n // GLOBAL_BATCH
    order = torch.randperm(n, generator=torch.Generator().manual_seed(step // per_pass))
    start = (step % per_pass) * GLOBAL_BATCH
    return order[start : start + GLOBAL_BATCH]


def ddp_loop(
    ctx,
    steps: int,
    lr: float,
    save_every: int = 0,
    die_at: int = 0,
    hold_until: str = "",
    live: bool = False,
) -> dict[str, torch.Tensor]:
    """A user's own DDP loop: each rank takes its slice of every global batch. With ``die_at``,
    rank 1's worker process SIGKILLs itself at that step of the first attempt; with
    ``hold_until``, the ranks wait after step 2 until that file exists (120 s at most); with
    ``live``, it says after each step where its state stands (``ctx.step_done``)."""
    x, y = _data()
    model = DistributedDataParallel(_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    state = {"model": model, "optimizer": optimizer, "next_step": 0}
    first = ctx.restore(state) if save_every or live else None
    start = state["next_step"] if first is not None else 0
    per_rank = GLOBAL_BATCH // ctx.world_size
    for step in range(start, steps):
        index = _global_batch(step, len(y))[ctx.rank * per_rank : (ctx.rank + 1) * per_rank]
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x[index]), y[index])
        loss.backward()
        optimizer.step()
        state["next_step"] = step + 1
        if live:
            ctx.step_done(step + 1)
        ctx.report(step=step + 1, loss=loss.item())
        if hold_until and step + 1 == 2:
            _wait_for_file(hold_until, timeout_s=120)
        if die_at and ctx.attempt == 0 and ctx.rank == 1 and step + 1 == die_at:
            os.kill(os.getpid(), signal.SIGKILL)  # the worker process itself, mid-run
        if save_every and (step + 1) % save_every == 0:
            ctx.save(state, step=step + 1)
    return {k: v.detach().clone() for k, v in model.module.state_dict().items()}


def _wait_for_file(path: str, *, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.02)


def _one_process(steps: int, lr: float, dtype: torch.dtype = torch.float32) -> dict:
    """The reference for ddp_loop: each global batch in one pass, in ``dtype``."""
    x, y = _data()
    x = x.to(dtype)
    model = _model().to(dtype)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    for step in range(steps):
        index = _global_batch(step, len(y))
        optimizer.zero_grad()
        F.cross_entropy(model(x[index]), y[index]).backward()
        optimizer.step()
    return model.state_dict()


def one_process_reference(steps: int, lr: float) -> Reference:
    return Reference.of(lambda dtype: _one_process(steps, lr, dtype), steps=steps)


def _pids(cluster) -> dict[str, int]:
    return cluster.client.run(os.getpid)


@pytest.mark.equivalence
def test_a_users_ddp_loop_matches_one_process_and_every_rank_returns(cluster):
    events: list[dict] = []
    result = launch(ddp_loop, 5, 0.1, cluster=cluster, world_size=2, on_event=events.append)
    assert result.world_size == 2 and len(result.results) == 2
    reference = one_process_reference(5, 0.1)
    # Gradients summed over the ranks, not averaged, or a step skipped: the check sees either.
    planted = {
        "summed": _one_process(5, 0.2, torch.float64),
        "skipped": _one_process(4, 0.1, torch.float64),
    }
    for parameters in result.results:  # every rank's return value, in rank order
        assert_equivalent(parameters, reference, planted=planted)
    # Every rank's reports come back, in order, and reached on_event once each.
    assert [[r["step"] for r in rank] for rank in result.metrics] == [list(range(1, 6))] * 2
    reports = [(e["rank"], e["step"]) for e in events if e.get("kind") == "report"]
    assert sorted(reports) == sorted((rank, s) for rank in (0, 1) for s in range(1, 6))
    assert 0 < result.first_step_s < result.wall_s
    assert result.recoveries == [] and result.attempts == 1


def test_a_launch_into_an_earlier_runs_checkpoints_says_so_and_one_that_finished_warns(
    cluster, tmp_path, caplog
):
    checkpoints = tmp_path / "checkpoints"
    options = {"cluster": cluster, "world_size": 2, "checkpoint_dir": checkpoints}
    launch(ddp_loop, 4, 0.1, save_every=2, **options)
    seen: list[dict] = []
    with caplog.at_level(logging.WARNING, logger="workflows.jobs.launch"):
        longer = launch(ddp_loop, 6, 0.1, save_every=2, on_event=seen.append, **options)
        assert "trained no step" not in caplog.text
        assert [r["step"] for r in longer.metrics[0]] == [5, 6]
        (resumed,) = [r for r in seen if r["kind"] == "resumed"]
        assert parse_record(resumed).line() == (
            f"resuming from step 4 at {checkpoints.absolute() / 'step-000000004'}"
        )
        # Its checkpoint is at the end of the asked steps: nothing to train, and said so.
        again = launch(ddp_loop, 6, 0.1, save_every=2, **options)
    assert again.metrics == [[], []]
    assert (
        f"trained no step: it resumed at step 6 from {checkpoints.absolute() / 'step-000000006'}"
        in caplog.text
    )


def profiler_state(ctx) -> bool:
    return sampling_profiler_running(get_worker())


def test_a_worker_takes_no_stack_samples_while_a_rank_runs_on_it_and_does_again_after(cluster):
    # The sampling profiler costs a training worker 6-13% of its CPU (docs/development.md).
    assert all(cluster.client.run(_profiler_running).values())
    assert launch(profiler_state, cluster=cluster, world_size=2).results == [False, False]
    assert all(cluster.client.run(_profiler_running).values())


def _profiler_running(dask_worker) -> bool:
    return sampling_profiler_running(dask_worker)


def ragged_reports(ctx) -> int:
    # Rank 0 reports 40 times, rank 1 three times: reports never wait for other ranks.
    for i in range(40 if ctx.rank == 0 else 3):
        ctx.report(i=i)
    value = torch.tensor([1.0])
    dist.all_reduce(value)  # and the group still works afterwards
    return int(value.item())


def test_ranks_that_report_unequally_do_not_hang(cluster):
    result = launch(ragged_reports, cluster=cluster, world_size=2)
    assert result.results == [2, 2]
    assert [len(reports) for reports in result.metrics] == [40, 3]
    assert [r["i"] for r in result.metrics[0]] == list(range(40))


def counted_then_raises(ctx, calls: str, error: str) -> None:
    with open(calls, "a") as file:
        file.write(f"{ctx.rank}\n")
    if ctx.rank == 1:
        # Not before rank 0 has counted its call: raised at once, rank 1 could end the job
        # before rank 0's task began (seen once in CI, under load: calls held only "1").
        deadline = time.monotonic() + 60
        while "0" not in Path(calls).read_text().split() and time.monotonic() < deadline:
            time.sleep(0.05)
        if error == "value":
            raise ValueError("the user's own bug on rank 1")
        if error == "worded":  # worded as gloo words a lost peer: told apart by evidence
            raise RuntimeError("Connection closed by peer: the user's own words, timed out")
        torch.ones(2, 3) @ torch.ones(2, 3)  # a shape error: torch raises RuntimeError
    value = torch.ones(1)
    dist.all_reduce(value)  # rank 0 waits here for a peer that never comes


# Rank 0 waits in a collective whose timeout is launch's default 600 s: it must be released
# by the launcher, or the test times out.
@pytest.mark.timeout(150)
@pytest.mark.parametrize("error", ["value", "shape", "worded"])
def test_a_user_exception_is_raised_once_and_never_retried(cluster, tmp_path, error):
    calls = tmp_path / "calls"
    pids = _pids(cluster)
    expected = ValueError if error == "value" else RuntimeError
    with pytest.raises(expected) as raised:
        launch(counted_then_raises, str(calls), error, cluster=cluster, world_size=2)
    assert sorted(calls.read_text().split()) == ["0", "1"]  # once per rank: no retry
    # The user's own file and line are in the traceback, and the rank and worker in a note.
    frames = traceback.extract_tb(raised.value.__traceback__)
    assert (__file__, "counted_then_raises") in [(f.filename, f.name) for f in frames]
    assert "raised by rank 1 on worker" in "".join(raised.value.__notes__)
    # Rank 0 was waiting in a collective: it was released, not restarted.
    assert _pids(cluster) == pids
    assert launch(ragged_reports, cluster=cluster, world_size=2).results == [2, 2]


def new_group_then_raises(ctx, entering: str) -> None:
    if ctx.rank == 0:
        Path(entering).touch()
        dist.new_group(backend="gloo")  # waits in the store for rank 1, which never comes
    _wait_for_file(entering, timeout_s=60)
    time.sleep(1.0)  # rank 0 is in the store's wait by now (if not, it is stopped before)
    raise ValueError("rank 1 fails while rank 0 makes a group")


def test_a_rank_waiting_for_a_peer_in_a_new_group_is_released_not_restarted(cluster, tmp_path):
    # As the checkpoint writers' group, made at the first save: a peer stopped before it got
    # there left this rank waiting in the rendezvous store, for the group's timeout, until
    # the launcher restarted its worker (release_timeout_s, 15 s, then the restart).
    pids = _pids(cluster)
    with pytest.raises(ValueError, match="while rank 0 makes a group"):
        launch(new_group_then_raises, str(tmp_path / "entering"), cluster=cluster, world_size=2)
    assert _pids(cluster) == pids
    assert launch(ragged_reports, cluster=cluster, world_size=2).results == [2, 2]


def fails_on_rank_0_last(ctx, looked: str) -> int:
    if ctx.rank == 0:
        # Only once the launcher has looked and found no failure (the test makes the file
        # then): a fixed sleep could end before the look on a loaded machine.
        _wait_for_file(looked, timeout_s=60)
        raise ValueError("rank 0's own error")
    return ctx.rank


def test_a_rank_failing_just_after_the_launcher_looked_is_still_a_rank_failure(
    cluster, monkeypatch, tmp_path
):
    from distributed import wait

    from workflows.jobs.launcher import ProcessGroup

    # The launcher once looked at the ranks' tasks for failures, then at which were done: a
    # rank that failed between the two looks passed as done, and its exception reached the
    # caller raw, as if no launcher had seen it (no rank, no restart; it made a
    # --max-restarts CI run fail once). It now looks at which are done first. Here every rank
    # ends right after a look for failures found nothing.
    looked = ProcessGroup._failure
    after_look = tmp_path / "looked"
    ended_after_a_look: list[list[str]] = []  # the ranks' states, when the race was set up

    def look_then_let_every_rank_end(self, futures):
        found = looked(self, futures)
        if found is None and not after_look.exists():
            after_look.touch()  # now rank 0 fails
            wait(futures, timeout=60)
            ended_after_a_look.append([future.status for future in futures])
        return found

    monkeypatch.setattr(ProcessGroup, "_failure", look_then_let_every_rank_end)
    with pytest.raises(ValueError, match="rank 0's own error") as raised:
        launch(fails_on_rank_0_last, str(after_look), cluster=cluster, world_size=2)
    # The race happened: a look found nothing, then rank 0 failed and rank 1 was done.
    assert ended_after_a_look == [["error", "finished"]]
    assert "raised by rank 0 on worker" in "".join(getattr(raised.value, "__notes__", []))


def shapes_do_not_match(ctx) -> torch.Tensor:
    weights = torch.ones(2, 3)
    # A call over several lines: its markers start under "_project(".
    return _project(
        weights,
        torch.ones(2, 3),
    )


def _project(weights: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ weights) + 1  # a shape error, its markers under the operator


def _user_frames(error: BaseException) -> list[str]:
    """The formatted frames of the user's functions, each with its source and marker lines."""
    names = (", in shapes_do_not_match\n", ", in _project\n")
    entries = traceback.format_exception(error)
    return [
        e for e in entries if e.startswith(f'  File "{__file__}"') and any(n in e for n in names)
    ]


def test_a_user_exception_shows_the_markers_of_the_same_exception_in_one_process(cluster):
    # Dask rebuilds a remote traceback from stub code: the right lines, but Python 3.11 took
    # the ^^^^ markers from the stub's positions and put them under the wrong columns.
    with pytest.raises(RuntimeError) as in_one_process:
        shapes_do_not_match(None)
    with pytest.raises(RuntimeError) as on_a_rank:
        launch(shapes_do_not_match, cluster=cluster, world_size=1)
    expected = _user_frames(in_one_process.value)
    assert len(expected) == 2 and "^^^" in expected[0] and "~~^~~" in expected[1]
    assert _user_frames(on_a_rank.value) == expected
    # The positions travelled on the exception: the user gets it back without them.
    assert not [name for name in vars(on_a_rank.value) if "positions" in name]


def _readme_block(containing: str) -> str:
    """The Python example that contains ``containing``, from README.md or a page of docs/.

    The same program may be shown on several pages (the README's quick start and its guide):
    every copy must be the same, so the one that runs is the one every reader sees.
    """
    repo = Path(__file__).parents[1]
    blocks = []
    for page in [repo / "README.md", *sorted((repo / "docs").rglob("*.md"))]:
        text = page.read_text()
        blocks += [b.split("\n```", 1)[0] for b in text.split("```python\n")[1:]]
    found = {b for b in blocks if containing in b}
    assert len(found) == 1, f"{len(found)} different examples contain {containing!r}"
    return found.pop()


@pytest.mark.slow
def test_the_readmes_own_loop_example_runs_twice_and_writes_nothing_beside_it(tmp_path):
    from tests.test_cluster import _run_in_own_session

    # Run as pasted. Its checkpoints once went to checkpoints/mine: the second run resumed at
    # the last step, trained none, and `return loss.item()` raised UnboundLocalError.
    script = tmp_path / "mine.py"
    script.write_text(_readme_block("def train_loop(ctx, steps, lr)"))
    for run in (1, 2):
        done = _run_in_own_session([sys.executable, str(script)], tmp_path)
        assert done.returncode == 0, f"run {run}: {done.stderr[-3000:]}"
        final_losses = done.stdout.splitlines()[0]
        assert final_losses.startswith("[") and "None" not in final_losses, done.stdout
    assert [p.name for p in tmp_path.iterdir()] == ["mine.py"]


@pytest.mark.slow
def test_a_sigkill_costs_no_redone_steps_and_the_same_parameters(own_cluster):
    pids = _pids(own_cluster)
    result = launch(
        ddp_loop,
        6,
        0.1,
        die_at=3,  # rank 1's worker is SIGKILLed after step 3; rank 0 fails in step 4
        live=True,
        cluster=own_cluster,
        world_size=2,  # no checkpoint folder: the survivor's memory is enough
    )
    (recovery,) = result.recoveries
    assert recovery["recovered_from"] == "replica" and recovery["resumed_from_step"] == 3
    assert recovery["restart_s"] is not None
    assert result.attempts == 2
    # Only the killed worker is new: the survivor let go of the group in place.
    assert len(set(_pids(own_cluster).values()) & set(pids.values())) == 1
    for parameters in result.results:
        assert_equivalent(parameters, one_process_reference(6, 0.1))
    # The resumed attempt reported from the step after the survivor's on.
    final_attempt = [r for r in result.metrics[0] if r["attempt"] == 1]
    assert [r["step"] for r in final_attempt] == [4, 5, 6]


def sleeps_in_python(ctx) -> None:
    ctx.report(started=1)
    while True:
        time.sleep(0.01)


def _ctrl_c_once_started(record: dict) -> None:
    if record.get("kind") == "report" and record["rank"] == 1:
        _thread.interrupt_main()  # Ctrl-C, once both ranks are in the user's loop


# The ranks sleep forever: a Ctrl-C that does not stop them times the test out.
@pytest.mark.timeout(150)
def test_ctrl_c_stops_the_ranks_without_restarting_workers(cluster):
    pids = _pids(cluster)
    with pytest.raises(KeyboardInterrupt):
        launch(sleeps_in_python, cluster=cluster, world_size=2, on_event=_ctrl_c_once_started)
    assert _pids(cluster) == pids  # stopped in place
    assert launch(ragged_reports, cluster=cluster, world_size=2).results == [2, 2]


def sleeps_in_c(ctx) -> None:
    ctx.report(started=1)
    time.sleep(600)  # one call into C: neither the stop nor shut-down connections end it


# As a rank in gloo's wait for a send its shut-down connection does not wake (8 Ctrl-C in 166
# held the CLI 19 s): without the restart at once, the Ctrl-C takes release_timeout_s (60 s).
@pytest.mark.timeout(150)
def test_ranks_a_ctrl_c_cannot_reach_are_restarted_at_once_not_after_the_release_timeout(
    own_cluster,
):
    pids = _pids(own_cluster)
    interrupted = []

    def ctrl_c_once_started(record: dict) -> None:
        if record.get("kind") == "report" and record["rank"] == 1:
            interrupted.append(time.monotonic())
            _thread.interrupt_main()

    with pytest.raises(KeyboardInterrupt):
        launch(
            sleeps_in_c,
            cluster=own_cluster,
            world_size=2,
            on_event=ctrl_c_once_started,
            config={"release_timeout_s": 60},
        )
    held_s = time.monotonic() - interrupted[0]
    assert held_s < 30, f"the Ctrl-C took {held_s:.1f} s: the ranks were waited out"
    own_cluster.client.wait_for_workers(2, timeout=60)
    assert not set(_pids(own_cluster).values()) & set(pids.values())  # both restarted


def test_max_failures_zero_gives_up_at_the_first_lost_worker(own_cluster):
    victim = max(_pids(own_cluster).values())

    def kill_at_first_report(record: dict) -> None:
        if record.get("kind") == "report" and record.get("step") == 2 and psutil.pid_exists(victim):
            os.kill(victim, signal.SIGKILL)

    with pytest.raises(TrainingFailed, match=r"giving up after 0 recoveries"):
        launch(
            ddp_loop,
            10_000,
            0.1,
            cluster=own_cluster,
            world_size=2,
            max_failures=0,
            on_event=kill_at_first_report,
        )


def noop(ctx) -> int:
    return ctx.rank


def _threads_and_descriptors() -> tuple[int, int]:
    process = psutil.Process()
    return process.num_threads(), process.num_fds()


def _close_idle_comms(dask_worker=None, dask_scheduler=None) -> None:
    (dask_worker or dask_scheduler).rpc.collect()


def _without_idle_comms(cluster) -> None:
    """Close the comms Dask's connection pools keep open for reuse.

    A pool grows by one comm whenever one more request than ever before is in flight at once
    (measured: a worker's pool to the scheduler grew by one between launch 4 and 23, a socket
    on each end). That is bounded and not ours to count; what a launch leaks is.
    """
    cluster.client.run(_close_idle_comms)
    cluster.client.run_on_scheduler(_close_idle_comms)
    cluster.client.loop.add_callback(cluster.client.rpc.collect)


def test_twenty_launches_leave_descriptors_and_threads_flat(cluster):
    for _ in range(3):  # warm-up: first imports, the metrics plugin, the group's threads
        launch(noop, cluster=cluster, world_size=2)
    _without_idle_comms(cluster)
    client_before = _threads_and_descriptors()
    workers_before = cluster.client.run(_threads_and_descriptors)
    for _ in range(20):
        assert launch(noop, cluster=cluster, world_size=2).results == [0, 1]
    # A launch's last threads and sockets (the group's release, a comm closing) end shortly
    # after it returned; a leak never does. So: back to the baseline or below, within a bound.
    deadline = time.monotonic() + 30
    while True:
        _without_idle_comms(cluster)
        client_after = _threads_and_descriptors()
        workers_after = cluster.client.run(_threads_and_descriptors)
        flat = all(a <= b for a, b in zip(client_after, client_before, strict=True)) and all(
            a <= b
            for address, counts in workers_after.items()
            for a, b in zip(counts, workers_before[address], strict=True)
        )
        if flat or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert flat, (
        f"(threads, descriptors) after 20 launches: client {client_before} -> {client_after}, "
        f"workers {workers_before} -> {workers_after}"
    )


# -- what a worker's jobs leave in its heap ---------------------------------------------------


def _weak_cycles() -> list:
    return sys.modules.setdefault(
        "_dask_train_test_weak_cycles", types.ModuleType("_dask_train_test_weak_cycles")
    ).__dict__.setdefault("refs", [])


def _leave_a_state_and_an_import(job_id: str, module: str) -> None:
    """On a worker (``Client.run``): a state kept for ``job_id``'s live recovery whose model
    is in a reference cycle, and a module imported since the last job, holding a list."""
    from workers import live_recovery

    model = nn.Linear(2, 2)
    model.loop = [model]  # a cycle, as hooks and wrappers make: only a collection frees it
    _weak_cycles().append(weakref.ref(model))
    live_recovery.keep(job_id, {"model": model}, step=0, replicated=True)
    sys.modules[module] = types.ModuleType(module)
    sys.modules[module].made = [object()]


def _frozen(module: str) -> bool:
    """Whether the module's list is in the collector's permanent generation: tracked, yet in
    none of the generations a collection walks."""
    made = sys.modules[module].made
    return gc.is_tracked(made) and not any(o is made for o in gc.get_objects())


def _frozen_and_freed(module: str) -> tuple[bool, bool]:
    """Whether the module's list is frozen, and whether the collector freed every model left."""
    gc.collect()
    return _frozen(module), all(ref() is None for ref in _weak_cycles())


def _frozen_and_freed_in_a_rank(ctx, module: str) -> tuple[bool, bool]:
    return _frozen_and_freed(module)


def test_a_worker_freezes_what_earlier_jobs_imported_once_no_jobs_state_is_left(cluster):
    # Each rank starts with a full collection, which walks what the worker's jobs imported:
    # frozen before the next job's group forms, that is walked once (workers/between_jobs.py).
    # Never while a job's state is kept there: its reference cycles would never be freed.
    module = f"_dask_train_test_import_{uuid.uuid4().hex}"
    cluster.client.run(_leave_a_state_and_an_import, "a job whose client died", module)
    # The next job's group forms with that state still there: nothing is frozen; its ranks
    # drop the state as they start, and the collector frees it.
    first = launch(_frozen_and_freed_in_a_rank, module, cluster=cluster, world_size=2)
    assert first.results == [(False, True), (False, True)]
    # The job after that: what the workers imported is frozen as its group forms.
    second = launch(_frozen_and_freed_in_a_rank, module, cluster=cluster, world_size=2)
    assert second.results == [(True, True), (True, True)]


def test_a_state_kept_for_a_live_recovery_is_never_frozen(cluster):
    from workers.between_jobs import freeze_what_earlier_jobs_imported

    module = f"_dask_train_test_import_{uuid.uuid4().hex}"
    cluster.client.run(_leave_a_state_and_an_import, "this job", module)
    # A restarted attempt of the job that keeps the state forms its group: the state's modules
    # and optimizers (reference cycles) stay collectable, so nothing is frozen.
    assert set(cluster.client.run(freeze_what_earlier_jobs_imported).values()) == {False}
    cluster.client.run(_forget_kept_state, "this job")
    assert set(cluster.client.run(_frozen_and_freed, module).values()) == {(False, True)}
    assert set(cluster.client.run(freeze_what_earlier_jobs_imported).values()) == {True}


def _forget_kept_state(job_id: str) -> None:
    from workers import live_recovery

    live_recovery.forget(job_id)


# -- code the workers cannot import ---------------------------------------------------------

USER_PACKAGE = """
import torch.distributed as dist
import torch

from {name}.helpers import scale


def user_loop(ctx, value):
    tensor = torch.tensor([scale(value) * (ctx.rank + 1)])
    dist.all_reduce(tensor)
    return tensor.item()
"""


def _write_package(root: Path, name: str) -> None:
    package = root / name
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(textwrap.dedent(USER_PACKAGE.format(name=name)))
    (package / "helpers.py").write_text("def scale(value):\n    return 10 * value\n")


def test_the_modules_a_pickled_job_imports_are_found_exactly():
    # A function of a script's __main__ travels by value, and the modules it uses travel as
    # cloudpickle's subimport(name). When a name string is memoized earlier in the pickle, the
    # subimport's argument is a memo lookup: a scan that only matched the next string took the
    # job's "args" field for a module and refused the launch (CodeNotShippable: 'args').
    import cloudpickle

    from workers.rank_context import RankJob
    from workflows.jobs.code_shipping import referenced_modules

    script = {"__name__": "__main__"}
    exec(
        "import time\nimport numpy\ndef loop(ctx):\n    time.sleep(0)\n    return numpy.zeros(1)\n",
        script,
    )
    job = RankJob(
        fn=script["loop"],
        args=(),
        kwargs={},
        name="time",
        generation="g",
        attempt=0,
        max_failures=3,
        event_topic="events",
        heartbeat_topic="beats",
    )
    pickled = cloudpickle.dumps(job)
    assert b"args" in pickled and b"numpy" in pickled
    assert referenced_modules(pickled) == {"cloudpickle", "numpy", "time", "workers"}


def test_a_launch_with_tracking_writes_rank_0s_reports_to_tensorboard(cluster, tmp_path):
    from tests.test_tracking import _scalars

    result = launch(
        ragged_reports, cluster=cluster, world_size=2, tracking={"tensorboard": str(tmp_path)}
    )
    assert result.results == [2, 2]
    # Rank 0's 40 reports of ``i`` (no step given: a per-rank counter), rank 1's left out.
    assert _scalars(tmp_path) == {"report/i": [(n + 1, float(n)) for n in range(40)]}


def raises_holding_the_group(ctx) -> None:
    model = DistributedDataParallel(nn.Linear(2, 2))
    if ctx.rank == 1:
        # The frame holds the model, and through it the group, as it raises.
        raise ValueError(f"rank 1's own bug, {type(model).__name__} in its frame")
    dist.all_reduce(torch.ones(1))  # rank 0 waits here for a peer that never comes


@pytest.mark.timeout(150)
def test_a_rank_in_a_collective_is_released_while_its_failed_peer_still_holds_the_group(cluster):
    # gloo closes a connection only when its group is freed; what the failed rank left behind
    # still holds it, and its peer is released all the same: not restarted.
    pids = _pids(cluster)
    with pytest.raises(ValueError, match="DistributedDataParallel in its frame"):
        launch(raises_holding_the_group, cluster=cluster, world_size=2)
    assert _pids(cluster) == pids


HELD_MIB = 256


def holds_a_cycle(ctx, fails: bool) -> None:
    """HELD_MIB of values in a reference cycle, as a model and its hooks make; rank 1 then
    raises (``fails``), and rank 0 waits for it in a collective until the launcher stops it."""
    held = {"values": torch.ones(HELD_MIB * 2**18)}  # written: resident
    held["itself"] = held
    if fails and ctx.rank == 1:
        raise ValueError("rank 1's own bug")
    dist.all_reduce(torch.ones(1))


def _resident_mib(*, collect: bool = False) -> float:
    if collect:
        gc.collect()
        release_free_memory()
    return psutil.Process().memory_info().rss / 2**20


@pytest.mark.parametrize("fails", [False, True], ids=["finished", "failed"])
def test_what_a_job_held_is_handed_back_as_its_ranks_end(cluster, fails):
    # Dask pauses a worker past distributed.worker.memory.pause and a paused worker starts no
    # task: a job whose model stayed resident after it (an idle worker collects no cycles)
    # kept the next job's rank from starting there, and its peers waited for their timeout.
    before = cluster.client.run(_resident_mib, collect=True)
    if fails:
        with pytest.raises(ValueError, match="rank 1's own bug"):
            launch(holds_a_cycle, True, cluster=cluster, world_size=2)
    else:
        launch(holds_a_cycle, False, cluster=cluster, world_size=2)
    grown = {w: mib - before[w] for w, mib in cluster.client.run(_resident_mib).items()}
    assert all(mib < HELD_MIB / 4 for mib in grown.values()), f"MiB still resident: {grown}"


def _ballast(resident: int, *, dask_worker) -> None:
    """Hold memory on the worker outside Dask's data, as a user's own objects would, until the
    worker's process is ``resident`` bytes; 0: let go of it."""
    dask_worker.ballast = None
    wanted = resident - psutil.Process().memory_info().rss
    if resident:
        dask_worker.ballast = torch.ones(wanted // 4)  # written: resident


def _until_status(cluster, address: str, status: str) -> None:
    deadline = time.monotonic() + 30
    while live_workers(cluster.client)[address]["status"] != status:
        assert time.monotonic() < deadline, f"{address} never {status}"
        time.sleep(0.1)


def grows_on_rank_0(ctx) -> None:
    """Rank 0 allocates until its nanny ends its process; rank 1 waits for it."""
    if ctx.rank == 0:
        blocks = []
        for _ in range(16):  # 4 GiB: past any limit here
            blocks.append(torch.ones(2**26))  # 256 MiB, written
            time.sleep(0.2)  # the nanny looks every 100 ms
    dist.barrier()


def test_a_worker_paused_or_killed_for_memory_is_named_as_the_jobs_cause():
    # Dask starts no task on a worker paused past distributed.worker.memory.pause (80% of its
    # limit): the rank there never started, and its peers waited for it in their first
    # collective for the whole timeout, then failed as if their own code had raised.
    limit = 1.25 * 2**30
    with start_cluster(n_workers=2, dashboard_port=0, memory_limit=int(limit)) as cluster:
        # The worker a job would take first.
        paused = select_workers(live_workers(cluster.client), WorkerSelection())[0]
        # To 88% of the limit: past the pause (80%), short of the nanny's kill (95%).
        cluster.client.run(_ballast, int(0.88 * limit), workers=[paused])
        _until_status(cluster, paused, "paused")
        # A job that fits on the running workers is given those.
        one_rank = launch(
            noop, cluster=cluster, world_size=1, config={"paused_worker_timeout_s": 1}
        )
        assert one_rank.results == [0]
        with pytest.raises(LaunchError, match=rf"worker {paused} has been paused for \d+ s"):
            launch(noop, cluster=cluster, world_size=2, config={"paused_worker_timeout_s": 1})
        # Its memory freed, the worker takes ranks again.
        cluster.client.run(_ballast, 0, workers=[paused])
        _until_status(cluster, paused, "running")
        assert launch(noop, cluster=cluster, world_size=2).results == [0, 1]
        # Past the limit, its nanny restarts it: the error says that, not only that it left.
        killed = rf"rank 0's worker {paused} left the cluster: its nanny restarted it, its "
        with pytest.raises(TrainingFailed, match=killed + r"process at [\d.]+ GiB, \d+% of its"):
            launch(grows_on_rank_0, cluster=cluster, world_size=2, max_failures=0)


def never_launched(ctx) -> None:
    raise AssertionError("launched despite a bad setting")


@pytest.mark.parametrize(
    ("arguments", "told"),
    [
        ({"config": {"hang_timout_s": 5}}, r"^hang_timout_s: unknown key \(check the spelling\)$"),
        ({"world_size": 0}, r"^launch\.world_size: 0; a job needs at least 1 rank"),
        ({"tracking": {"mlflow_ur": "x"}}, r"^mlflow_ur: unknown key"),
    ],
)
def test_a_bad_launch_setting_is_one_line_naming_it_before_a_cluster_starts(arguments, told):
    import psutil

    before = {child.pid for child in psutil.Process().children(recursive=True)}
    with pytest.raises(ConfigError, match=told) as error:
        launch(never_launched, **arguments)  # no cluster given: it would start one
    assert "\n" not in str(error.value)
    assert {child.pid for child in psutil.Process().children(recursive=True)} <= before


def test_a_state_holding_tensors_at_its_top_level_comes_back_whole():
    from workers.training_state import apply_state, capture_state

    # A zero tensor is one to keep (its truth value is False), and a tensor of several values
    # has no truth value at all: both are stored as tensors, beside a plain number.
    state = {"loss": torch.tensor(0.0), "weights": torch.arange(3.0), "seen": 4}
    tensors, values = capture_state(state)
    restored = {"loss": torch.tensor(9.0), "weights": torch.zeros(3), "seen": 0}
    apply_state(restored, tensors, values)
    assert restored["loss"].item() == 0.0
    assert restored["weights"].tolist() == [0.0, 1.0, 2.0]
    assert restored["seen"] == 4
