"""The suite leaves the checkout as it found it."""

import shutil

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
