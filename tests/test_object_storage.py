"""Checkpoints in a bucket of a real S3-compatible server (moto's, a process on loopback,
reached through s3fs): written with no rename, the manifest last; a worker killed and a run
resumed from the bucket; FSDP shards resharded from it; partial uploads never taken and then
deleted; planted metadata refused from it; asynchronous uploads committed once written, a
failed one reported to the client, one in flight when the job is stopped committed within
launch.release_timeout_s or never; credentials never written out."""

import copyreg
import hashlib
import json
import logging
import os
import pathlib
import re
import signal
import sys
import threading
import time

import psutil
import pytest
import torch
import torch.distributed as dist

from tests.reference import SGD_FEW_STEPS, assert_matches_one_process, assert_same_parameters
from tests.refusals import refusal
from tests.test_checkpoint_security import BUILT_ATTRIBUTE, EXTENSION_CODE, _payloads
from workers.checkpoint import (
    MANIFEST,
    AsyncCheckpoints,
    CheckpointDamaged,
    CheckpointDestination,
    CheckpointState,
    Progress,
    latest_good_checkpoint,
    list_checkpoints,
    read_metadata,
    safe_reader,
    save_checkpoint,
    verify_checkpoint,
)
from workers.models import build_model
from workers.spec.launch import LaunchConfig
from workflows.benchmarks.local_s3 import KEY, SECRET
from workflows.jobs.launcher import STOPPED_RANK_GRACE_S, JobStopped, ProcessGroup
from workflows.runs.driver import train
from workflows.runs.run_directory import RunDirectory

BASE = {"lr": 0.1, "momentum": 0.9, "batch_size": 64, "seed": 5, "log_every_steps": 1}
WORKERS = 4  # the module's one cluster: four_workers, which the FSDP test needs


@pytest.fixture(scope="module")
def bucket(s3) -> str:
    return s3.bucket("checkpoints")


@pytest.fixture
def in_bucket(make_config, s3, bucket):
    """A config of the built-in trainer checkpointing into ``<bucket>/<name>``."""

    def config(name, *, checkpoint=None, launch=None, **training):
        raw = {
            "name": name,
            "checkpoint": {
                "directory": f"{bucket}/{name}",
                "storage_options": s3.storage_options,
                **(checkpoint or {}),
            },
            "launch": launch or {},
        }
        return make_config(raw, **(BASE | training))

    return config


@pytest.fixture(autouse=True)
def _all_workers_back(request):
    """A test that killed a worker leaves the module's cluster whole for the next one: the
    nanny starts a replacement, which may still be joining when the job ends."""
    yield
    if "four_workers" in request.fixturenames:
        request.getfixturevalue("four_workers").client.wait_for_workers(WORKERS, timeout=120)


def _steps_into(steps: list[int]):
    """An on_event handler that keeps the steps the run reports."""

    def on_event(record):
        if record["kind"] == "step":
            steps.append(record["step"])

    return on_event


def _manifest(fs, checkpoint: str) -> dict:
    return json.loads(fs.cat_file(f"{checkpoint}/{MANIFEST}"))


def _pid_of_worker(cluster, name: int) -> int:
    workers = cluster.client.scheduler_info()["workers"]
    (address,) = [a for a, info in workers.items() if info["name"] == name]
    return cluster.client.run(os.getpid, workers=[address])[address]


