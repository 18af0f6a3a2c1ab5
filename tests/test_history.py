"""Every step a job finished appears exactly once in the built-in trainer's step records and in
the run directory's ``metrics.jsonl``, whatever worker was lost (issue 58): the worker holding
rank 0, the reporting rank, is SIGKILLed after its step's all-reduce and before its report,
and the job recovers from the surviving replica or from an older checkpoint; a run resumed
from a checkpoint older than the step it reached trains the steps after it again. The same for
``dask-train launch --output``'s ``metrics.jsonl`` of a function's ``ctx.report``s. (``launch``
loops' ``LaunchResult.metrics``: tests/test_elastic.py,
``test_rank_0s_history_holds_every_step_once_...``.)"""

import functools
import json
import os
import shutil
import signal
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from distributed import get_worker

from workers.checkpoint import list_checkpoints
from workers.records import RecoveryRecord, ReportRecord, ResizedRecord, StepRecord
from workflows import start_cluster
from workflows.cluster.training_cluster import ClusterConfig
from workflows.jobs.launcher import LaunchConfig
from workflows.jobs.script_launch import LaunchTarget, _RunOutput, launch_script
from workflows.observe.events import EventRelay
from workflows.runs.driver import train
from workflows.runs.run_directory import RunDirectory

DIES_AT, LAST_STEP, EVERY = 7, 10, 5
BASE = {"lr": 0.1, "momentum": 0.9, "batch_size": 64, "seed": 5, "log_every_steps": 1}


@pytest.fixture(scope="module")
def killable():
    """A 2-worker cluster of this module's own: its workers are SIGKILLed (their nannies start
    them again)."""
    with start_cluster(n_workers=2, dashboard_port=0) as training_cluster:
        yield training_cluster


def _sgd_killing_rank_0(parameters, *, marker: str) -> torch.optim.Optimizer:
    """The run's SGD; on rank 0, the first time, its worker process is SIGKILLed as its
    optimizer finishes step ``DIES_AT``: the step's all-reduce is done (its peer finishes the
    step), its record never sent. ``marker`` gets the address of the worker killed."""
    optimizer = torch.optim.SGD(parameters, lr=BASE["lr"], momentum=BASE["momentum"])
    steps = [0]

    def after_step(*_) -> None:
        steps[0] += 1
        if dist.get_rank() == 0 and steps[0] == DIES_AT and not os.path.exists(marker):
            Path(marker).write_text(get_worker().address)
            os.kill(os.getpid(), signal.SIGKILL)

    optimizer.register_step_post_hook(after_step)
    return optimizer


def counting_loop(ctx, steps: str, launch: str) -> None:
    """A launched loop (docs/guides/own-loop.md) without ``step_done``: a lost worker's job
    continues from the newest checkpoint, step ``EVERY``'s. Each step all-reduces (the ranks
    go in step) and reports; in the launch named ``first``, rank 0's worker process is
    SIGKILLed the first time it has reported step ``DIES_AT``."""
    state = {"total": 0.0}
    start = ctx.restore(state) or 0
    for step in range(start, int(steps)):
        one = torch.ones(1)
        dist.all_reduce(one)
        state["total"] += one.item()
        ctx.report(step=step + 1, total=state["total"], launch=launch)
        if step + 1 == EVERY:
            ctx.save(state, step=step + 1)
        if launch == "first" and ctx.rank == 0 and ctx.attempt == 0 and step + 1 == DIES_AT:
            os.kill(os.getpid(), signal.SIGKILL)


