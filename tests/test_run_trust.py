"""What a run's files, URLs and logs may do to the user who runs it (issue 59): a run kept in a
bucket says it finished only once everything is there, its local copy is private and never
deleted unsent, URLs are checked before anything starts, code named in a file runs only when
the user says so, and a user error reads as one message."""

import json
import logging
import os
import stat
import tempfile
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from tests.worker_logs import raise_it, what_stderr_shows
from workflows import predict
from workflows.cli import main
from workflows.prediction.prediction_request import prepare, resolve_model
from workflows.runs.config import ConfigError, load_config
from workflows.runs.run_directory import RunDirectory
from workflows.runs.run_storage import SUMMARY, RunMirror, mirror_folder

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
    sent = ["config.json", "metrics.jsonl", "model.pt", SUMMARY]
    assert sorted(p.name for p in bucket.iterdir()) == sent
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


def _invoke(arguments: list[str]) -> Result:
    """The CLI in this process, as called from Python (standalone_mode=False): its own Ctrl-C
    handling (signal handlers, an exit hook that ends the process with the command's status)
    is for a process of its own, and installed here it outlived the test: a later Ctrl-C
    test's interrupt ended the whole suite 30 s after (exit 130)."""
    return CliRunner().invoke(main, arguments, standalone_mode=False)


def test_predict_refuses_a_model_that_a_run_config_names_by_import_path_before_importing_it(
    tmp_path,
):
    marker = tmp_path / "ran"
    command = {"name": "os:system", "kwargs": {"command": f"touch {marker}"}}
    run = _a_finished_run(tmp_path / "run", command)
    arguments = ["predict", str(CONFIGS / "digits_ddp.toml"), "--model", str(run)]
    arguments += ["--input", str(tmp_path / "input"), "--output", str(tmp_path / "scored")]
    done = _invoke(arguments)  # in this process: no second torch import
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
    from workflows.runs.trust import CONFIG_SIGNATURE

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


