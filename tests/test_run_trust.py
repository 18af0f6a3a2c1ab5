"""What a run's files, URLs and logs may do to the user who runs it (issue 59): a run kept in a
bucket says it finished only once everything is there, its local copy is private and never
deleted unsent, URLs are checked before anything starts, code named in a file runs only when
the user says so, and a user error reads as one message."""

from pathlib import Path

import pytest

from workflows.run_storage import SUMMARY, RunMirror


def test_a_run_mirror_sends_its_summary_only_after_every_other_file(tmp_path):
    # A summary in the bucket says the run finished: a final copy that fails on the model
    # must leave none there.
    mirror_folder, bucket = tmp_path / "mirror", tmp_path / "bucket"
    mirror_folder.mkdir()
    for name in ("config.json", "metrics.jsonl", "model.pt", SUMMARY):
        (mirror_folder / name).write_text(name)
    (bucket / "model.pt").mkdir(parents=True)  # where model.pt goes, a folder: its copy fails
    mirror = RunMirror(f"file://{bucket}", mirror_folder)
    with pytest.raises(OSError):
        mirror.copy(final=True)
    assert (bucket / "config.json").read_text() == "config.json"
    assert not (bucket / SUMMARY).exists()
    (bucket / "model.pt").rmdir()
    mirror.copy(final=True)
    assert sorted(p.name for p in bucket.iterdir()) == sorted(
        p.name for p in mirror_folder.iterdir()
    )
    assert Path(bucket / SUMMARY).read_text() == SUMMARY
