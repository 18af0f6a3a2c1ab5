"""Checkpoints and recovery with real failures: SIGKILL and SIGSTOP of worker processes,
interrupted and damaged checkpoint writes, a planted pickle payload."""

import json
import logging
import math
import os
import pickle
import signal
import time

import psutil
import pytest
import torch

from tests.commands import dask_train, digits_run
from tests.extras import needs_extra
from tests.reference import assert_same_parameters
from workers.checkpoint import (
    MANIFEST,
    CheckpointDamaged,
    CheckpointDestination,
    CheckpointState,
    Progress,
    _sha256,
    latest_good_checkpoint,
    list_checkpoints,
    save_checkpoint,
    verify_checkpoint,
)
from workers.models import build_model
from workflows.jobs.launcher import ProcessGroup
from workflows.runs.driver import train

BASE = {"lr": 0.1, "momentum": 0.9, "batch_size": 64, "seed": 5, "log_every_steps": 1}


@pytest.fixture
def checkpointed(make_config, tmp_path):
    def checkpointed(name="ft", checkpoints=None, launch=None, checkpoint=None, **training):
        raw = {
            "name": name,
            "checkpoint": {"directory": str(checkpoints or tmp_path / name), **(checkpoint or {})},
            "launch": launch or {},
        }
        return make_config(raw, **(BASE | training))

    return checkpointed


def _interrupt_after_first_mid_epoch_checkpoint(saved: list) -> None:
    """Leave the checkpoints as a run interrupted after its first mid-epoch one would."""
    middle = [p for p in saved if json.loads((p / MANIFEST).read_text())["batch"]][-1]
    for newer in saved[: saved.index(middle)]:
        for file in newer.iterdir():
            file.unlink()
        newer.rmdir()


def _worker_pids(cluster) -> dict[str, int]:
    return cluster.client.run(os.getpid)


def _assert_same_parameters(got: dict, expected: dict) -> None:
    # Both sides are this code on the same ranks and kernels (a recovered or resumed run
    # against an uninterrupted one), so the same order of every sum: equal to the last bit on
    # any CPU, however many steps.
    assert_same_parameters(got, expected)


def _signal_at_step(cluster, pid: int, signum: int, step: int, sent: list):
    """An on_event handler that sends ``signum`` to ``pid`` once step ``step`` is reported."""

    def on_event(record):
        if not sent and record["kind"] == "step" and record["step"] >= step:
            os.kill(pid, signum)
            sent.append(time.time())

    return on_event


@pytest.mark.slow
def test_sigkill_of_a_worker_mid_epoch_is_survived_with_the_same_parameters(
    own_cluster, checkpointed
):
    config = checkpointed("killed", epochs=1, checkpoint={"every_steps": 5})
    victim = max(_worker_pids(own_cluster).values())  # one of the two rank workers
    sent: list = []
    result = train(
        config,
        cluster=own_cluster,
        on_event=_signal_at_step(own_cluster, victim, signal.SIGKILL, 12, sent),
    )
    assert sent, "the kill never happened"
    assert not psutil.pid_exists(victim) or psutil.Process(victim).status() == "zombie"
    (recovery,) = result.recoveries
    # The survivor's state in memory, not the checkpoint of step 10: nothing was redone but
    # the step in flight.
    assert recovery["recovered_from"] == "replica"
    # From the step the kill followed (12) to the epoch's last step (23), not a step less (a
    # checkpoint's) nor more. How many steps the ranks trained between reporting step 12 and
    # the kill landing is the client's lag, the machine's load: the only bound the timing sets
    # is that the kill came before the job ended (it made a recovery), so within the epoch.
    assert 12 <= recovery["resumed_from_step"] <= result.history[-1]["step"] == 23
    assert recovery["restart_s"] > 0
    assert [r["epoch"] for r in result.history] == [1]

    uninterrupted = train(checkpointed("straight", epochs=1), cluster=own_cluster, on_event=None)
    assert not uninterrupted.recoveries
    _assert_same_parameters(result.state_dict, uninterrupted.state_dict)
    assert result.history[-1]["val_loss"] == uninterrupted.history[-1]["val_loss"]
    # The replacement rank counts the epoch's train loss from the recovery on: an average
    # over fewer samples, not the same number.
    assert result.history[-1]["loss"] == pytest.approx(uninterrupted.history[-1]["loss"], rel=0.2)


