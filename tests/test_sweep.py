"""Hyperparameter sweeps on a real cluster: trials packed on the workers, a bad trial pruned,
a sweep whose client is SIGKILLed continued without running a finished trial again,
two-rank DDP trials, the CLI on a config, and what a sweep refuses up front.

The rank functions record each step in a JSON-lines file (one line per step, from the worker
process): what ran where and when is read from there, not from the client's clock.
"""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from tests.commands import CONFIGS, run_dask_train
from tests.extras import missing_reason
from workflows import sweep
from workflows.observe.dashboard import training_page_url
from workflows.observe.monitoring import SWEEP_PREFIX

optuna = pytest.importorskip("optuna", reason=missing_reason("optuna"))  # the sweep extra

OPTIMUM = 0.3
STEPS = 5
BAD_X = 1.0  # enqueued: far from the optimum, and runs LONG_STEPS unless it is stopped
LONG_STEPS = 60


def _append(log: str, record: dict) -> None:
    with open(log, "a") as file:
        file.write(json.dumps(record) + "\n")


def _descend(ctx, params: dict, log: str) -> None:
    """(x - 0.3)^2 plus a term that shrinks with the steps, reported at every step."""
    x = params["x"]
    for step in range(LONG_STEPS if x == BAD_X else STEPS):
        time.sleep(0.1)
        _append(
            log,
            {"trial": ctx.job_name, "x": x, "step": step, "pid": os.getpid(), "time": time.time()},
        )
        ctx.report(loss=(x - OPTIMUM) ** 2 + 1 / (step + 1), step=step)


def _records(log: Path) -> list[dict]:
    """The complete lines so far (a worker may be writing the next one)."""
    text = log.read_text() if log.exists() else ""
    return [json.loads(line) for line in text.split("\n")[:-1]]


def _runs(log: Path) -> pd.DataFrame:
    return (
        pd.DataFrame(_records(log))
        .groupby("trial")
        .agg(
            start=("time", "min"),
            end=("time", "max"),
            steps=("step", "count"),
            pid=("pid", "first"),
        )
    )


def _study(name: str, *enqueued: float) -> optuna.storages.InMemoryStorage:
    storage = optuna.storages.InMemoryStorage()
    study = optuna.create_study(storage=storage, study_name=name)
    for x in enqueued:
        study.enqueue_trial({"x": x})
    return storage


def test_trials_run_two_at_a_time_a_bad_one_is_pruned_and_the_best_is_near_the_optimum(
    cluster, tmp_path
):
    # Trial 3 starts only once two trials have finished (two run at a time): the median pruner
    # then has its two trials to compare with, and x = 1.0 is far worse at its first step.
    storage = _study("packed", 0.25, 0.35, 0.28, BAD_X)
    log = tmp_path / "steps.jsonl"
    result = sweep(
        _descend,
        {"x": (0.0, 1.0)},
        n_trials=8,
        metric="loss",
        pruner=optuna.pruners.MedianPruner(n_startup_trials=2),
        storage=storage,
        study_name="packed",
        cluster=cluster,
        log=str(log),
    )

    trials = result.trials.set_index("number")
    assert len(trials) == 8 and set(trials["state"]) <= {"COMPLETE", "PRUNED"}
    assert trials.loc[3, "state"] == "PRUNED" and trials.loc[3, "params_x"] == BAD_X
    runs = _runs(log)
    # Stopped at once: a trial that was not stopped reports all its LONG_STEPS.
    assert runs.loc["packed-trial-3", "steps"] < LONG_STEPS
    overlapping = [
        (a, b)
        for a in runs.index
        for b in runs.index
        if a < b
        and runs.loc[a, "start"] < runs.loc[b, "end"]
        and runs.loc[b, "start"] < runs.loc[a, "end"]
    ]
    assert overlapping, f"no two trials ran at the same time:\n{runs}"
    assert all(runs.loc[a, "pid"] != runs.loc[b, "pid"] for a, b in overlapping)

    assert abs(result.best_params["x"] - OPTIMUM) <= 0.05
    complete = trials[trials["state"] == "COMPLETE"]
    assert result.best_value == complete["value"].min()
    assert result.best_value == pytest.approx((result.best_params["x"] - OPTIMUM) ** 2 + 1 / STEPS)
    assert (complete["ranks"] == 1).all() and complete["job_id"].str.startswith(
        "packed-trial-"
    ).all()

    # The Training page's feed: a RUNNING event and a final one per trial.
    events = [e for _, e in cluster.client.get_events(SWEEP_PREFIX + "packed")]
    assert sorted((e["number"], e["state"]) for e in events if e["state"] != "RUNNING") == sorted(
        zip(trials.index, trials["state"], strict=True)
    )
    assert sorted(e["number"] for e in events if e["state"] == "RUNNING") == list(range(8))
    page = (
        urllib.request.urlopen(training_page_url(cluster.dashboard_link) + "?refresh=0", timeout=30)
        .read()
        .decode()
    )
    assert "Sweep packed" in page and page.count("PRUNED") == (trials["state"] == "PRUNED").sum()


