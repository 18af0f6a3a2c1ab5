"""The suite leaves the checkout as it found it."""

import shutil
from pathlib import Path

from tests.conftest import REPO, repo_entries


def test_the_session_guard_sees_a_run_left_in_the_checkout_even_beside_older_runs():
    runs = REPO / "runs"
    created = not runs.exists()
    runs.mkdir(exist_ok=True)  # the harder case: git shows runs/ as one line either way
    probe = runs / "guard-probe-run"
    try:
        before = repo_entries()
        assert before is not None, "not a git checkout"
        probe.mkdir()
        (probe / "metrics.jsonl").write_text("{}\n")
        new = repo_entries() - before
    finally:
        shutil.rmtree(probe, ignore_errors=True)
        if created:
            runs.rmdir()
    assert [line for line in new if "guard-probe-run" in line]


def test_every_folder_of_code_is_a_package_that_git_keeps():
    # An ignore rule that matches a package's folder (runs/, data/: the CLI's output folders)
    # keeps its new files out of every commit: a clean clone then imports the folder as a
    # namespace package, without its __init__.py.
    import subprocess

    tracked = set(
        subprocess.run(
            ["git", "ls-files", "workflows", "workers"],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
    )
    folders = {str(Path(path).parent) for path in tracked if path.endswith(".py")}
    scripts = {"workflows/benchmarks/torchrun_scripts"}  # run by path under torchrun, not imported
    assert sorted(f for f in folders - scripts if f"{f}/__init__.py" not in tracked) == []