@pytest.mark.slow
def test_sigstop_of_a_worker_is_detected_within_the_hang_timeout(own_cluster, checkpointed):
    config = checkpointed(
        "stopped",
        epochs=1,
        checkpoint={"every_steps": 1},  # a write in flight when the rank stops
        launch={"hang_timeout_s": 4, "first_step_timeout_s": 120},
    )
    pids = _worker_pids(own_cluster)
    victim = max(pids.values())
    sent: list = []
    stop_at_step_12 = _signal_at_step(own_cluster, victim, signal.SIGSTOP, 12, sent)
    failed_checkpoints: list[str] = []

    def on_event(record):
        stop_at_step_12(record)
        if record["kind"] == "checkpoint_failed":
            failed_checkpoints.append(record["error"])

    try:
        result = train(config, cluster=own_cluster, on_event=on_event)
    finally:
        if psutil.pid_exists(victim):
            os.kill(victim, signal.SIGCONT)
    (recovery,) = result.recoveries
    # The write in flight (one a step, written in the background) ends as its stopped peer is
    # killed; the survivor is not left waiting on it to the end of its bound (it was, when the
    # stopped rank was killed only after the others let go).
    assert not [e for e in failed_checkpoints if "still writing after" in e], failed_checkpoints
    # The stopped rank is blamed, not its peer waiting for it in a collective; the peer lets
    # go in place and hands its state over.
    stopped = next(a for a, pid in pids.items() if pid == victim)
    assert f"on worker {stopped} made no progress" in recovery["failure"]
    assert "launch.hang_timeout_s = 4" in recovery["failure"]
    assert recovery["recovered_from"] == "replica"
    assert set(_worker_pids(own_cluster).values()) & set(pids.values()) == set(pids.values()) - {
        victim
    }
    # Not before the timeout: the last heartbeat may precede the signal by up to a second
    # (one a second at most). How long after it is the machine's load, not a property.
    assert recovery["detected_at_s"] - sent[0] >= 4 - 1
    assert [r["epoch"] for r in result.history] == [1]


# A run that gave up but then waited on (for the lost worker, for a release) times out here.
@pytest.mark.timeout(150)
def test_max_failures_bounds_the_restarts_with_a_clear_message(own_cluster, checkpointed):
    from workflows.runs.driver import TrainingFailed

    config = checkpointed("fragile", epochs=3, launch={"max_failures": 0})
    victim = max(_worker_pids(own_cluster).values())
    with pytest.raises(TrainingFailed, match=r"giving up after 0 recoveries \(launch.max_fail"):
        train(
            config,
            cluster=own_cluster,
            on_event=_signal_at_step(own_cluster, victim, signal.SIGKILL, 5, []),
        )


def test_a_resumed_run_continues_exactly_where_its_checkpoint_left_off(cluster, checkpointed):
    config = checkpointed("resume", epochs=2, checkpoint={"every_steps": 7, "keep": 10})
    full = train(config, cluster=cluster, on_event=None)
    saved = list_checkpoints(config.checkpoint.directory)
    # 23 steps an epoch: every 7 steps, plus each epoch's end, newest first.
    assert [json.loads((p / MANIFEST).read_text())["step"] for p in saved] == [
        46,
        42,
        35,
        28,
        23,
        21,
        14,
        7,
    ]
    _interrupt_after_first_mid_epoch_checkpoint(saved)
    resumed = train(config, cluster=cluster, on_event=None)
    _assert_same_parameters(resumed.state_dict, full.state_dict)
    assert resumed.history == [
        {**r, "samples_per_s": resumed.history[i]["samples_per_s"]}
        for i, r in enumerate(full.history)
    ]


def test_a_run_continued_with_a_larger_max_steps_trains_the_rest_of_its_epoch(
    cluster, checkpointed
):
    # 23 steps an epoch: stopped at step 5, then continued to step 10, it is the same as 10
    # steps straight. Its final checkpoint once said the epoch had ended, and the continued
    # run began the next one, skipping 18 batches.
    straight = train(checkpointed("straight", max_steps=10), cluster=cluster, on_event=None)
    stopped = train(checkpointed("continued", max_steps=5), cluster=cluster, on_event=None)
    assert [(r["epoch"], r["step"]) for r in stopped.history] == [(1, 5)]
    continued = train(checkpointed("continued", max_steps=10), cluster=cluster, on_event=None)
    _assert_same_parameters(continued.state_dict, straight.state_dict)
    # One record for the epoch, the whole of what was trained in it: steps 1 to 10.
    assert continued.history == [
        {**r, "samples_per_s": continued.history[i]["samples_per_s"]}
        for i, r in enumerate(straight.history)
    ]


def test_a_ddp_checkpoint_loads_into_another_world_size(cluster, checkpointed, tmp_path):
    two = train(checkpointed("resize", epochs=1), cluster=cluster, on_event=None)
    # The same run on one rank finds the final checkpoint and has nothing left to train.
    one = train(
        checkpointed("resize", epochs=1, launch={"world_size": 1}), cluster=cluster, on_event=None
    )
    assert one.world_size == 1
    _assert_same_parameters(one.state_dict, two.state_dict)
    # And it trains on from there: epoch 1 is the checkpoint's, epoch 2 is new.
    more = train(
        checkpointed("resize", epochs=2, launch={"world_size": 1}), cluster=cluster, on_event=None
    )
    assert more.history[0] == two.history[0]
    assert [r["epoch"] for r in more.history] == [1, 2]


