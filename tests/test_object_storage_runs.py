"""A whole run kept in object storage: ``dask-train run --output s3://...`` on a real S3 server
(moto's, a process on loopback: workflows/benchmarks/local_s3.py), the CLI and its workers
reaching it over HTTP with credentials from the environment, as on a cloud cluster with no
shared folder."""

import json
import os
import signal
import subprocess
import time

import pandas as pd
import pytest
import torch

from tests.commands import dask_train, digits_run, run_dask_train
from tests.extras import needs_extra
from workers.models import build_model
from workflows import predict
from workflows.benchmarks.local_s3 import SECRET
from workflows.runs.config import ConfigError, load_config
from workflows.runs.run_directory import RunDirectory
from workflows.runs.run_storage import mirror_folder


def _credentials(dask_worker, variables: dict[str, str | None]) -> None:
    """Set (None: unset) variables in a worker's environment, where s3fs looks for them."""
    for key, value in variables.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def test_a_run_kept_in_a_bucket_holds_its_whole_directory_and_refuses_to_overwrite_it(
    s3, store_dir, tmp_path, monkeypatch, cluster
):
    url = f"{s3.bucket('runs-cli')}/team/digits"
    env = os.environ | s3.environment  # the CLI's and, through it, every worker's
    arguments = digits_run(store_dir, url, epochs=1, max_steps=6)
    done = run_dask_train(*arguments, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert f"run directory: {url}" in done.stdout and done.stdout.rstrip().endswith(url)
    fs = s3.filesystem()
    fs.invalidate_cache()
    root = url.removeprefix("s3://")
    names = {path.removeprefix(root + "/") for path in fs.find(root)}
    expected = {"config.json", "metrics.jsonl", "attempts.jsonl", "summary.json", "model.pt"}
    assert expected <= names and "run.log" in names, names
    assert any(n.startswith("tensorboard/events.out.tfevents.") for n in names), names
    # The checkpoints were written by the ranks straight into the bucket, each with its
    # manifest: the final one is the run's last step.
    assert f"checkpoints/step-{6:09d}/manifest.json" in names, names
    summary = json.loads(fs.cat_file(f"{root}/summary.json"))
    assert summary["steps"] == 6 and summary["world_size"] == 2
    config_text = fs.cat_file(f"{root}/config.json").decode()
    assert json.loads(config_text)["checkpoint"]["directory"] == f"{url}/checkpoints"
    assert SECRET not in config_text
    with fs.open(f"{root}/model.pt", "rb") as file:
        state = torch.load(file, weights_only=True)
    build_model("cifar_cnn", num_classes=10, seed=0).load_state_dict(state)
    # Nothing stays behind on this machine, nor in the folder it ran from.
    assert not mirror_folder(url).exists() and not list(tmp_path.iterdir())

    # The bucket's copy is the run: a new one there is refused, and resumed, a finished run
    # has nothing to train.
    for key, value in s3.environment.items():
        monkeypatch.setenv(key, value)
    config = load_config(json.loads(config_text))
    with pytest.raises(ConfigError, match=f"--output: {url} already holds a run"):
        RunDirectory.create(config, url)
    resumed = RunDirectory.create(config, url, resume=True)
    assert resumed.finished is not None and resumed.finished["steps"] == 6
    fs.invalidate_cache()
    assert {path.removeprefix(root + "/") for path in fs.find(root)} == names

    # Batch inference from the bucket's run to Parquet in the bucket, by workers that find
    # their credentials where a cloud worker does: in their environment.
    variables = s3.environment
    cluster.client.run(_credentials, variables=variables)
    scored = f"{url}-scored"
    try:
        result = predict(model=url, input=store_dir / "digits", output=scored, cluster=cluster)
    finally:  # the session's workers go on as they were
        cluster.client.run(_credentials, variables=dict.fromkeys(variables))
    assert result.count == 359 and result.output == scored
    frame = pd.read_parquet(f"{scored}/predictions.parquet", storage_options=s3.storage_options)
    assert sorted(frame["index"]) == list(range(359))
    fs.invalidate_cache()
    assert json.loads(fs.cat_file(f"{scored.removeprefix('s3://')}/metrics.json"))["accuracy"]
    assert not list(tmp_path.iterdir())


@pytest.mark.slow
def test_a_ctrl_c_of_a_run_kept_in_a_bucket_says_to_resume_it_there(s3, store_dir, tmp_path):
    # Told "interrupted before the run started; nothing was written" while the bucket held
    # its checkpoints, config and metrics: the local mirror, gone by then, was asked.
    url = f"{s3.bucket('runs-interrupted')}/team/digits"
    env = os.environ | s3.environment
    arguments = digits_run(store_dir, url, epochs=40)
    process = subprocess.Popen(
        dask_train(*arguments),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=tmp_path,
        start_new_session=True,  # a group of its own, its workers in it, as a terminal's job
    )
    fs, root = s3.filesystem(), url.removeprefix("s3://")

    def saved() -> list[str]:  # the checkpoints committed in the bucket, oldest first
        fs.invalidate_cache()
        return sorted(fs.glob(f"{root}/checkpoints/step-*/manifest.json"))

    try:
        deadline = time.monotonic() + 300  # a bound on the first epoch, not a measurement
        while not saved():
            assert process.poll() is None, process.stderr.read()
            assert time.monotonic() < deadline, "no checkpoint in 300 s"
            time.sleep(0.2)
        os.killpg(process.pid, signal.SIGINT)  # a terminal's Ctrl-C: the whole group
        stderr = process.communicate(timeout=120)[1]
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)
    assert process.returncode == 130, stderr
    assert stderr.splitlines() == [
        f"dask-train: interrupted; partial results in {url}; continue with --output {url} --resume"
    ], stderr
    newest = saved()[-1].removesuffix("/manifest.json")
    step = int(newest.rsplit("step-", 1)[1])
    resumed = run_dask_train(
        *arguments, "--resume", "--set", f"training.max_steps={step + 1}", env=env, cwd=tmp_path
    )
    assert resumed.returncode == 0, resumed.stderr
    assert f"resuming from step {step} at s3://{newest}\n" in resumed.stdout
    assert json.loads(fs.cat_file(f"{root}/summary.json"))["steps"] == step + 1


