"""The batch CLI end to end, as a scheduler would call it: real processes, real files."""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch

from tests.commands import (
    CONFIGS,
    dask_train,
    digits_run,
    run_dask_train,
    run_python,
    session_leftovers,
)
from tests.datasets import write_tiny_cifar10
from workers.models import build_model


def _local_settings(tmp_path) -> list[str]:
    """Overrides that keep a run's data, store and dashboard inside the test."""
    return [
        *("--set", f"data.root='{tmp_path / 'raw'}'"),
        *("--set", f"data.store='{tmp_path / 'store'}'"),
        *("--set", "cluster.dashboard_port=0"),
    ]


def test_preprocess_builds_then_reuses_the_cifar10_store_and_run_trains_from_it(tmp_path, cluster):
    write_tiny_cifar10(tmp_path / "raw", per_batch=20)
    # The session's cluster: a local one's start is the other CLI tests' (~3 s a command).
    settings = [*_local_settings(tmp_path), "--scheduler", cluster.client.scheduler.address]
    built = run_dask_train("preprocess", str(CONFIGS / "cifar10_ddp.toml"), *settings)
    assert built.returncode == 0, built.stderr
    assert "built in" in built.stdout and "train 100, val 20 images" in built.stdout

    # The run finds the store preprocess built up to date and trains from it as it is.
    trained = run_dask_train(
        "run",
        str(CONFIGS / "cifar10_ddp.toml"),
        *settings,
        *("--output", str(tmp_path / "run")),
        "--set",
        "training.epochs=1",
        "--set",
        "training.batch_size=20",
        "--set",
        "training.warmup_steps=0",
    )
    assert trained.returncode == 0, trained.stderr
    assert "Epoch [1/1]" in trained.stdout and "done: ddp on 2 ranks" in trained.stdout
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["store"]["reused"] is True


def test_preprocess_of_a_corrupt_batch_exits_2_naming_the_file(tmp_path):
    write_tiny_cifar10(tmp_path / "raw")
    batch = tmp_path / "raw" / "cifar-10-batches-py" / "data_batch_2"
    batch.write_bytes(batch.read_bytes()[:64])
    done = run_dask_train(
        "preprocess", str(CONFIGS / "cifar10_ddp.toml"), *_local_settings(tmp_path)
    )
    assert done.returncode == 2
    assert "data_batch_2: not a readable CIFAR-10 batch" in done.stderr.splitlines()[-1]


def test_cli_rejects_a_bad_config_with_exit_2_and_one_line(tmp_path):
    config = tmp_path / "typo.toml"
    config.write_text("[training]\nepohcs = 3\n")
    for command in ("validate", "run"):
        done = run_dask_train(command, str(config))
        assert done.returncode == 2
        assert done.stderr.strip().count("\n") == 0
        assert "training.epohcs: unknown key" in done.stderr
        assert "Traceback" not in done.stderr