def _save_without_commit(directory: str, step: int) -> None:
    """Runs on every rank: write a checkpoint's files, then stop before the commit."""
    model = build_model("cifar_cnn", num_classes=10, seed=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    save_checkpoint(
        CheckpointDestination(directory, keep=3),
        CheckpointState([model], optimizer, scaler),
        progress=Progress(step=step),
        commit=False,
    )


def test_a_write_interrupted_before_its_commit_is_never_loaded(cluster, checkpointed, caplog):
    config = checkpointed("crashwrite", epochs=1)
    train(config, cluster=cluster, on_event=None)
    directory = config.checkpoint.directory
    (good,) = list_checkpoints(directory)
    with ProcessGroup(cluster.client, config.launch) as group:
        group.run(_save_without_commit, directory, 999, name="uncommitted", timeout_s=120)
    partial = [p.name for p in os.scandir(directory) if p.name.startswith(".")]
    assert partial == [".step-000000999.partial"]  # the files are there, uncommitted
    assert list_checkpoints(directory) == [good]
    assert latest_good_checkpoint(directory)[0] == good


@pytest.mark.parametrize("damage", ["bit flip", "truncation", "missing manifest"])
def test_a_damaged_newest_checkpoint_is_detected_and_skipped(cluster, checkpointed, caplog, damage):
    config = checkpointed(
        f"damaged-{damage.replace(' ', '-')}", epochs=1, checkpoint={"every_steps": 8}
    )
    train(config, cluster=cluster, on_event=None)
    newest, previous = list_checkpoints(config.checkpoint.directory)[:2]
    data = max((p for p in newest.iterdir() if p.suffix == ".distcp"), key=os.path.getsize)
    if damage == "bit flip":
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0x01
        data.write_bytes(bytes(raw))
    elif damage == "truncation":
        data.write_bytes(data.read_bytes()[:-100])
    else:
        (newest / MANIFEST).unlink()
    with pytest.raises(CheckpointDamaged):
        verify_checkpoint(newest)
    with caplog.at_level(logging.WARNING, logger="workers.checkpoint"):
        found, manifest = latest_good_checkpoint(config.checkpoint.directory)
    assert found == previous and manifest["step"] == 16  # newest: the epoch end, 23
    assert "skipping damaged checkpoint" in caplog.text and newest.name in caplog.text


class _Payload:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_checkpoint_carrying_a_pickle_payload_is_refused_and_never_runs(
    cluster, checkpointed, tmp_path
):
    config = checkpointed("planted", epochs=1)
    train(config, cluster=cluster, on_event=None)
    (checkpoint,) = list_checkpoints(config.checkpoint.directory)
    marker = tmp_path / "payload-ran"
    (checkpoint / ".metadata").write_bytes(pickle.dumps(_Payload(str(marker))))
    # The attacker also fixed the manifest's checksums: only the content check can catch it.
    manifest = json.loads((checkpoint / MANIFEST).read_text())
    manifest["files"][".metadata"] = _sha256(checkpoint / ".metadata")
    manifest["sizes"][".metadata"] = (checkpoint / ".metadata").stat().st_size
    (checkpoint / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointDamaged, match=r"(posix|os)\.system"):
        verify_checkpoint(checkpoint)
    assert latest_good_checkpoint(config.checkpoint.directory) is None
    # A run pointed at that folder starts afresh instead of loading it.
    result = train(config, cluster=cluster, on_event=None)
    assert result.history[-1]["epoch"] == 1
    # Afresh: the planted checkpoint is the epoch's end, so a run that loaded it would train no
    # step, and have no first step (nan); one that skipped it trains the epoch.
    assert math.isfinite(result.first_step_s) and result.samples_per_s > 0
    assert not marker.exists()


@pytest.mark.parametrize("strategy", ["pipeline", "model_parallel"])
def test_staged_strategies_resume_each_stage_from_its_checkpoint(cluster, checkpointed, strategy):
    config = checkpointed(
        f"staged-{strategy}",
        strategy=strategy,
        epochs=2,
        batch_size=64,
        checkpoint={"every_steps": 9, "keep": 10},
    )
    full = train(config, cluster=cluster, on_event=None)
    saved = list_checkpoints(config.checkpoint.directory)
    _interrupt_after_first_mid_epoch_checkpoint(saved)
    resumed = train(config, cluster=cluster, on_event=None)
    _assert_same_parameters(resumed.state_dict, full.state_dict)


@pytest.mark.slow
@needs_extra("mlflow")
def test_an_interrupted_cli_run_resumes_from_its_run_directory(tmp_path, store_dir):
    # One interrupt-and-resume of the CLI covers the run directory, the attempts' figures, and
    # tracking: the two processes log to one MLflow run and one TensorBoard folder.
    import subprocess

    from mlflow.tracking import MlflowClient

    from tests.test_tracking import _only_run, _scalars

    output, mlflow_store = tmp_path / "run", f"sqlite:///{tmp_path / 'mlflow.db'}"

    def command(*extra: str) -> list[str]:
        return dask_train(
            *digits_run(store_dir, output, epochs=40),
            *("--set", f"tracking.mlflow_uri='{mlflow_store}'"),
            *extra,  # last, so its --set wins
        )

    process = subprocess.Popen(
        command(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # a group of its own, its workers in it, as a terminal's job
    )
    try:
        deadline = time.monotonic() + 300  # the first run may build the store
        while len(list_checkpoints(output / "checkpoints")) < 2:  # two epoch ends
            assert process.poll() is None, process.stderr.read()
            assert time.monotonic() < deadline, "no checkpoint in 300 s"
            time.sleep(0.2)
        workers = psutil.Process(process.pid).children(recursive=True)
        os.killpg(process.pid, signal.SIGINT)  # a terminal's Ctrl-C: the whole group
        _, stderr = process.communicate(timeout=60)
        # The checkpoints are final once the workers are gone too.
        _, alive = psutil.wait_procs(workers, timeout=30)
        assert alive == []
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=30)
    assert process.returncode == 130, stderr
    # One line (after MLflow's as it made its database): no worker's KeyboardInterrupt
    # traceback, no Dask warning about the tasks it cancelled.
    assert "Traceback" not in stderr and "WARNING" not in stderr, stderr
    assert stderr.splitlines()[-1] == (
        f"dask-train: interrupted; partial results in {output}; continue with --output "
        f"{output} --resume"
    ), stderr
    saved = json.loads((list_checkpoints(output / "checkpoints")[0] / MANIFEST).read_text())
    # The interrupted attempt is on record: its seconds, and its samples up to the last step
    # that reached the client (the first epoch's end at least: a whole epoch came after it).
    (stopped,) = [json.loads(line) for line in (output / "attempts.jsonl").read_text().splitlines()]
    assert stopped["status"] == "interrupted" and stopped["wall_s"] > 0
    assert stopped["from_step"] == 0 and stopped["to_step"] > 0
    assert stopped["samples"] == stopped["to_step"] * 64  # steps x the global batch
    run_id = (output / "mlflow_run_id").read_text().strip()
    tracked = MlflowClient(tracking_uri=mlflow_store)
    assert tracked.get_run(run_id).info.status == "KILLED"

    refused = subprocess.run(command(), capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "add --resume to continue it" in refused.stderr

    resumed = subprocess.run(
        command("--resume", "--set", "training.epochs=" + str(saved["epoch"] + 1)),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert resumed.returncode == 0, resumed.stderr
    step = f"step-{saved['step']:09d}"
    assert f"resuming from step {saved['step']} at {output / 'checkpoints' / step}\n" in (
        resumed.stdout
    )
    summary = json.loads((output / "summary.json").read_text())
    assert summary["epochs"] == saved["epoch"] + 1  # the saved epochs plus one more
    # The figures are the run's, both attempts', not the last attempt's alone.
    first, last = summary["attempts"]
    assert first == stopped
    assert last["status"] == "finished" and last["from_step"] == saved["step"]
    assert last["to_step"] == summary["steps"] and last["wall_s"] > 0
    assert summary["wall_s"] == pytest.approx(first["wall_s"] + last["wall_s"])
    assert summary["samples"] == first["samples"] + last["samples"]
    assert summary["samples_per_s"] == pytest.approx(last["samples_per_s"])  # the one measured
    records = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    epochs = [r["epoch"] for r in records if r["kind"] == "epoch"]
    assert epochs[-1] == saved["epoch"] + 1

    # One MLflow run, continued: it holds what metrics.jsonl holds, step for step.
    run = _only_run(tracked, "digits-ddp")
    assert run.info.run_id == run_id and run.info.status == "FINISHED"
    epoch_steps = sorted(r["step"] for r in records if r["kind"] == "epoch")
    history = tracked.get_metric_history(run_id, "val_accuracy")
    assert sorted(m.step for m in history) == epoch_steps
    assert {a.path for a in tracked.list_artifacts(run_id)} == {"model.pt", "summary.json"}
    # The first value logged is kept: MLflow refuses to change a param.
    assert run.data.params["training.epochs"] == "40"
    # TensorBoard: one val/accuracy point per epoch, the redone steps purged.
    points = _scalars(output / "tensorboard")["val/accuracy"]
    assert len(points) == saved["epoch"] + 1
    assert [s for s, _ in points] == sorted({s for s, _ in points})
    assert points[-1][0] == max(epoch_steps)