def test_a_ddp_run_into_a_bucket_survives_a_sigkill_and_resumes_from_the_bucket(
    four_workers, in_bucket, s3
):
    opts = s3.storage_options
    # Two ranks, on the workers named 0 and 1: a sum of two is the same in any order, so a
    # recovered or resumed run (whose new DDP buckets cut the gradients elsewhere) equals an
    # uninterrupted one to the last bit.
    launch = {"world_size": 2, "workers": {"name_pattern": "[01]"}}
    straight = train(
        in_bucket("ddp-straight", max_steps=10, launch=launch), cluster=four_workers, on_event=None
    )
    config = in_bucket(
        "ddp", max_steps=10, checkpoint={"every_steps": 3, "keep": 10}, launch=launch
    )
    victim = _pid_of_worker(four_workers, 1)
    killed: list[float] = []

    def kill_at_step_3(record):
        if not killed and record["kind"] == "step" and record["step"] >= 3:
            os.kill(victim, signal.SIGKILL)
            killed.append(time.time())

    result = train(config, cluster=four_workers, on_event=kill_at_step_3)
    assert killed, "the kill never happened"
    assert not psutil.pid_exists(victim) or psutil.Process(victim).status() == "zombie"
    (recovery,) = result.recoveries
    # The job looked in the bucket for its newest checkpoint and took the survivor's newer
    # state; either way, what it ends with is the uninterrupted run's, to the last bit.
    assert recovery["recovered_from"] in ("replica", "checkpoint")
    assert_same_parameters(result.state_dict, straight.state_dict)

    directory = config.checkpoint.directory
    saved = list_checkpoints(directory, opts)
    # Step 3's save may have been under way when the kill landed: then it never got its
    # manifest, and step 6's commit deleted what it had uploaded.
    assert saved[:3] == [f"{directory}/step-{step:09d}" for step in (10, 9, 6)]
    assert saved[3:] in ([], [f"{directory}/step-000000003"])
    # Straight into step-<n>/, nothing renamed, nothing partial left behind.
    fs = s3.filesystem()
    assert sorted(fs.ls(directory)) == sorted(p.removeprefix("s3://") for p in saved)
    newest = _manifest(fs, saved[0])
    assert newest["world_size"] == 2
    assert set(newest["files"]) == {".metadata", "__0_0.distcp", "__1_0.distcp"}

    # As if the run had been stopped after step 6: its later checkpoints never made it.
    for newer in saved[:2]:
        fs.rm(newer, recursive=True)
    steps: list[int] = []
    resumed = train(config, cluster=four_workers, on_event=_steps_into(steps))
    assert steps == [7, 8, 9, 10]  # from the bucket's step 6, not from the start
    assert_same_parameters(resumed.state_dict, straight.state_dict)
    assert resumed.history[-1]["val_loss"] == straight.history[-1]["val_loss"]


def test_an_fsdp_checkpoint_saved_at_four_ranks_in_a_bucket_resumes_at_two(
    four_workers, make_config, s3, bucket
):
    # DCP writes each rank's shards into the bucket; at two ranks it reads them back into
    # halves as large, through fsspec.
    opts = s3.storage_options
    folder = f"{bucket}/fsdp"
    training = SGD_FEW_STEPS | {"batch_size": 32, "epochs": 1, "seed": 3, "max_steps": 5}
    checkpoint = {"directory": folder, "storage_options": opts, "every_steps": 1}
    raw = {"name": "sharded", "checkpoint": checkpoint}
    config = make_config(raw, strategy="fsdp", **training)
    assert train(config, cluster=four_workers, on_event=None).world_size == WORKERS
    fs = s3.filesystem()
    # As if the four ranks had been stopped after step 3, in the middle of the epoch.
    for newer in list_checkpoints(folder, opts)[:2]:
        fs.rm(newer, recursive=True)
    (at_step_3,) = [_manifest(fs, p) for p in list_checkpoints(folder, opts)[:1]]
    assert (at_step_3["step"], at_step_3["epoch"], at_step_3["batch"]) == (3, 0, 3)
    assert {f"__{r}_0.distcp" for r in range(WORKERS)} <= set(at_step_3["files"])
    at_two = make_config(raw | {"launch": {"world_size": 2}}, strategy="fsdp", **training)
    resumed = train(at_two, cluster=four_workers, on_event=None)
    assert (resumed.world_size, resumed.history[-1]["step"]) == (2, 5)
    # Three steps on what four ranks read, then two on what two ranks read from the same place
    # in the epoch: what the resumed run did, or it started over or lost the optimizer state.
    # (test_fsdp.py shows this comparison failing on each planted bug; not repeated here.)
    assert_matches_one_process(
        resumed.state_dict, config, world_size=4, steps=3, then=(2, 2), bugs=()
    )


