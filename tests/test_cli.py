"""The batch CLI end to end, as a scheduler would call it: real processes, real files."""

import subprocess
import sys
from pathlib import Path

from tests.datasets import write_tiny_cifar10

CONFIGS = Path(__file__).parents[1] / "workflows" / "configs"


def _cli(*args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-c", "from workflows.cli import main; main()", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=300)


def _local_settings(tmp_path) -> list[str]:
    """Overrides that keep a run's data, store and dashboard inside the test."""
    return [
        *("--set", f"data.root='{tmp_path / 'raw'}'"),
        *("--set", f"data.store='{tmp_path / 'store'}'"),
        *("--set", "cluster.dashboard_port=0"),
    ]


def test_preprocess_builds_then_reuses_the_cifar10_store_and_run_trains_from_it(tmp_path):
    write_tiny_cifar10(tmp_path / "raw", per_batch=20)
    settings = _local_settings(tmp_path)
    built = _cli("preprocess", str(CONFIGS / "cifar10_ddp.toml"), *settings)
    assert built.returncode == 0, built.stderr
    assert "built in" in built.stdout and "train 100, val 20 images" in built.stdout
    reused = _cli("preprocess", str(CONFIGS / "cifar10_ddp.toml"), *settings)
    assert reused.returncode == 0, reused.stderr
    assert "up to date, reused" in reused.stdout

    trained = _cli(
        "run",
        str(CONFIGS / "cifar10_ddp.toml"),
        *settings,
        "--set",
        "training.epochs=1",
        "--set",
        "training.batch_size=20",
        "--set",
        "training.warmup_steps=0",
    )
    assert trained.returncode == 0, trained.stderr
    assert "Epoch [1/1]" in trained.stdout and "done: ddp on 2 ranks" in trained.stdout


def test_preprocess_of_a_corrupt_batch_exits_2_naming_the_file(tmp_path):
    write_tiny_cifar10(tmp_path / "raw")
    batch = tmp_path / "raw" / "cifar-10-batches-py" / "data_batch_2"
    batch.write_bytes(batch.read_bytes()[:64])
    done = _cli("preprocess", str(CONFIGS / "cifar10_ddp.toml"), *_local_settings(tmp_path))
    assert done.returncode == 2
    assert "data_batch_2: not a readable CIFAR-10 batch" in done.stderr.splitlines()[-1]


def test_cli_rejects_a_bad_config_with_exit_2_and_one_line(tmp_path):
    config = tmp_path / "typo.toml"
    config.write_text("[training]\nepohcs = 3\n")
    for command in ("validate", "run"):
        done = _cli(command, str(config))
        assert done.returncode == 2
        assert done.stderr.strip().count("\n") == 0
        assert "training.epohcs: unknown key" in done.stderr
        assert "Traceback" not in done.stderr


def test_cli_validate_prints_the_resolved_config(tmp_path):
    done = _cli("validate", str(CONFIGS / "digits_ddp.toml"), "--set", "training.epochs=2")
    assert done.returncode == 0, done.stderr
    assert '"epochs": 2' in done.stdout


def test_cli_run_with_a_missing_dataset_path_exits_2_naming_the_path(tmp_path):
    done = _cli(
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