def test_cli_validate_prints_the_resolved_config(tmp_path):
    done = run_dask_train(
        "validate", str(CONFIGS / "digits_ddp.toml"), "--set", "training.epochs=2"
    )
    assert done.returncode == 0, done.stderr
    assert '"epochs": 2' in done.stdout
    # python -m workflows.cli is the same command (it printed nothing and exited 0).
    as_module = subprocess.run(
        [sys.executable, "-m", "workflows.cli", "validate", str(CONFIGS / "digits_ddp.toml")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert as_module.returncode == 0, as_module.stderr
    assert '"epochs": 5' in as_module.stdout


def test_cli_run_with_a_missing_dataset_path_exits_2_naming_the_path(tmp_path):
    done = run_dask_train(
        "run",
        str(CONFIGS / "cifar10_ddp.toml"),
        "--set",
        f"data.root='{tmp_path / 'absent'}'",
        "--set",
        "cluster.dashboard_port=0",
    )
    assert done.returncode == 2, done.stderr
    assert "data.root:" in done.stderr and "absent" in done.stderr
    assert "Traceback" not in done.stderr


def test_run_writes_its_directory_and_refuses_to_overwrite_it(tmp_path, store_dir):
    output = tmp_path / "run"
    arguments = digits_run(store_dir, output, epochs=2)
    done = run_dask_train(*arguments)
    assert done.returncode == 0, done.stderr
    # No terminal: plain lines, no bar and no carriage returns (cron, a pipe, a file).
    assert "\r" not in done.stdout and "%|" not in done.stdout
    lines = done.stdout.splitlines()
    assert [line for line in lines if line.startswith("Epoch [")][1].startswith("Epoch [2/2]")
    dashboard = next(line for line in lines if line.startswith("dashboard: "))
    page = dashboard.removeprefix("dashboard: ").replace("/status", "/training")
    assert f"training page: {page}" in lines
    summary = json.loads((output / "summary.json").read_text())
    assert summary["strategy"] == "ddp" and summary["world_size"] == 2
    # Each rank's peak while training, above what its worker held before (checked below).
    assert len(summary["peak_memory_mib"]) == 2
    assert summary["epochs"] == 2 and summary["final"]["val_accuracy"] > 0.2
    records = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in records if r["kind"] == "epoch"] == [1, 2]
    assert json.loads((output / "config.json").read_text())["training"]["epochs"] == 2
    assert "finished" in (output / "run.log").read_text()
    # Every CLI run keeps TensorBoard events in its directory.
    assert list((output / "tensorboard").glob("events.out.tfevents.*"))
    state = torch.load(output / "model.pt", weights_only=True)
    # A DDP rank's peak: at least the parameters, their gradients and momentum (3 P), in MiB
    # (tests/test_peak_memory.py: the ratio to FSDP's on fresh workers).
    params_mib = sum(t.numel() * t.element_size() for t in state.values()) / 2**20
    peaks = summary["peak_memory_mib"]
    assert all(3 * params_mib <= peak for peak in peaks), peaks
    model = build_model("cifar_cnn", num_classes=10, seed=0)
    model.load_state_dict(state)  # the final model loads into the registry's model

    # One attempt, counted in the run's totals.
    (attempt,) = summary["attempts"]
    assert attempt["status"] == "finished" and (attempt["from_step"], attempt["to_step"]) == (0, 46)
    assert summary["wall_s"] == attempt["wall_s"] > 0
    assert summary["samples"] == attempt["samples"] == 46 * 64  # steps x the global batch
    assert attempt["samples_per_s"] > 0
    assert summary["samples_per_s"] == pytest.approx(attempt["samples_per_s"])

    def files() -> dict[Path, tuple[int, bytes]]:
        return {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in output.rglob("*") if p.is_file()}

    before = files()
    again = run_dask_train(*arguments)
    assert again.returncode == 2
    assert f"{output} already holds run 'digits-ddp'" in again.stderr
    # Resumed, a finished run has nothing to train: no cluster starts, no file changes.
    resumed = run_dask_train(*arguments, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert resumed.stdout.splitlines() == [
        f"{output} finished already (46 steps, {summary['samples_per_s']:.0f} samples/s, "
        f"{summary['wall_s']:.1f} s): nothing to resume"
    ]
    assert files() == before  # left untouched, summary.json byte for byte


def test_a_run_directory_whose_config_is_unreadable_is_refused_naming_the_file(tmp_path):
    # What a run stopped while writing config.json left, before it was written aside and
    # renamed: --resume then failed with a traceback.
    output = tmp_path / "run"
    output.mkdir()
    (output / "config.json").write_text('{\n  "name": "digits-d')
    done = run_dask_train(*digits_run(tmp_path, output, epochs=1), "--resume")
    assert done.returncode == 2, done.stderr
    line = done.stderr.strip()
    assert line.startswith(f"dask-train: {output / 'config.json'}: not readable"), line
    assert "\n" not in line


@pytest.mark.slow
def test_an_unreachable_scheduler_exits_2_with_one_line(tmp_path):
    done = run_dask_train(
        "run",
        str(CONFIGS / "digits_ddp.toml"),
        "--scheduler",
        "tcp://127.0.0.1:9",
        "--set",
        "cluster.connect_timeout_s=2",
        "--output",
        str(tmp_path / "run"),
    )
    assert done.returncode == 2, done.stderr
    assert "cluster.scheduler: could not reach the scheduler at tcp://127.0.0.1:9" in done.stderr
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "run").exists()  # nothing ran, so nothing claims the directory


def test_on_a_terminal_a_progress_bar_updates_in_place(tmp_path, store_dir, cluster):
    leader, follower = os.openpty()
    on_cluster = ("--scheduler", cluster.client.scheduler.address)  # no local cluster's start
    command = dask_train(*digits_run(store_dir, tmp_path / "run", epochs=1), *on_cluster)
    process = subprocess.Popen(command, stdout=follower, stderr=subprocess.PIPE)
    os.close(follower)
    chunks = []
    try:
        while True:
            try:
                chunk = os.read(leader, 4096)
            except OSError:  # the terminal closed: the process is gone
                break
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(leader)
        assert process.wait(timeout=120) == 0, process.stderr.read()
    screen = b"".join(chunks).decode()
    # tqdm's bar for the epoch, rewritten in place, then the epoch's line in its stead.
    assert re.search(r"\rEpoch 1/1: +\d+%\|.*\| \d+/\d+ \[", screen), screen
    assert re.search(r"loss=\d+\.\d{4}", screen), screen
    assert "Epoch [1/1]" in screen
    assert "training page: http://127.0.0.1:" in screen
    # The run directory records the config as it ran: the bar's step logging, the run's
    # own folders.
    recorded = json.loads((tmp_path / "run" / "config.json").read_text())
    assert recorded["training"]["log_every_steps"] == 5
    assert recorded["checkpoint"]["directory"] == str(tmp_path / "run" / "checkpoints")
    assert recorded["tracking"]["tensorboard"] == str(tmp_path / "run" / "tensorboard")


def _unreadable(path: Path) -> list[str]:
    """Make ``path`` unreadable to the command, and the prefix that runs it so.

    Tests run as root here, and root reads any file whatever its mode: dropping the two
    capabilities that let it (from the bounding set, so the exec'd process never gains them)
    makes root as bound by the mode as anyone.
    """
    path.chmod(0)
    if os.geteuid() != 0:
        return []
    return ["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--"]


@pytest.mark.parametrize("case", ["directory", "unreadable", "not utf-8", "broken link", "fifo"])
def test_a_config_path_that_is_no_readable_toml_file_exits_2_with_one_line(tmp_path, case):
    config = tmp_path / "config.toml"
    prefix: list[str] = []
    message = {
        "directory": "a directory, not a config file",
        "unreadable": "cannot read the config file (Permission denied)",
        "not utf-8": "not UTF-8 text (byte 9)",
        "broken link": "a symbolic link to a missing file",
        "fifo": "not a regular file",
    }[case]
    if case == "directory":
        config.mkdir()
    elif case == "unreadable":
        config.write_text('name = "x"\n')
        prefix = _unreadable(config)
    elif case == "not utf-8":
        config.write_bytes(b'name = "x\xff\xfe"\n')
    elif case == "broken link":
        config.symlink_to(tmp_path / "gone.toml")
    else:
        os.mkfifo(config)  # opening it for reading would wait for a writer forever
    for command in ("validate", "run"):
        done = subprocess.run(
            [*prefix, *dask_train(command, str(config))],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 2, done.stderr
        line = done.stderr.strip()
        assert line.startswith(f"dask-train: invalid config: {config}: {message}"), line
        assert "\n" not in line


# Each moment: what shows that the run has reached it, checked every 20 ms.
MOMENTS = {
    "cluster start": lambda out, run: any(line.startswith("run directory:") for line in out),
    "preprocessing": lambda out, run: (run.parent / "fresh-store").exists(),
    "bootstrap": lambda out, run: any(line.startswith("dashboard:") for line in out),
    "mid-epoch": lambda out, run: '"kind": "step"' in _text(run / "metrics.jsonl"),
    "checkpoint": lambda out, run: any((run / "checkpoints").glob(".step-*.partial")),
    "shutdown": lambda out, run: (run / "summary.json").exists(),
}


# A scheduler's SIGTERM (Kubernetes, Slurm, systemd) is handled as Ctrl-C is: one moment gets
# it in place of SIGINT, so both signals are covered without a run of their own.
SIGNALS = {"mid-epoch": signal.SIGTERM}

# The shutdown lasts 0.1-0.2 s from summary.json to the exit (measured here): less than a
# loaded machine may take to see the file and send the signal, which then found a run that
# had ended (exit 0). So the run stops itself (SIGSTOP) once summary.json is in place, and the
# Ctrl-C sent meanwhile lands there when it is continued.
STOP_AT_SUMMARY = """
import os, signal
_replace = os.replace
def _replace_then_stop(source, target, *args, **kwargs):
    _replace(source, target, *args, **kwargs)
    if os.path.basename(target) == "summary.json":
        os.kill(os.getpid(), signal.SIGSTOP)
os.replace = _replace_then_stop
"""
STOPPED = psutil.STATUS_STOPPED


def _text(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("moment", list(MOMENTS))
def test_ctrl_c_at_any_moment_of_a_run_exits_130_and_leaves_no_process(tmp_path, store_dir, moment):
    from workflows.cli import INTERRUPT_EXIT_BOUND_S

    output = tmp_path / "run"
    # Shut down after 4 steps (two checkpoints), or else be interrupted long before the end.
    ending = {"epochs": 1, "max_steps": 4} if moment == "shutdown" else {"epochs": 40}
    arguments = digits_run(store_dir, output, **ending)
    arguments += ["--set", "training.log_every_steps=1", "--set", "checkpoint.every_steps=2"]
    if moment == "preprocessing":
        arguments += ["--set", f"data.store='{tmp_path / 'fresh-store'}'"]
    command = dask_train(*arguments)
    if moment == "shutdown":
        command[2] = STOP_AT_SUMMARY + command[2]  # python -c CODE
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its workers too: all of them must be gone at the end
    )
    lines: list[str] = []
    errors: list[str] = []
    readers = [
        threading.Thread(target=lambda: lines.extend(process.stdout), daemon=True),
        threading.Thread(target=lambda: errors.extend(process.stderr), daemon=True),
    ]
    for reader in readers:
        reader.start()
    try:
        deadline = time.monotonic() + 300  # a bound on reaching the moment, not a measurement
        while not MOMENTS[moment](list(lines), output):
            assert process.poll() is None, f"exited {process.returncode} before the {moment}"
            assert time.monotonic() < deadline, f"the {moment} never came"
            time.sleep(0.02)
        while moment == "shutdown" and psutil.Process(process.pid).status() != STOPPED:
            assert process.poll() is None, f"exited {process.returncode}, not stopped"
            assert time.monotonic() < deadline, "the run did not stop at its summary"
            time.sleep(0.02)
        assert process.poll() is None, f"exited {process.returncode} at the {moment}"
        process.send_signal(SIGNALS.get(moment, signal.SIGINT))  # Ctrl-C, or SIGTERM
        if moment == "shutdown":
            process.send_signal(signal.SIGCONT)
        # The CLI bounds its own shutdown; this wait only keeps a broken one from hanging here.
        process.wait(timeout=INTERRUPT_EXIT_BOUND_S + 60)
        for reader in readers:
            reader.join(timeout=30)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)
    stderr = "".join(errors)
    assert process.returncode == 130, f"{moment}: exit {process.returncode}; {stderr}"
    # Dask may still log while the interrupted cluster closes at exit: any line.
    assert any(line.startswith("dask-train: interrupted") for line in stderr.splitlines())
    if moment == "shutdown":  # it landed after the results were written, whole
        assert json.loads((output / "summary.json").read_text())["steps"] == 4
    _, alive = psutil.wait_procs(session_leftovers(process.pid), timeout=60)
    assert alive == [], f"{moment}: processes left behind: {alive}"
    if moment == "cluster start":
        # The directory was named before it was written, and written only once the cluster
        # was up: stopped in between, the run said to --resume a directory that did not
        # exist, and --resume was a usage error (exit 2). Now it holds the run by then.
        assert f"continue with --output {output} --resume" in stderr
        resumed = run_dask_train(*arguments, "--resume", "--set", "training.max_steps=2")
        assert resumed.returncode == 0, resumed.stderr
        assert json.loads((output / "summary.json").read_text())["steps"] == 2


def test_a_ctrl_c_that_lands_in_a_finalizer_is_not_lost():
    # Python drops an exception raised inside __del__ ("Exception ignored in ..."): a Ctrl-C
    # arriving while the garbage collector runs one would let the run go on.
    code = """
import signal, time
from workflows.cli import _Interrupts

_Interrupts().install()

class Finalized:
    def __del__(self):
        signal.raise_signal(signal.SIGINT)  # Ctrl-C, while a finalizer runs

try:
    Finalized()
    for _ in range(6000):  # a bound (60 s) on its arrival, not a measurement
        time.sleep(0.01)
    print("lost")
except KeyboardInterrupt:
    print("delivered")
"""
    done = run_python(code)
    assert done.stdout.strip() == "delivered", done.stderr