def _save_a_cnn(
    directory: str,
    storage_options: dict,
    step: int,
    *,
    keep: int,
    commit: bool = True,
    writer: AsyncCheckpoints | None = None,
) -> None:
    """Runs on every rank: the registry's CNN and its SGD state saved as of ``step``."""
    model = build_model("cifar_cnn", num_classes=10, seed=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    save_checkpoint(
        CheckpointDestination(directory, keep=keep, storage_options=storage_options),
        CheckpointState([model], optimizer, torch.amp.GradScaler("cpu", enabled=False)),
        progress=Progress(step=step),
        commit=commit,
        writer=writer,
    )


def _save_without_commit(directory: str, storage_options: dict, step: int) -> None:
    """Runs on every rank: upload a checkpoint's files, then stop before the manifest, as a
    client or worker killed mid-upload leaves it."""
    _save_a_cnn(directory, storage_options, step, keep=3, commit=False)


@pytest.fixture(scope="module")
def signing_key(tmp_path_factory) -> str:
    key = tmp_path_factory.mktemp("keys") / "key"
    key.write_bytes(b"a secret only the trainer knows\n")
    return str(key)


SIGNED = {"every_steps": 2, "keep": 10}  # the signed run's checkpoints: steps 2 and 4


@pytest.fixture(scope="module")
def signed_run(four_workers, make_config, s3, bucket, signing_key) -> str:
    """One run's signed checkpoints (steps 2 and 4, two ranks) in the bucket; each test copies
    them into a folder of its own (a copy inside the store, no download)."""
    checkpoint = {
        "directory": f"{bucket}/signed",
        "storage_options": s3.storage_options,
        "signing_key_file": signing_key,
        **SIGNED,
    }
    raw = {"name": "signed", "checkpoint": checkpoint, "launch": {"world_size": 2}}
    train(make_config(raw, **(BASE | {"max_steps": 4})), cluster=four_workers, on_event=None)
    return checkpoint["directory"]


def _copy(s3, source: str, target: str) -> str:
    fs = s3.filesystem()
    fs.copy(f"{source}/", f"{target}/", recursive=True)
    fs.invalidate_cache()
    return target


def test_a_shard_cut_short_in_the_bucket_is_passed_over_by_its_size(s3, bucket, signed_run):
    opts, fs = s3.storage_options, s3.filesystem()
    root = _copy(s3, signed_run, f"{bucket}/cut")
    newest, older = list_checkpoints(root, opts)
    shard = f"{newest}/__1_0.distcp"
    fs.pipe_file(shard, fs.cat_file(shard)[:-1])  # one byte short, as a broken upload leaves
    with pytest.raises(CheckpointDamaged, match=r"not the size the manifest says"):
        verify_checkpoint(newest, storage_options=opts)
    assert latest_good_checkpoint(root, None, opts)[0] == older


def test_a_byte_changed_in_a_shard_in_the_bucket_is_refused_with_a_key_and_without(
    s3, bucket, signed_run, signing_key
):
    # Before, a checkpoint in a bucket was checked by its files' sizes only (without a key):
    # one byte changed in place passed. Every file's hash is checked now, wherever it lives,
    # whether the manifest is signed or not.
    opts, fs = s3.storage_options, s3.filesystem()
    root = _copy(s3, signed_run, f"{bucket}/flipped")
    newest, older = list_checkpoints(root, opts)
    manifest = _manifest(fs, newest)
    # The manifest's hashes and sizes are those of the files in the bucket (hashed as written).
    for name, digest in manifest["files"].items():
        content = fs.cat_file(f"{newest}/{name}")
        assert (hashlib.sha256(content).hexdigest(), len(content)) == (
            digest,
            manifest["sizes"][name],
        )
    shard = f"{newest}/__1_0.distcp"
    content = bytearray(fs.cat_file(shard))
    content[len(content) // 2] ^= 0x01  # the same size
    fs.pipe_file(shard, bytes(content))
    for key in (None, signing_key):
        with pytest.raises(CheckpointDamaged, match=r"__1_0\.distcp: checksum differs from the"):
            verify_checkpoint(newest, key, opts)
        assert latest_good_checkpoint(root, key, opts)[0] == older


def test_a_partial_upload_is_never_resumed_from_and_retention_deletes_it(
    four_workers, in_bucket, s3, bucket, signed_run, signing_key, caplog
):
    opts, fs = s3.storage_options, s3.filesystem()
    directory = _copy(s3, signed_run, f"{bucket}/partial")
    with ProcessGroup(four_workers.client, LaunchConfig(world_size=2)) as group:
        group.run(_save_without_commit, directory, opts, 5, name="uncommitted", timeout_s=120)
    partial = f"{directory}/step-000000005"
    # Every rank's shards and DCP's metadata are in the bucket; only the manifest is missing.
    assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls(partial)) == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
    ]
    good = [f"{directory}/step-000000004", f"{directory}/step-000000002"]
    assert list_checkpoints(directory, opts) == good
    assert latest_good_checkpoint(directory, signing_key, opts)[0] == good[0]

    # Resumed with the key: the ranks check the signature too, reading through fsspec. The
    # checkpoints were copied from the run "signed", which this run continues.
    steps: list[int] = []
    checkpoint = SIGNED | {"signing_key_file": signing_key, "run_id": "signed"}
    more = in_bucket("partial", max_steps=8, checkpoint=checkpoint, launch={"world_size": 2})
    with caplog.at_level(logging.WARNING, logger="workers.checkpoint"):
        train(more, cluster=four_workers, on_event=_steps_into(steps))
    assert steps == [5, 6, 7, 8]  # from step 4, the newest good checkpoint
    # Not even looked at: a folder without a manifest is no checkpoint, not a damaged one.
    assert "skipping" not in caplog.text
    # The commit of step 6 found the partial step 5 older than itself, and deleted it.
    fs.invalidate_cache()  # this process listed it before
    assert not fs.exists(partial)
    assert [p.rsplit("-", 1)[-1] for p in list_checkpoints(directory, opts)] == [
        f"{step:09d}" for step in (8, 6, 4, 2)
    ]