@needs_extra("optuna")
def test_a_sweeps_journal_in_a_bucket_continues_its_study_and_refuses_a_second_writer(
    s3, monkeypatch
):
    import optuna

    from workflows.runs.object_journal import ObjectJournalBackend
    from workflows.sweeps.sweep import _storage

    for key, value in s3.environment.items():
        monkeypatch.setenv(key, value)
    url = f"{s3.bucket('sweeps')}/team/study.log"
    optuna.logging.set_verbosity(optuna.logging.WARNING)

    def objective(trial: optuna.Trial) -> float:
        return trial.suggest_float("x", -1, 1) ** 2

    study = optuna.create_study(storage=_storage(optuna, url), study_name="s")
    study.optimize(objective, n_trials=3)
    # Another process's view: the same trials, and the study goes on from them.
    again = optuna.load_study(storage=_storage(optuna, url), study_name="s")
    assert [t.params for t in again.trials] == [t.params for t in study.trials]

    class Late(ObjectJournalBackend):
        """A second writer whose look at the journal came just before the other's append."""

        def _catch_up(self) -> None:
            if not self._logs:
                super()._catch_up()

    late = Late(url)
    late.read_logs(0)
    again.optimize(objective, n_trials=1)
    assert len(optuna.load_study(storage=_storage(optuna, url), study_name="s").trials) == 4
    # It names its object as the other did, and is refused rather than overwriting it.
    with pytest.raises(ValueError, match="another sweep appended to this study"):
        late.append_logs([{"op_code": 0, "worker_id": "x", "study_name": "t"}])
    assert len(optuna.load_study(storage=_storage(optuna, url), study_name="s").trials) == 4