def _counted(ctx, params: dict, log: str) -> None:
    """A trial that records each start of its run, then takes about a second."""
    _append(log, {"trial": ctx.job_name, "x": params["x"], "event": "start"})
    for step in range(8):
        time.sleep(0.1)
        ctx.report(loss=(params["x"] - OPTIMUM) ** 2, step=step)
    _append(log, {"trial": ctx.job_name, "x": params["x"], "event": "end"})


RESUMABLE = {"n_trials": 5, "metric": "loss", "study_name": "resumed", "max_concurrent": 1}


def _kill_mid_trial(process: subprocess.Popen, log: Path, timeout_s: float = 180) -> None:
    """SIGKILL the sweep once two trials finished and a third is running."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and process.poll() is None:
        events = [record["event"] for record in _records(log)]
        if events.count("end") >= 2 and events[-1] == "start":
            os.kill(process.pid, signal.SIGKILL)
            process.wait(timeout=60)
            return
        time.sleep(0.02)
    process.kill()
    process.wait(timeout=60)
    pytest.fail(f"the sweep never had a trial running after two finished: {_records(log)}")


def test_a_sweep_killed_mid_trial_continues_without_running_a_finished_trial_again(
    cluster, tmp_path
):
    storage, log = tmp_path / "study.jsonl", tmp_path / "runs.jsonl"
    client_code = textwrap.dedent(f"""
        from tests.test_sweep import RESUMABLE, _counted
        from workflows import start_cluster, sweep

        if __name__ == "__main__":
            with start_cluster(scheduler={cluster.client.scheduler.address!r}) as cluster:
                sweep(_counted, {{"x": (0.0, 1.0)}}, storage={str(storage)!r}, cluster=cluster,
                      log={str(log)!r}, **RESUMABLE)
    """)
    process = subprocess.Popen([sys.executable, "-c", client_code], stderr=subprocess.PIPE)
    _kill_mid_trial(process, log)
    interrupted = _records(log)[-1]

    result = sweep(
        _counted,
        {"x": (0.0, 1.0)},
        storage=str(storage),
        cluster=cluster,
        log=str(log),
        **RESUMABLE,
    )

    trials = result.trials
    assert list(trials["number"]) == list(range(5)) and (trials["state"] == "COMPLETE").all()
    starts = pd.DataFrame(_records(log))
    starts = starts[starts["event"] == "start"]
    runs = starts.groupby("trial").size()
    assert sorted(runs.index) == [f"resumed-trial-{n}" for n in range(5)]
    assert runs.drop(interrupted["trial"]).eq(1).all(), runs
    assert runs[interrupted["trial"]] == 2  # run again, once
    # Taken over with the parameters it was sampled with, not sampled again.
    again = starts[starts["trial"] == interrupted["trial"]]["x"]
    assert (again == interrupted["x"]).all()
    number = int(interrupted["trial"].rsplit("-", 1)[1])
    assert trials.set_index("number").loc[number, "params_x"] == interrupted["x"]


def _quick(ctx, params: dict, log: str) -> float:
    """A trial of a moment that records its run; its value returned, not reported."""
    _append(log, {"trial": ctx.job_name, "x": params["x"]})
    return (params["x"] - OPTIMUM) ** 2


def test_the_same_stored_sweep_twice_is_one_study_of_n_trials(cluster, tmp_path):
    # As the guide has it: a storage and no study_name. The SQLite file's folder is made.
    storage = f"sqlite:///{tmp_path / 'studies' / 'sweep.db'}"
    log = tmp_path / "runs.jsonl"
    for call in (1, 2):
        result = sweep(
            _quick,
            {"x": (0.0, 1.0)},
            n_trials=3,
            metric="loss",
            storage=storage,
            cluster=cluster,
            log=str(log),
        )
        assert list(result.trials["number"]) == [0, 1, 2], f"call {call}"
        assert (result.trials["state"] == "COMPLETE").all()
    # Named after the function, the same on every call: the second call found the study
    # finished and ran nothing.
    assert result.study_name == "tests.test_sweep._quick"
    assert optuna.get_all_study_names(storage) == ["tests.test_sweep._quick"]
    assert len(_records(log)) == 3
    # Another name is a fresh study in the same storage.
    fresh = sweep(
        _quick,
        {"x": (0.0, 1.0)},
        n_trials=1,
        metric="loss",
        storage=storage,
        study_name="again",
        cluster=cluster,
        log=str(log),
    )
    assert list(fresh.trials["number"]) == [0] and len(_records(log)) == 4


def _ddp_regression(ctx, params: dict) -> int:
    """Three DDP steps of a linear model; every rank sees the same batch."""
    model = DistributedDataParallel(_linear())
    optimizer = torch.optim.SGD(model.parameters(), lr=params["lr"])
    x, y = _batch()
    for step in range(3):
        optimizer.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        ctx.report(loss=loss.item(), step=step)
    return ctx.rank


def _linear() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(4, 1)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(32, 4, generator=generator), torch.randn(32, 1, generator=generator)


def _last_loss_in_one_process(lr: float) -> float:
    model, (x, y) = _linear(), _batch()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for _ in range(3):
        optimizer.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
    return loss.item()


def test_two_rank_ddp_trials_report_the_single_process_loss_from_both_ranks(cluster):
    result = sweep(
        _ddp_regression,
        {"lr": [0.01, 0.2]},
        n_trials=2,
        trial_world_size=2,
        sampler="grid",
        metric="loss",
        cluster=cluster,
    )
    trials = result.trials.set_index("params_lr")
    assert (trials["state"] == "COMPLETE").all() and (trials["ranks"] == 2).all()
    for lr in (0.01, 0.2):
        assert trials.loc[lr, "value"] == pytest.approx(_last_loss_in_one_process(lr), rel=1e-5)
    assert result.best_params == {"lr": 0.2}


def test_the_cli_sweeps_a_config_and_writes_trials_and_best(cluster, store_dir, tmp_path):
    output = tmp_path / "sweep"
    arguments = [
        *("sweep", str(CONFIGS / "digits_ddp.toml")),
        *("--set", f"data.store='{store_dir / 'digits'}'"),
        *("--set", "training.epochs=1"),
        *("--param", "training.lr=log:1e-3:1e-1", "--param", "training.momentum=0.0,0.5"),
        *("--trials", "2", "--max-concurrent", "1", "--metric", "val_accuracy", "--mode", "max"),
        *("--scheduler", cluster.client.scheduler.address, "--output", str(output)),
    ]
    done = run_dask_train(*arguments)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert (
        sum(line.startswith("trial ") and "COMPLETE: val_accuracy" in line for line in lines) == 2
    )
    assert lines[-1].startswith("done: best trial")

    trials = pd.read_csv(output / "trials.csv")
    assert len(trials) == 2 and (trials["state"] == "COMPLETE").all()
    assert {
        "number",
        "value",
        "params",
        "params_training.lr",
        "params_training.momentum",
        "wall_s",
        "ranks",
        "job_id",
    } <= set(trials.columns)
    best = json.loads((output / "best.json").read_text())
    assert best["value"] == trials["value"].max() and best["metric"] == "val_accuracy"
    assert set(best["params"]) == {"training.lr", "training.momentum"}
    assert best["config"]["training"]["lr"] == best["params"]["training.lr"]
    # The config's own world size (2 ranks) unless --trial-world-size says otherwise.
    assert best["config"]["launch"]["world_size"] == 2 and (trials["ranks"] == 2).all()
    assert Path(best["checkpoint_dir"]).is_dir()

    bad = run_dask_train(*arguments[:2], "--param", "training.lr=log:1e-3", "--trials", "1")
    assert bad.returncode == 2 and "--param" in bad.stderr and "training.lr" in bad.stderr


def test_the_cli_sweep_with_a_storage_continues_the_configs_study(
    cluster, store_dir, make_config, tmp_path
):
    # sweep() of the config first, then `dask-train sweep` of the same config with the same
    # storage and no --study-name: one study, <name>-sweep, which the command finds finished:
    # it says so, and starts no cluster and makes no sweep directory (it made an empty one).
    storage = f"sqlite:///{tmp_path / 'sweep.db'}"
    space = {"training.lr": ("log", 1e-3, 1e-1)}
    config = make_config({"name": "digits-ddp"}, epochs=1, max_steps=2)
    result = sweep(config, space, n_trials=1, metric="val_loss", storage=storage, cluster=cluster)
    assert result.study_name == "digits-ddp-sweep" and result.best_trial is not None
    done = run_dask_train(
        *("sweep", str(CONFIGS / "digits_ddp.toml")),
        *("--set", f"data.store='{store_dir / 'digits'}'"),
        *("--set", "training.epochs=1", "--set", "training.max_steps=2"),
        *("--param", "training.lr=log:1e-3:1e-1", "--trials", "1", "--storage", storage),
        *("--scheduler", cluster.client.scheduler.address),
    )
    assert done.returncode == 0, done.stderr
    best = result.best_trial
    assert done.stdout.splitlines() == [
        f"study digits-ddp-sweep in {storage} finished already (1 trials; best trial 0, "
        f"val_loss {best.value:.4f}, training.lr={best.params['training.lr']:.4g}): nothing to "
        "run; more --trials continue it, another --study-name starts a fresh one"
    ]
    assert optuna.get_all_study_names(storage) == ["digits-ddp-sweep"]
    assert not (tmp_path / "runs").exists()


def _fails_far_out(ctx, params: dict) -> float:
    if params["x"] > 0.5:
        raise ValueError(f"x={params['x']} is out of bounds")
    return (params["x"] - OPTIMUM) ** 2  # returned, not reported: the trial's value


def test_a_trial_that_raises_is_fail_and_the_sweep_goes_on(cluster):
    result = sweep(
        _fails_far_out,
        {"x": (0.0, 1.0)},
        n_trials=3,
        metric="loss",
        storage=_study("failing", 0.9, 0.25, 0.4),
        study_name="failing",
        max_concurrent=1,
        cluster=cluster,
    )
    trials = result.trials.set_index("number")
    assert list(trials["state"]) == ["FAIL", "COMPLETE", "COMPLETE"]
    assert trials.loc[0, "error"] == "ValueError: x=0.9 is out of bounds"
    assert result.best_params == {"x": 0.25} and result.best_value == pytest.approx(0.05**2)


@pytest.mark.parametrize(
    ("space", "named"),
    [
        ({"lr": ("log", 0.0, 1.0)}, "space['lr']"),
        ({"lr": (1.0,)}, "space['lr']"),
        ({"hidden": []}, "space['hidden']"),
        ({"hidden": {"a": 1}}, "space['hidden']"),
        ({"dropout": ("uniform", 0.0, 0.5)}, "space['dropout']"),
    ],
)
def test_a_bad_space_fails_before_anything_starts_naming_the_key(space, named):
    with pytest.raises(ValueError, match=named.replace("[", r"\[").replace("]", r"\]")):
        sweep(_descend, space, n_trials=2, metric="loss", log="unused")


def test_a_config_sweep_with_a_misspelt_key_fails_before_any_trial(make_config):
    with pytest.raises(ValueError, match=r"space\['training.lrr'\].*training.lrr"):
        sweep(make_config(), {"training.lrr": ("log", 1e-3, 1e-1)}, n_trials=2, metric="val_loss")
    with pytest.raises(ValueError, match="metric: 'val_los'"):
        sweep(make_config(), {"training.lr": ("log", 1e-3, 1e-1)}, n_trials=2, metric="val_los")


def test_a_config_sweep_of_a_missing_dataset_folder_fails_before_a_cluster_starts(tmp_path):
    # No cluster given: "config: ..." is sweep_spec's refusal, before run_sweep starts one
    # (the store's build would otherwise fail on its own words, on the cluster's client).
    config = {"data": {"dataset": "cifar10", "root": str(tmp_path / "cifar")}}
    with pytest.raises(ValueError, match=r"^config: data\.root: .*cifar-10-batches-py does not"):
        sweep(config, {"training.lr": ("log", 1e-3, 1e-1)}, n_trials=1, metric="val_loss")


def test_the_readmes_sweep_example_runs_as_pasted(tmp_path):
    from tests.test_cluster import _run_in_own_session
    from tests.test_launch import _readme_block

    script = tmp_path / "tune.py"
    script.write_text(_readme_block("def fit(ctx, params)"))
    done = _run_in_own_session([sys.executable, str(script)], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "'lr':" in done.stdout and "COMPLETE" in done.stdout, done.stdout
    assert [p.name for p in tmp_path.iterdir()] == ["tune.py"]