def _rehash(fs, checkpoint: str) -> None:
    """What an attacker who can write the bucket does: make the manifest match the files."""
    manifest = _manifest(fs, checkpoint)
    content = {name: fs.cat_file(f"{checkpoint}/{name}") for name in manifest["files"]}
    manifest["files"] = {name: hashlib.sha256(data).hexdigest() for name, data in content.items()}
    manifest["sizes"] = {name: len(data) for name, data in content.items()}
    fs.pipe_file(f"{checkpoint}/{MANIFEST}", json.dumps(manifest).encode())


def test_planted_metadata_is_refused_from_the_bucket_and_a_signing_key_works_the_same(
    s3, bucket, signed_run, signing_key, tmp_path
):
    opts, fs = s3.storage_options, s3.filesystem()
    other = tmp_path / "other-key"
    other.write_bytes(b"another secret\n")
    signed = list_checkpoints(signed_run, opts)[0]
    assert verify_checkpoint(signed, signing_key, opts)["signature"].startswith("hmac-sha256:")
    with pytest.raises(CheckpointDamaged, match=r"signature does not match"):
        verify_checkpoint(signed, str(other), opts)

    root = _copy(s3, signed_run, f"{bucket}/planted")
    planted = list_checkpoints(root, opts)[0]
    marker = tmp_path / "payload-ran"
    copyreg.add_extension("os", "system", EXTENSION_CODE)
    try:
        for name, payload in _payloads(marker).items():
            fs.pipe_file(f"{planted}/.metadata", payload)
            _rehash(fs, planted)  # only the content check can catch it now
            with pytest.raises(CheckpointDamaged, match=r"\.metadata: .*refused"):
                verify_checkpoint(planted, storage_options=opts)
            # The reader DCP would load it with refuses it as well.
            with pytest.raises(CheckpointDamaged, match=r"\.metadata: .*refused"):
                safe_reader(planted, opts).read_metadata()
            assert not marker.exists(), name
            assert not hasattr(pathlib.PosixPath, BUILT_ATTRIBUTE), name
    finally:
        copyreg.remove_extension("os", "system", EXTENSION_CODE)
    # Passed over for the older one, which is intact.
    assert latest_good_checkpoint(root, storage_options=opts)[0] == f"{root}/step-000000002"
    # Rehashed, the manifest no longer carries the key's signature.
    with pytest.raises(CheckpointDamaged, match=r"signature does not match"):
        verify_checkpoint(planted, signing_key, opts)
    assert read_metadata(signed, opts).state_dict_metadata  # the real one still reads


