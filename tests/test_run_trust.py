"""What a run's files, URLs and logs may do to the user who runs it (issue 59): a run kept in a
bucket says it finished only once everything is there, its local copy is private and never
deleted unsent, URLs are checked before anything starts, code named in a file runs only when
the user says so, and a user error reads as one message."""

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from workflows import predict
from workflows.cli import main
from workflows.config import ConfigError, load_config
from workflows.prediction_request import prepare, resolve_model
from workflows.run_directory import RunDirectory
from workflows.run_storage import SUMMARY, RunMirror
from workflows.trust import CONFIG_SIGNATURE

CONFIGS = Path(__file__).parents[1] / "workflows" / "configs"


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


def _a_finished_run(folder: Path, model: dict) -> Path:
    """A run directory as a colleague's bucket might hand it over: its config.json naming
    ``model``, a model.pt and the store statistics in summary.json."""
    raw = load_config(CONFIGS / "digits_ddp.toml").model_dump(mode="json")
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(raw | {"model": model}))
    (folder / "model.pt").write_bytes(b"not read before the config is trusted")
    statistics = {"mean": [0.5], "std": [0.25], "classes": [str(i) for i in range(10)]}
    (folder / SUMMARY).write_text(json.dumps({"store": statistics | {"image_size": 8}}))
    return folder


def test_predict_refuses_a_model_that_a_run_config_names_by_import_path_before_importing_it(
    tmp_path,
):
    marker = tmp_path / "ran"
    command = {"name": "os:system", "kwargs": {"command": f"touch {marker}"}}
    run = _a_finished_run(tmp_path / "run", command)
    arguments = ["predict", str(CONFIGS / "digits_ddp.toml"), "--model", str(run)]
    arguments += ["--input", str(tmp_path / "input"), "--output", str(tmp_path / "scored")]
    done = CliRunner().invoke(main, arguments)  # in this process: no second torch import
    assert done.exit_code == 2, done.output
    assert not marker.exists()
    (message,) = done.stderr.strip().splitlines()
    assert "config.json: model.name = 'os:system'" in message and "--trust-config" in message
    # From Python alike, naming the keyword; opting in is what runs the file's code.
    with pytest.raises(ConfigError, match=r"predict\(model=...\).*trust_config=True"):
        predict(model=run, input=tmp_path / "input", output=tmp_path / "scored")
    assert not marker.exists()
    with pytest.raises(ConfigError, match=r"not a torch\.nn\.Module"):
        prepare(model=run, input=tmp_path / "x", output=tmp_path / "y", trust_config=True)
    assert marker.exists()


def test_a_signed_run_config_is_trusted_with_its_key_and_refused_once_changed(
    tmp_path, make_config
):
    key = tmp_path / "signing.key"
    key.write_text("a key only the team holds\n")
    own_model = {"name": "tests.traced_models:ResidualNet", "kwargs": {"width": 8}}
    signed = make_config({"model": own_model, "checkpoint": {"signing_key_file": str(key)}})
    run = tmp_path / "run"
    with RunDirectory.create(signed, run):
        pass
    statistics = {"mean": [0.5], "std": [0.25], "classes": [str(i) for i in range(10)]}
    (run / SUMMARY).write_text(json.dumps({"store": statistics | {"image_size": 8}}))
    (run / "model.pt").write_bytes(b"weights")
    holder = make_config({"checkpoint": {"signing_key_file": str(key)}})  # names cifar_cnn
    assert resolve_model(run, holder).config.model.name == own_model["name"]
    # Without the key, the import path is refused; the same model named by the user is not.
    with pytest.raises(ConfigError, match=r"model\.name = 'tests\.traced_models:ResidualNet'"):
        resolve_model(run, make_config())
    assert resolve_model(run, make_config({"model": own_model})).config.model == signed.model
    # Changed after signing: refused with the key, whatever it names.
    raw = json.loads((run / "config.json").read_text())
    raw["model"]["name"] = "cifar_cnn"
    (run / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=r"config\.json has a wrong signature"):
        resolve_model(run, holder)
    (run / CONFIG_SIGNATURE).unlink()
    with pytest.raises(ConfigError, match=r"config\.json carries no signature"):
        resolve_model(run, holder)