def _written(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("recovery", ["replica", "checkpoint"])
def test_every_step_is_recorded_once_after_rank_0s_worker_is_sigkilled(
    killable, make_config, tmp_path, recovery
):
    marker = tmp_path / "killed"
    config = make_config(
        {
            "name": f"history-{recovery}",
            # Saved as they are taken: the newest checkpoint is step 5 when rank 0 is lost.
            "checkpoint": {
                "directory": str(tmp_path / "ck"),
                "every_steps": EVERY,
                "async_save": False,
            },
            "launch": {"recovery": recovery},
        },
        **(BASE | {"max_steps": LAST_STEP}),
    )
    events: list[dict] = []
    run = RunDirectory.create(config, tmp_path / "run")
    with run:

        def on_event(record: dict) -> None:
            events.append(record)
            run.record(record)

        result = train(
            config,
            cluster=killable,
            on_event=on_event,
            optimizer=functools.partial(_sgd_killing_rank_0, marker=str(marker)),
        )
    killed = marker.read_text()
    (recovered,) = result.recoveries
    assert recovered["recovered_from"] == recovery
    written = [r for r in _written(run.path) if r["kind"] == "step"]
    assert [r["step"] for r in written] == list(range(1, LAST_STEP + 1))
    if recovery == "replica":
        # Nothing redone: the steps rank 0 never got out (the one it died in, and any its
        # worker had not sent yet) are its peer's records of them, saying so (rank 1's loss, of
        # its share of the batch), in on_event's records too.
        assert recovered["resumed_from_step"] == DIES_AT
        assert [r["step"] for r in events if r["kind"] == "step"] == [r["step"] for r in written]
        stood_in = [(r["step"], r["reported_by_rank"]) for r in written if "reported_by_rank" in r]
        assert stood_in, "no stand-in: the step rank 0 died in is missing"
        assert stood_in == [(step, 1) for step in range(stood_in[0][0], DIES_AT + 1)], stood_in
    else:
        # From step 5: the records of steps 6 and 7 are those of the parameters that survive,
        # trained again by the next attempt, not the lost attempt's (of its worker, killed).
        assert recovered["resumed_from_step"] == EVERY
        senders = [(r["step"], r["worker"] == killed) for r in written]
        assert senders == [(step, step <= EVERY) for step in range(1, LAST_STEP + 1)]


def test_a_run_resumed_from_an_older_checkpoint_keeps_each_steps_record_once(
    cluster, make_config, tmp_path
):
    directory = tmp_path / "ck"
    config = make_config(
        {
            "name": "history-resumed",
            "checkpoint": {"directory": str(directory), "every_steps": 3, "async_save": False},
        },
        **(BASE | {"max_steps": 8}),
    )
    with RunDirectory.create(config, tmp_path / "run") as run:
        train(config, cluster=cluster, on_event=run.record)
    # The run was stopped after step 8 before its last checkpoint was written: --resume
    # continues from step 6 and trains steps 7 and 8 again.
    newest = list_checkpoints(directory)[0]
    assert newest.name.startswith("step-000000008")
    shutil.rmtree(newest)
    with RunDirectory.create(config, tmp_path / "run", resume=True) as run:
        assert run.resumes_from == 6
        train(config, cluster=cluster, on_event=run.record)
    written = _written(run.path)
    steps = [r["step"] for r in written if r["kind"] == "step"]
    assert steps == list(range(1, 9))
    # The records of steps 7 and 8 are the resumed run's: after the record that says so.
    kinds = [(r["kind"], r.get("step")) for r in written]
    assert kinds.index(("resumed", 6)) < kinds.index(("step", 7))
    assert [r["step"] for r in written if r["kind"] == "epoch"] == [8]


@pytest.mark.timeout(120)
def test_a_launch_outputs_metrics_hold_each_step_once_after_a_recovery_and_a_resume(
    killable, tmp_path
):
    # `dask-train launch --output DIR`'s metrics.jsonl: rank 0's worker is SIGKILLed after
    # step 7, the job continues from step 5's checkpoint; a --resume (more steps) continues
    # from that checkpoint again. Before: steps 6 and 7 were written two and three times.
    output = tmp_path / "run"

    def launch(steps: int, name: str):
        return launch_script(
            LaunchTarget(f"{__name__}:counting_loop", (str(steps), name)),
            cluster=ClusterConfig(scheduler=killable.cluster.scheduler_address),
            launch_config=LaunchConfig(world_size=2),
            output=output,
            echo=lambda line: None,
        )

    def written() -> list[tuple[int, int, int, str, float]]:
        return sorted(
            (r["rank"], r["step"], r["attempt"], r["launch"], r["total"]) for r in _written(output)
        )

    recovered = launch(8, "first").recoveries
    assert [(r["recovered_from"], r["resumed_from_step"]) for r in recovered] == [
        ("checkpoint", EVERY)
    ]
    # Each rank's steps once, those after the checkpoint the next attempt's (the parameters
    # that survive); the total, world size x step, as one process counts it.
    assert written() == [
        (rank, step, 0 if step <= EVERY else 1, "first", 2.0 * step)
        for rank in (0, 1)
        for step in range(1, 9)
    ]
    launch(10, "resumed")
    assert written() == [
        (rank, step, 0, "first" if step <= EVERY else "resumed", 2.0 * step)
        for rank in (0, 1)
        for step in range(1, 11)
    ]


def test_a_resize_that_trains_steps_again_keeps_the_redone_records_in_metrics_jsonl(
    make_config, tmp_path
):
    # A resize's record comes once the new world's first step is done (its pause): here the
    # old world reached step 4 and the new one continued from step 2 (a sharded job whose
    # last checkpoint was older), its step 3 before the record, step 4 after.
    def step(n: int, world: int) -> dict:
        return StepRecord(epoch=1, step=n, loss=world + 0.5 / n).to_event()

    resized = ResizedRecord.model_validate(
        {"from": 2, "to": 3, "step": 2, "cause": "joined", "pause_s": 0.1}
        | {"redone_steps": 2, "at": 0.0}
    ).to_event()
    old = [step(n, world=2) for n in (1, 2, 3, 4)]
    config = make_config({"name": "history-resized"}, **BASE)
    with RunDirectory.create(config, tmp_path / "run") as run:
        for record in [*old, step(3, world=3), resized, step(4, world=3), step(5, world=3)]:
            run.record(record)
    written = [(r["kind"], r.get("step"), r.get("loss", 0) // 1) for r in _written(run.path)]
    # Steps 3 and 4 once each, the new world's records, wherever they came.
    kept = [("step", 1, 2), ("step", 2, 2), ("step", 3, 3), ("resized", 2, 0)]
    assert written == [*kept, ("step", 4, 3), ("step", 5, 3)]


def test_a_launchs_metrics_keep_each_ranks_step_once_whatever_order_the_reports_come_in(tmp_path):
    # An elastic launch resized from an older checkpoint (the old world, attempt 0, reached
    # step 4; attempt 1 continued from step 2), then lost a worker at step 6 and recovered
    # from step 5 (attempt 2), which was stopped after rank 0's step 6. Reports of an attempt
    # come late, after the next attempt's: each rank's step keeps the newest attempt's reports
    # (both of rank 0's step 2), and none of a step the job went back from.
    seq = iter(range(1000))

    def report(rank: int, attempt: int, step: int | None, **metrics: float) -> dict:
        steps = {} if step is None else {"step": step}
        record = {"rank": rank, "attempt": attempt, "seq": next(seq), "time": 0.0}
        return ReportRecord(**record, **steps, **metrics).to_event()

    resized = ResizedRecord.model_validate(
        {"from": 2, "to": 2, "step": 2, "cause": "joined", "pause_s": 0.1}
        | {"redone_steps": 2, "at": 0.0}
    ).to_event()
    lost = {"failure": "lost", "detected_at": "", "detected_at_s": 0.0, "recovered_from": "replica"}
    recovery = RecoveryRecord(
        recoveries=1, **lost, resumed_from_step=5, redo_s=0.0, restart_s=None, seconds_lost=0.0
    ).to_event()
    arriving = [
        *(report(rank, 0, step) for step in (1, 2, 3) for rank in (0, 1)),
        report(0, 0, 2, accuracy=0.5),
        report(0, 0, 4),
        report(0, 1, 3),
        report(1, 1, 3),
        resized,
        report(0, 1, 4),
        report(1, 1, 4),
        report(1, 0, 4),  # late: attempt 1's is here already
        *(report(rank, 1, 5) for rank in (0, 1)),
        report(0, 1, 6),
        recovery,
        report(0, 2, 6),
        report(1, 1, 6),  # late: attempt 2 continued from step 5
        report(0, 2, None, final=1.0),  # and stopped before rank 1 reported step 6 again
    ]
    with _RunOutput(tmp_path, echo=lambda line: None) as output:
        for record in arriving:
            output.on_event(record)
    written = [(r["rank"], r.get("step"), r["attempt"]) for r in _written(tmp_path)]
    kept = [(0, 1, 0), (0, 2, 0), (0, 2, 0), (0, 3, 1), (0, 4, 1), (0, 5, 1), (0, 6, 2)]
    kept += [(1, 1, 0), (1, 2, 0), (1, 3, 1), (1, 4, 1), (1, 5, 1), (0, None, 2)]
    assert sorted(written, key=str) == sorted(kept, key=str)


def test_a_stand_in_step_record_is_passed_on_only_where_rank_0_was_lost(cluster):
    # A next world's reporting rank sends its replica's latest step records again; those its
    # source made in rank 0's place count only where rank 0 was lost with them: after a resize
    # (rank 0 alive) its own record is here or on its way, and it is the one kept.
    # (emit also sends each record to the topic, whose copy comes back later: dropped as
    # seen, or, the stand-in of step 8, as one where rank 0 lived.)
    delivered: list[dict] = []
    with EventRelay(cluster.client, "history-stand-ins", delivered.append) as relay:
        relay.continued_from(0, 4, rank_0_lost=True)
        relay.emit(StepRecord(epoch=1, step=4, loss=0.5, reported_by_rank=1))
        relay.continued_from(1, 8, rank_0_lost=False)
        relay.emit(StepRecord(epoch=1, step=8, loss=0.25, reported_by_rank=1))
    assert [(r["step"], r["reported_by_rank"]) for r in delivered] == [(4, 1)]