def test_async_saves_into_the_bucket_commit_once_written_and_resume_exactly(
    four_workers, in_bucket, s3
):
    opts, fs = s3.storage_options, s3.filesystem()
    checkpoint = {"every_steps": 2, "keep": 10, "async_save": True}
    config = in_bucket("async", max_steps=6, checkpoint=checkpoint, launch={"world_size": 2})
    full = train(config, cluster=four_workers, on_event=None)
    directory = config.checkpoint.directory
    saved = list_checkpoints(directory, opts)
    # The last one too: the run waited for its write before it returned.
    assert saved == [f"{directory}/step-{step:09d}" for step in (6, 4, 2)]
    for checkpoint_url in saved:
        verify_checkpoint(checkpoint_url, storage_options=opts)
    fs.rm(saved[0], recursive=True)
    steps: list[int] = []
    resumed = train(config, cluster=four_workers, on_event=_steps_into(steps))
    assert steps == [5, 6]
    # What step 4's write held is the state at step 4, though training went on meanwhile.
    assert_same_parameters(resumed.state_dict, full.state_dict)


class _RefusedAtStep2(AsyncCheckpoints):
    """Writes as AsyncCheckpoints does, except that the store refuses rank 1's files of step
    2: an upload that fails in the background."""

    def _put(self, target, name, data):
        if "step-000000002" in str(target) and dist.get_rank() == 1:
            raise OSError("the store refused the upload (planted)")
        super()._put(target, name, data)


def _three_async_saves(directory: str, storage_options: dict) -> dict:
    """Runs on every rank: saves at steps 1, 2 (refused) and 3, then the run's end; what is
    good after each."""
    records: list[dict] = []
    writer = _RefusedAtStep2(
        directory, keep=10, storage_options=storage_options, on_failure=records.append
    )
    good = []
    for step in (1, 2, 3):
        _save_a_cnn(directory, storage_options, step, keep=10, writer=writer)
        listed = list_checkpoints(directory, storage_options)
        good.append([str(p).rsplit("-", 1)[-1] for p in listed])
    writer.finish()
    return {"good": good, "failures": writer.failures, "records": records}


@pytest.mark.parametrize("where", ["bucket", "local disk"])
def test_an_async_write_is_never_taken_before_it_is_committed_nor_after_it_failed(
    four_workers, s3, bucket, tmp_path, where
):
    opts, fs = s3.storage_options, s3.filesystem()
    directory = f"{bucket}/async-refused" if where == "bucket" else str(tmp_path / "refused")
    with ProcessGroup(four_workers.client, LaunchConfig(world_size=2)) as group:
        ranks = group.run(_three_async_saves, directory, opts, name="async", timeout_s=120)
    refused = "rank 1: OSError: the store refused the upload (planted)"
    for rank in ranks:
        # Each save returns with its own write in flight, never listed; step 2's refused
        # write leaves step 1 the newest good one.
        assert rank["good"] == [[], ["000000001"], ["000000001"]]
        (failure,) = rank["failures"]
        assert failure["step"] == 2
        assert failure["errors"] == [refused]
    # One record for the client, from rank 0, which the built-in trainer sends on.
    assert [rank["records"] for rank in ranks] == [
        [{"kind": "checkpoint_failed", "step": 2, "error": refused}],
        [],
    ]
    # Step 3 was committed at the end.
    assert [str(p).rsplit("-", 1)[-1] for p in list_checkpoints(directory, opts)] == [
        "000000003",
        "000000001",
    ]
    # and its commit deleted what step 2 had written
    if where == "bucket":
        fs.invalidate_cache()
        assert not fs.exists(f"{directory}/step-000000002")
    else:
        assert sorted(p.name for p in pathlib.Path(directory).iterdir()) == [
            "step-000000001",
            "step-000000003",
        ]