@pytest.mark.parametrize(
    ("arguments", "said"),
    [
        (["run", "--output", "s3:/bucket/run"], "--output: s3:/bucket/run: not a URL (s3:// takes"),
        (["run", "--output", "foo://bucket/run"], "--output: foo://bucket/run: unknown protocol"),
        (
            ["run", "--set", "checkpoint.directory='gs:/b/c'"],
            "checkpoint.directory: gs:/b/c: not a URL (gs:// takes",
        ),
        (["run", "--set", "data.store='foo://b/s'"], "data.store: foo://b/s: unknown protocol"),
        (
            ["predict", "--model", "s3:/b/run", "--input", "x", "--output", "y"],
            "--model: s3:/b/run: not a URL",
        ),
        (
            [
                "sweep",
                "--param",
                "training.lr=log:1e-3:1e-1",
                "--trials",
                "2",
                "--output",
                "s3://b/s",
            ],
            "--output: s3:/b/s: not a URL",
        ),
    ],
)
def test_a_mistyped_url_is_refused_in_one_line_before_anything_is_written(
    arguments, said, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    command, *options = arguments
    done = _invoke([command, str(CONFIGS / "digits_ddp.toml"), *options])
    assert done.exit_code == 2, done.output
    (message,) = done.stderr.strip().splitlines()
    assert said in message, message
    assert not list(tmp_path.iterdir())  # no folder named s3: or foo:


def test_a_file_url_means_its_path(tmp_path):
    assert RunDirectory.path_of(f"file://{tmp_path}/run", "n") == tmp_path / "run"
    config = load_config({"checkpoint": {"directory": f"file://{tmp_path}/ckpt"}})
    assert config.checkpoint.directory == f"{tmp_path}/ckpt"


def test_every_writer_of_a_bucket_uses_the_one_set_of_options_the_config_gives_it(
    s3, make_config, tmp_path, monkeypatch
):
    # No credentials where s3fs would look for them, and an endpoint that refuses: only the
    # config's options reach the server.
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:1")
    bucket = s3.bucket("one-set")
    options = {"checkpoint": {"storage_options": s3.storage_options}}
    url = f"{bucket}/runs/x"
    config = make_config(RunDirectory.with_its_folders(options, url))
    with RunDirectory.create(config, url):  # the run directory's copy: config.json at once
        pass
    assert s3.filesystem().exists(f"{url.removeprefix('s3://')}/config.json")
    # A sweep's journal in the same bucket.
    optuna = pytest.importorskip("optuna")
    from workflows.sweeps.sweep import SweepRequest, sweep_spec

    in_the_bucket = {"checkpoint": options["checkpoint"] | {"directory": f"{url}/checkpoints"}}
    swept = make_config(in_the_bucket)
    request = SweepRequest(
        swept,
        {"training.lr": ("log", 1e-3, 1e-1)},
        n_trials=1,
        metric="val_loss",
        storage=f"{bucket}/study.log",
    )
    spec = sweep_spec(request)
    optuna.create_study(storage=spec.storage, study_name="s")
    assert s3.filesystem().ls(f"{bucket.removeprefix('s3://')}/study.log.d")
    # Two sets for one bucket: which one would a writer take? Refused.
    other = {"endpoint_url": "http://127.0.0.1:2"}
    with pytest.raises(ConfigError, match="one bucket one set of options"):
        make_config(in_the_bucket | {"data": {"store": f"{bucket}/s", "storage_options": other}})


def test_a_bucket_runs_local_copy_is_private_and_a_failed_upload_is_sent_by_the_resume(
    s3, make_config, monkeypatch, tmp_path
):
    from workflows.runs.run_storage import mirror_root

    for key, value in s3.environment.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # this test's own mirrors
    name = "left-unsent"
    url = f"{s3.bucket(name)}/runs/x"
    config = make_config(RunDirectory.with_its_folders({}, url))
    directory = RunDirectory.create(config, url)
    folder = mirror_folder(url)
    assert folder.parent == mirror_root() == tmp_path / f"dask-train-runs-{os.getuid()}"
    root = folder.parent.lstat()
    assert root.st_uid == os.getuid() and stat.S_IMODE(root.st_mode) == 0o700
    fs = s3.filesystem()
    with pytest.raises(Exception, match=r"bucket does not exist"), directory:
        (directory.path / "model.pt").write_bytes(b"the final weights")
        (directory.path / SUMMARY).write_text(json.dumps({"epochs": 10**6}))
        fs.rm(name, recursive=True)  # the last copy finds no bucket
    assert (folder / "model.pt").read_bytes() == b"the final weights"
    fs.mkdir(name)
    resumed = RunDirectory.create(config, url, resume=True)
    fs.invalidate_cache()
    assert fs.cat_file(f"{name}/runs/x/model.pt") == b"the final weights"
    assert resumed.finished == {"epochs": 10**6}  # its summary, sent last: the run finished
    # The resumed run's mirror, the bucket's copy read back and left: nothing in it unsent.
    again = RunDirectory.create(config, url, resume=True)
    assert [p.name for p in folder.parent.iterdir()] == [folder.name]
    # A mirror a killed process left, a file changed since it was sent (and the bucket may be
    # newer than the rest): kept aside.
    (again.path / "model.pt").write_bytes(b"weights of a killed process")
    RunDirectory.create(config, url, resume=True)
    (aside,) = folder.parent.glob(f"{folder.name}-left-*")
    assert (aside / "model.pt").read_bytes() == b"weights of a killed process"


def test_a_mirror_folder_that_is_not_the_users_own_is_refused(make_config, tmp_path, monkeypatch):
    from workflows.runs.run_storage import mirror_root

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    elsewhere = tmp_path / "someone-elses"
    elsewhere.mkdir(mode=0o777)
    mirror_root().symlink_to(elsewhere)  # planted where the run would write
    config = make_config(RunDirectory.with_its_folders({}, "memory://b/run"))
    with pytest.raises(ConfigError, match=r"is not a folder of this user's"):
        RunDirectory.create(config, "memory://b/run")
    assert not list(elsewhere.iterdir())


def test_our_own_errors_compute_failed_blocks_stay_off_the_terminal_and_in_the_worker_log(
    cluster,
):
    from workers.sources import SourceError
    from workers.user_errors import UserErrorsOffStderr

    client = cluster.client
    client.register_plugin(UserErrorsOffStderr())
    try:
        futures = {
            "ours": client.submit(raise_it, SourceError("data.root: x: refused"), key="ours"),
            "a bug": client.submit(raise_it, RuntimeError("a bug"), key="a-bug"),
        }
        for future in futures.values():
            with pytest.raises((SourceError, RuntimeError)):
                future.result(timeout=30)
        shown = {}
        for seen in client.run(what_stderr_shows, keys=["ours", "a-bug"]).values():
            shown |= seen
    finally:
        client.unregister_worker_plugin(UserErrorsOffStderr.name)
    assert shown == {"ours": False, "a-bug": True}


def test_every_user_error_name_is_one_of_our_error_types_with_its_subclasses():
    from workers.activation_checkpointing import ActivationCheckpointingError
    from workers.checkpoint import CheckpointDamaged
    from workers.data import StoreRefused
    from workers.in_place_init import InPlaceInitError
    from workers.inference import CheckpointError
    from workers.model_sources import ModelError
    from workers.optimizers import OptimizerError
    from workers.sources import SourceError
    from workers.sources.cifar10 import BatchRefused
    from workers.user_errors import USER_ERRORS
    from workers.weight_files import WeightsError
    from workflows.jobs.collections import DataError

    roots = [ActivationCheckpointingError, BatchRefused, CheckpointDamaged, CheckpointError]
    roots += [ConfigError, DataError, ModelError, OptimizerError, SourceError]
    roots += [InPlaceInitError, WeightsError]  # imported: subclasses of ModelError
    roots += [StoreRefused]

    def with_subclasses(kind: type) -> set[str]:
        return {kind.__name__}.union(*(with_subclasses(k) for k in kind.__subclasses__()))

    assert set(USER_ERRORS) == set().union(*(with_subclasses(k) for k in roots))


def test_every_secret_is_masked_wherever_it_is_written_or_shown(make_config, tmp_path):
    from workflows.observe.tracking import flatten
    from workflows.sweeps.sweep_directory import SweepDirectory

    planted = {name: f"planted-{name}-{os.getpid()}" for name in ("phrase", "cookie", "url")}
    planted |= {"weights": f"weights-{os.getpid()}", "database": f"database-{os.getpid()}"}
    options = {
        "passphrase": planted["phrase"],
        "headers": {"Cookie": planted["cookie"]},
        "endpoint_url": f"http://user:{planted['url']}@127.0.0.1:9",
    }
    raw = {
        "name": "secretive",
        "checkpoint": {"storage_options": options},
        "model": {"weights": f"ftp://user:{planted['weights']}@127.0.0.1/w"},
    }
    config = make_config(RunDirectory.with_its_folders(raw, tmp_path / "run"))
    shown = [repr(config), str(config), repr(config.checkpoint), json.dumps(flatten(raw))]
    shown.append(json.dumps(flatten(config.model_dump(mode="json"))))  # MLflow's params
    with RunDirectory.create(config, tmp_path / "run"):  # config.json, run.log
        logging.getLogger("workflows.test").warning("reaching %s", options)
    database = f"postgresql://user:{planted['database']}@127.0.0.1:1/db"
    sweep = SweepDirectory.open("secretive", tmp_path / "sweep", study_name=None, storage=database)
    sweep.write_request({"config": config.model_dump(mode="json")})
    # An error that names the storage, from the CLI.
    arguments = ["sweep", str(CONFIGS / "digits_ddp.toml"), "--trials", "1", "--storage", database]
    arguments += ["--param", "training.lr=log:1e-3:1e-1", "--output", str(tmp_path / "refused")]
    done = _invoke(arguments)
    assert done.exit_code == 2 and "storage: postgresql://user:***@127.0.0.1:1/db" in done.stderr
    shown.append(done.output)
    # An error from Python, naming the location with its password.
    with pytest.raises(ConfigError, match=r"foo://user:\*\*\*@h/x: unknown protocol") as refused:
        load_config({"checkpoint": {"directory": f"foo://user:{planted['weights']}@h/x"}})
    shown.append(str(refused.value))
    written = [path.read_bytes() for path in tmp_path.rglob("*") if path.is_file()]
    assert len(written) >= 3  # config.json, run.log, sweep.json
    for secret in planted.values():
        assert not [text for text in shown if secret in text], secret
        assert not [data for data in written if secret.encode() in data], secret
    # What is left is said to be masked; the config in this process keeps every value.
    assert b"reaching {'passphrase': '***'" in (tmp_path / "run" / "run.log").read_bytes()
    assert config.checkpoint.storage_options == options