# Longer than a job stopped for good waits for a rank that writes nothing: a write in flight is
# waited for because it writes (workers.checkpoint.writing), not because it is quick.
SLOW_PUT_S = STOPPED_RANK_GRACE_S + 1.5


def _plant(method: str, planted) -> None:
    """Runs on a worker: ``AsyncCheckpoints.<method>`` becomes ``planted(original)`` until
    ``_unplant(method)``."""
    from workers.checkpoint import AsyncCheckpoints

    kept = f"_unplanted_{method}"
    original = vars(AsyncCheckpoints).get(kept, getattr(AsyncCheckpoints, method))
    setattr(AsyncCheckpoints, kept, original)
    setattr(AsyncCheckpoints, method, planted(original))


def _unplant(method: str) -> None:
    from workers.checkpoint import AsyncCheckpoints

    original = vars(AsyncCheckpoints).get(f"_unplanted_{method}")
    if original is not None:
        setattr(AsyncCheckpoints, method, original)
        delattr(AsyncCheckpoints, f"_unplanted_{method}")


def _planted_puts(step: int, how: str, flag: str = "") -> None:
    """Runs on a worker: its asynchronous writes of DCP's data files are refused on rank 1 at
    step ``step`` (``how="refused"``), held there until the file ``flag`` is gone
    (``"stuck"``), or take ``SLOW_PUT_S`` at ``step`` and every later one (``"slow"``)."""

    def planted(original):
        def put(self, target, name, data):
            at = int(re.search(r"step-(\d{9})", str(target)).group(1))
            if name.endswith(".distcp") and (at == step or (how == "slow" and at > step)):
                if how == "refused" and dist.get_rank() == 1:
                    raise OSError("the store refused the upload (planted)")
                if how == "slow":
                    time.sleep(SLOW_PUT_S)
                deadline = time.monotonic() + 60
                while how == "stuck" and os.path.exists(flag) and time.monotonic() < deadline:
                    time.sleep(0.05)
            original(self, target, name, data)

        return put

    _plant("_put", planted)


def _writing_threads() -> list[str]:
    import threading

    return [t.name for t in threading.enumerate() if t.name.startswith("checkpoint-")]


@pytest.fixture
def planted_puts(four_workers):
    """Plants ``_planted_puts`` on every worker; gone again after the test."""
    client = four_workers.client
    yield lambda *args: client.run(_planted_puts, *args)
    client.run(_unplant, "_put")


def test_a_failed_async_upload_reaches_the_client_as_a_record(
    in_bucket, four_workers, s3, planted_puts
):
    planted_puts(2, "refused")
    records: list[dict] = []
    checkpoint = {"every_steps": 2, "keep": 10}  # async_save by default
    config = in_bucket("failed", max_steps=4, checkpoint=checkpoint, launch={"world_size": 2})
    train(config, cluster=four_workers, on_event=records.append)
    (failed,) = [r for r in records if r["kind"] == "checkpoint_failed"]
    assert (failed["step"], failed["error"]) == (
        2,
        "rank 1: OSError: the store refused the upload (planted)",
    )
    directory = config.checkpoint.directory
    assert list_checkpoints(directory, s3.storage_options) == [f"{directory}/step-000000004"]


@pytest.mark.parametrize("upload", ["stuck", "slow"])
def test_a_job_stopped_mid_upload_commits_it_in_time_or_never(
    in_bucket, four_workers, s3, planted_puts, tmp_path, upload
):
    # Step 2 is committed at step 4's save, whose upload the store then holds: stuck past the
    # bound the stopped ranks wait for it (0.8 x launch.release_timeout_s), or slow (this one
    # and every later one) but within it.
    opts = s3.storage_options
    flag = tmp_path / "store-holds-uploads"
    flag.touch()
    planted_puts(4, upload, str(flag))
    release = {"stuck": 2.0, "slow": 2 * SLOW_PUT_S}[upload]
    launch = {"world_size": 2, "release_timeout_s": release}
    checkpoint = {"every_steps": 2, "keep": 100}  # async_save by default
    config = in_bucket(f"stopped-{upload}", max_steps=500, checkpoint=checkpoint, launch=launch)
    stop = threading.Event()

    def stop_after_step_5(record):
        if record["kind"] == "step" and record["step"] >= 5:
            stop.set()  # step 4's save returned: its upload is in flight

    with pytest.raises(JobStopped):
        train(config, cluster=four_workers, on_event=stop_after_step_5, stop=stop)
    flag.unlink()  # the store takes uploads again: what the stuck thread held lands now
    four_workers.client.run(_unplant, "_put")
    deadline = time.monotonic() + 10
    while any(four_workers.client.run(_writing_threads).values()):
        assert time.monotonic() < deadline, "a checkpoint thread outlived its job"
        time.sleep(0.1)
    directory = config.checkpoint.directory
    at_4, at_2 = f"{directory}/step-000000004", f"{directory}/step-000000002"
    saved = list_checkpoints(directory, opts)
    if upload == "slow":
        # The write in flight when the job stopped was committed by rank 0 alone, from the
        # ranks' notes that their files were written: no save was lost.
        newest = int(saved[0].rsplit("-", 1)[-1])
        assert newest >= 4
        assert saved == [f"{directory}/step-{s:09d}" for s in range(newest, 0, -2)]
        assert set(verify_checkpoint(saved[0], storage_options=opts)["files"]) == {
            ".metadata",
            "__0_0.distcp",
            "__1_0.distcp",
        }
        return
    # Abandoned: what reached the store has no manifest, and the resume skips it.
    assert s3.filesystem().exists(at_4.removeprefix("s3://"))
    assert saved == [at_2]
    assert latest_good_checkpoint(directory, storage_options=opts)[0] == at_2
    steps: list[int] = []
    resumed = in_bucket(f"stopped-{upload}", max_steps=4, checkpoint=checkpoint, launch=launch)
    train(resumed, cluster=four_workers, on_event=_steps_into(steps))
    assert steps == [3, 4]
    assert list_checkpoints(directory, opts) == [at_4, at_2]


def _planted_staging(step: int, flag: str, rank_0_unreachable: bool) -> None:
    """Runs on a worker: rank 1's save of ``step`` holds in its staging, in Python (where a
    stop lands), after touching ``flag``: its write never begins, while rank 0's has. And with
    ``rank_0_unreachable``, rank 0, once its save has begun that write, sleeps where no stop
    reaches it (one call into C)."""

    class Holding:
        def stage(self, tensors):
            pathlib.Path(flag).touch()
            while True:
                time.sleep(0.05)

    def planted(original):
        def save(self, tensors, *, step: int, fields):
            if step == at and dist.get_rank() == 1:
                self._writers = lambda: (type(self)._writers(self)[0], Holding())
            saved = original(self, tensors, step=step, fields=fields)
            if step == at and dist.get_rank() == 0 and rank_0_unreachable:
                time.sleep(120)
            return saved

        return save

    at = step
    _plant("save", planted)


RELEASE_BOUND_S = 40.0


@pytest.mark.parametrize(
    "rank_0_unreachable",
    [
        pytest.param(False, id="rank 0 stopped"),
        # Its write waits in the exchange all the same, for a peer that will never begin: it
        # must not count as one that may still finish (before: release_timeout_s waited out).
        pytest.param(True, id="rank 0 where no stop reaches it"),
    ],
)
def test_a_job_stopped_before_a_peer_began_its_write_abandons_it_at_once(
    in_bucket, four_workers, tmp_path, rank_0_unreachable
):
    # Seen in 1 of 50 CLI runs stopped at their first step: the stop held 12 s, rank 0 waiting
    # (0.8 x launch.release_timeout_s) for its write, whose exchange of plans waited for a
    # rank stopped before its own write began. Without the bound on that exchange: 16 s here.
    client = four_workers.client
    flag = tmp_path / "rank-1-staging"
    client.run(_planted_staging, 4, str(flag), rank_0_unreachable)
    try:
        # A write waited out holds the stop 0.8 x this bound (32 s); one abandoned, the stopped
        # rank's grace and its kill (4-8 s, whatever the bound): asserted below at half the
        # bound, far from both, rather than at a time the machine's load moves (8 s was taken
        # once, in a suite run, at 8.4 s).
        launch = {"world_size": 2, "release_timeout_s": RELEASE_BOUND_S}
        checkpoint = {"every_steps": 2, "keep": 100}  # async_save by default
        config = in_bucket("stopped-unbegun", max_steps=500, checkpoint=checkpoint, launch=launch)
        stop = threading.Event()
        stopped_at = []

        def stop_once_rank_0_writes() -> None:
            # Only then: a stop before it would pass the test without the case it is about
            # (never seen, the job fails as hung instead of stopping).
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                threads = [t for ts in client.run(_writing_threads).values() for t in ts]
                if flag.exists() and "checkpoint-step-000000004" in threads:
                    stopped_at.append(time.monotonic())
                    stop.set()
                    return
                time.sleep(0.05)

        threading.Thread(target=stop_once_rank_0_writes, daemon=True).start()
        with pytest.raises(JobStopped):
            train(config, cluster=four_workers, on_event=None, stop=stop)
        held_s = time.monotonic() - stopped_at[0]
    finally:
        client.run(_unplant, "save")
        # Workers the stop could not reach are restarted by their nannies.
        client.wait_for_workers(4, timeout=60)
    assert held_s < RELEASE_BOUND_S / 2, (
        f"the stop took {held_s:.1f} s: the unbegun write was waited out"
    )
    directory = config.checkpoint.directory
    assert list_checkpoints(directory, config.checkpoint.storage_options) == [
        f"{directory}/step-000000002"
    ]


def test_storage_options_credentials_are_never_written_into_the_run_directory(
    make_config, s3, bucket, tmp_path
):
    options = s3.storage_options | {
        "client_kwargs": {"region_name": "eu-west-3", "aws_session_token": "a-session-token"}
    }
    checkpoint = {"directory": f"{bucket}/redacted", "storage_options": options}
    config = make_config({"name": "redacted", "checkpoint": checkpoint})
    with RunDirectory.create(config, tmp_path / "run"):
        pass
    text = (tmp_path / "run" / "config.json").read_text()
    for secret in (KEY, SECRET, "a-session-token"):
        assert secret not in text
    assert json.loads(text)["checkpoint"]["storage_options"] == {
        "endpoint_url": s3.endpoint,
        "client_kwargs": {"region_name": "eu-west-3"},
    }
    # The config itself keeps them: it travels to the workers whole.
    assert config.checkpoint.storage_options == options
    message = refusal({"checkpoint": {"storage_options": "endpoint"}}, base={"checkpoint": {}})
    assert message.startswith("checkpoint.storage_options: a table of fsspec options")


@pytest.mark.skipif(sys.platform != "linux", reason="a thread's own niceness is Linux's")
def test_the_writer_thread_yields_the_cores_to_training_and_only_itself():
    from workers.checkpoint import MAX_NICENESS, WRITER_NICENESS, _yield_to_training

    before = os.getpriority(os.PRIO_PROCESS, 0)
    seen = {}

    def writer() -> None:
        _yield_to_training()
        seen["writer"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    thread = threading.Thread(target=writer)
    thread.start()
    thread.join(timeout=10)
    assert seen["writer"] == min(before + WRITER_NICENESS, MAX_NICENESS)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before  # training's
