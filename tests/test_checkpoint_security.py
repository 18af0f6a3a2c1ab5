"""Checkpoints that someone planted or altered: pickle payloads in DCP's metadata, non-tensor
items DCP would unpickle freely, and (with a signing key) rehashed manifests. Every payload is
shown to work against an unrestricted loader first, so a refusal here is a real one."""

import copyreg
import json
import math
import pathlib
import pickle
import shutil
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from workers.checkpoint import (
    MANIFEST,
    CheckpointDamaged,
    _sha256,
    latest_good_checkpoint,
    list_checkpoints,
    tensors_only_planner,
    verify_checkpoint,
)
from workflows.runs.driver import train
from workflows.runs.run_directory import RunDirectory

BASE = {"lr": 0.1, "momentum": 0.9, "batch_size": 64, "seed": 5, "epochs": 1}


@pytest.fixture(scope="module")
def trained(cluster, make_config, tmp_path_factory):
    """One real checkpoint, written by a real run; each test plants into its own copy."""
    directory = tmp_path_factory.mktemp("trained")
    config = make_config({"name": "secure", "checkpoint": {"directory": str(directory)}}, **BASE)
    train(config, cluster=cluster, on_event=None)
    (checkpoint,) = list_checkpoints(directory)
    return checkpoint


@pytest.fixture
def copy_of(trained, tmp_path):
    def copy(name: str = "run") -> pathlib.Path:
        target = tmp_path / name / trained.name
        shutil.copytree(trained, target)
        return target

    return copy


def _rehash(checkpoint: pathlib.Path) -> None:
    """What an attacker who can write the folder does: make the manifest match the files."""
    manifest = json.loads((checkpoint / MANIFEST).read_text())
    files = [p for p in sorted(checkpoint.iterdir()) if p.name != MANIFEST]
    manifest["files"] = {p.name: _sha256(p) for p in files}
    manifest["sizes"] = {p.name: p.stat().st_size for p in files}
    (checkpoint / MANIFEST).write_text(json.dumps(manifest))


# -- hand-assembled pickles (protocol 4) ------------------------------------------------------


def _s(text: str) -> bytes:
    data = text.encode()
    return pickle.SHORT_BINUNICODE + bytes([len(data)]) + data


def _stack_global(module: str, name: str) -> bytes:
    return _s(module) + _s(name) + pickle.STACK_GLOBAL


def _args(*values: str) -> bytes:
    return pickle.MARK + b"".join(_s(v) for v in values) + pickle.TUPLE


def _pickle(body: bytes) -> bytes:
    return pickle.PROTO + b"\x04" + body + pickle.STOP


BUILT_ATTRIBUTE = "set_by_a_payload"
EXTENSION_CODE = 0xF1  # a private copyreg extension code, registered for one test only


def _payloads(marker: pathlib.Path) -> dict[str, bytes]:
    """Each, unpickled freely, creates ``marker``."""
    touch = f"touch {marker}"
    return {
        # The classic: a global that runs a command.
        "os.system": _pickle(_stack_global("os", "system") + _args(touch) + pickle.REDUCE),
        # Attribute chains from an allowed module: protocol 4 resolves dotted names.
        "chain to a type": _pickle(
            _stack_global("torch.distributed.checkpoint.filesystem", "io.FileIO")
            + _args(str(marker), "w")
            + pickle.REDUCE
        ),
        "chain to a function": _pickle(
            _stack_global("torch.distributed.checkpoint.filesystem", "os.system")
            + _args(touch)
            + pickle.REDUCE
        ),
        # A builtin reached through an allowed class.
        "builtin through an allowed class": _pickle(
            _stack_global("pathlib", "Path.touch")
            + pickle.MARK
            + _stack_global("pathlib", "Path")
            + _args(str(marker))
            + pickle.REDUCE
            + pickle.TUPLE
            + pickle.REDUCE
        ),
        # Protocol 0/1 instantiation: INST and OBJ look the callable up themselves.
        "INST": pickle.PROTO + b"\x02" + pickle.MARK + _s(touch) + b"ios\nsystem\n" + pickle.STOP,
        "OBJ": pickle.PROTO
        + b"\x02"
        + pickle.MARK
        + _stack_global("os", "system")
        + _s(touch)
        + pickle.OBJ
        + pickle.STOP,
        # NEWOBJ makes an object without running __init__; the payload then runs it.
        "NEWOBJ": _pickle(
            _stack_global("torch.distributed.checkpoint.filesystem", "io.FileIO.__init__")
            + pickle.MARK
            + _stack_global("torch.distributed.checkpoint.filesystem", "io.FileIO")
            + pickle.EMPTY_TUPLE
            + pickle.NEWOBJ
            + _s(str(marker))
            + _s("w")
            + pickle.TUPLE
            + pickle.REDUCE
        ),
        # copyreg's extension registry names a global by number (registered by the test).
        "copyreg extension": _pickle(
            pickle.EXT1 + bytes([EXTENSION_CODE]) + _args(touch) + pickle.REDUCE
        ),
        # BUILD on an allowed class itself (not an instance) sets class attributes, which
        # could replace a method every later caller runs; here, a harmless marker attribute.
        "BUILD on a class": _pickle(
            _stack_global("pathlib", "PosixPath")
            + pickle.NONE
            + pickle.EMPTY_DICT
            + _s(BUILT_ATTRIBUTE)
            + pickle.NEWTRUE
            + pickle.SETITEM
            + pickle.TUPLE2
            + pickle.BUILD
        ),
    }


@pytest.fixture
def extension():
    copyreg.add_extension("os", "system", EXTENSION_CODE)
    yield
    copyreg.remove_extension("os", "system", EXTENSION_CODE)


@pytest.mark.parametrize(
    "name",
    [
        "os.system",
        "chain to a type",
        "chain to a function",
        "builtin through an allowed class",
        "INST",
        "OBJ",
        "NEWOBJ",
        "copyreg extension",
        "BUILD on a class",
    ],
)
def test_a_planted_metadata_payload_is_refused_unrun(copy_of, tmp_path, extension, name):
    potent = tmp_path / "potent"
    if name == "BUILD on a class":
        try:
            pickle.loads(_payloads(potent)[name])
            assert getattr(pathlib.PosixPath, BUILT_ATTRIBUTE) is True
        finally:
            delattr(pathlib.PosixPath, BUILT_ATTRIBUTE)
    else:
        pickle.loads(_payloads(potent)[name])
        assert potent.exists(), "the payload does nothing even unrestricted"

    checkpoint = copy_of()
    marker = tmp_path / "payload-ran"
    (checkpoint / ".metadata").write_bytes(_payloads(marker)[name])
    _rehash(checkpoint)  # only the content check can catch it now
    with pytest.raises(CheckpointDamaged, match=r"\.metadata: .*refused"):
        verify_checkpoint(checkpoint)
    assert latest_good_checkpoint(checkpoint.parent) is None
    assert not marker.exists()
    assert not hasattr(pathlib.PosixPath, BUILT_ATTRIBUTE)


def _plant_bytes_item(checkpoint: pathlib.Path, marker: pathlib.Path, scratch: pathlib.Path):
    """Rewrite the checkpoint with DCP itself, its "progress" item an object whose unpickling
    creates ``marker``: metadata made only of DCP's classes, plus a BytesStorageMetadata."""

    class Payload:
        def __reduce__(self):
            return (__import__("os").system, (f"touch {marker}",))

    scratch.mkdir()
    dcp_to_torch_save(checkpoint, scratch / "plain.pt")
    state = torch.load(scratch / "plain.pt", weights_only=True)
    state["progress"] = Payload()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP's note that it saves in one process
        dcp.save(state, checkpoint_id=scratch / "planted")
    for old in checkpoint.iterdir():
        if old.name != MANIFEST:
            old.unlink()
    for new in (scratch / "planted").iterdir():
        shutil.copy(new, checkpoint / new.name)
    _rehash(checkpoint)


def test_a_planted_non_tensor_item_is_refused_and_never_unpickled(copy_of, tmp_path):
    potent, marker = tmp_path / "potent", tmp_path / "payload-ran"
    checkpoint = copy_of()
    _plant_bytes_item(checkpoint, potent, tmp_path / "scratch-potent")
    # DCP's own loader runs it: the metadata alone is no defence.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load({"progress": torch.zeros(3, dtype=torch.int64)}, checkpoint_id=checkpoint)
    assert potent.exists(), "DCP did not unpickle the planted item"

    planted = copy_of("planted")
    _plant_bytes_item(planted, marker, tmp_path / "scratch")
    with pytest.raises(CheckpointDamaged, match=r"BytesStorageMetadata, refused"):
        verify_checkpoint(planted)
    # The load planner refuses the bytes path too, should metadata ever admit one.
    # DCP wraps what a rank raised in a CheckpointException, a BaseException.
    refused = pytest.raises(CheckpointException, match=r"'progress' is not a tensor; refused unr")
    with refused, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(
            {"progress": torch.zeros(3, dtype=torch.int64)},
            storage_reader=dcp.FileSystemReader(planted),
            planner=tensors_only_planner(),
        )
    assert not marker.exists()


def test_a_run_pointed_at_a_planted_folder_starts_afresh_and_runs_nothing(
    cluster, make_config, copy_of, tmp_path
):
    checkpoint = copy_of()
    marker = tmp_path / "payload-ran"
    _plant_bytes_item(checkpoint, marker, tmp_path / "scratch")
    config = make_config(
        {"name": "planted", "checkpoint": {"directory": str(checkpoint.parent)}}, **BASE
    )
    result = train(config, cluster=cluster, on_event=None)
    assert result.history[-1]["epoch"] == 1 and not result.recoveries
    # Afresh: the planted checkpoint is an epoch's end, so a run that loaded it would train no
    # step, and have no first step (nan); one that skipped it trains the epoch.
    assert math.isfinite(result.first_step_s) and result.samples_per_s > 0
    assert not marker.exists()


def test_with_a_signing_key_an_unsigned_rehashed_or_foreign_checkpoint_is_refused(
    cluster, make_config, copy_of, tmp_path
):
    key, other = tmp_path / "key", tmp_path / "other-key"
    key.write_bytes(b"a secret only the trainer knows\n")
    other.write_bytes(b"another secret\n")
    unsigned = copy_of("unsigned")
    assert verify_checkpoint(unsigned)["step"] > 0
    with pytest.raises(CheckpointDamaged, match=r"is not signed, and checkpoint\.signing_key"):
        verify_checkpoint(unsigned, str(key))

    directory = tmp_path / "signed"
    signed_config = make_config(
        {
            "name": "signed",
            "checkpoint": {"directory": str(directory), "signing_key_file": str(key)},
        },
        **BASE,
    )
    train(signed_config, cluster=cluster, on_event=None)
    (signed,) = list_checkpoints(directory)
    manifest = verify_checkpoint(signed, str(key))
    assert manifest["signature"].startswith("hmac-sha256:")
    with pytest.raises(CheckpointDamaged, match=r"signature does not match"):
        verify_checkpoint(signed, str(other))

    # A resumed run's ranks check the signature too, and continue from it: its first step is
    # the one after the checkpoint's, and epoch 1's record came from the checkpoint (a run
    # started afresh would train and report epoch 1 again; its history reads the same).
    events: list[dict] = []
    resumed = train(
        make_config(
            {
                "name": "signed",
                "checkpoint": {"directory": str(directory), "signing_key_file": str(key)},
            },
            **(BASE | {"epochs": 2, "log_every_steps": 1}),
        ),
        cluster=cluster,
        on_event=events.append,
    )
    assert [r["epoch"] for r in resumed.history] == [1, 2]
    steps = [e["step"] for e in events if e["kind"] == "step"]
    assert steps[0] == manifest["step"] + 1, steps[:3]
    assert [e["epoch"] for e in events if e["kind"] == "epoch"] == [2]

    # Someone who can write the folder alters the parameters and the history, then rehashes:
    # the hashes alone accept it, the signature does not.
    newest = list_checkpoints(directory)[0]
    data = max(
        (p for p in newest.iterdir() if p.suffix == ".distcp"), key=lambda p: p.stat().st_size
    )
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    data.write_bytes(bytes(raw))
    manifest = json.loads((newest / MANIFEST).read_text())
    manifest["history"][0]["val_accuracy"] = 1.0
    (newest / MANIFEST).write_text(json.dumps(manifest))
    _rehash(newest)
    assert verify_checkpoint(newest)["history"][0]["val_accuracy"] == 1.0
    with pytest.raises(CheckpointDamaged, match=r"signature does not match"):
        verify_checkpoint(newest, str(key))
    found, _ = latest_good_checkpoint(directory, str(key))
    assert found != newest


# -- runs that share a folder -------------------------------------------------------------------


def _another_runs(trained: pathlib.Path, directory: pathlib.Path, steps: list[int]) -> dict:
    """Real checkpoints of a run called "earlier" at ``steps`` in ``directory``, as a long run
    leaves them: name -> their files' bytes."""
    left = {}
    for step in steps:
        target = directory / f"step-{step:09d}"
        shutil.copytree(trained, target)
        manifest = json.loads((target / MANIFEST).read_text())
        (target / MANIFEST).write_text(json.dumps(manifest | {"step": step, "run": "earlier"}))
        left[target.name] = {p.name: p.read_bytes() for p in target.iterdir()}
    return left


def test_another_runs_checkpoints_in_the_folder_are_never_resumed_from_nor_deleted(
    cluster, make_config, trained, tmp_path
):
    # Before, a new run resumed from the other run's step 1000, and retention, sorting by step,
    # deleted the new run's own checkpoint as soon as it was committed; the other run's step 10
    # would have been replaced by the new run's.
    directory = tmp_path / "shared"
    theirs = _another_runs(trained, directory, [1000, 900, 800, 10])
    events: list[dict] = []
    config = make_config(
        {"name": "new", "checkpoint": {"directory": str(directory), "keep": 1}},
        **(BASE | {"max_steps": 10, "log_every_steps": 1}),
    )
    train(config, cluster=cluster, on_event=events.append)
    assert [e["step"] for e in events if e["kind"] == "step"] == list(range(1, 11))  # afresh
    mine = directory / "step-000000010.new"  # step-000000010 is the other run's
    assert verify_checkpoint(mine, run_id="new")["step"] == 10
    assert sorted(p.name for p in directory.iterdir()) == sorted([mine.name, *theirs])
    for name, files in theirs.items():  # untouched, byte for byte
        assert {p.name: p.read_bytes() for p in (directory / name).iterdir()} == files
    with pytest.raises(CheckpointDamaged, match=r"of run 'earlier', not 'new'"):
        verify_checkpoint(directory / "step-000001000", run_id="new")

    # The same run started again continues from its own step 10, not from step 1000, and then
    # deletes its own step 10 only (keep = 1).
    events.clear()
    more = make_config(
        {"name": "new", "checkpoint": {"directory": str(directory), "keep": 1}},
        **(BASE | {"max_steps": 12, "log_every_steps": 1}),
    )
    # What the CLI says it continues from ("training starts from step N") is the same choice.
    assert RunDirectory(tmp_path / "run", more).resumes_from == 10
    train(more, cluster=cluster, on_event=events.append)
    assert [e["step"] for e in events if e["kind"] == "step"] == [11, 12]
    assert latest_good_checkpoint(directory, run_id="new")[0] == directory / "step-000000012"
    assert sorted(p.name for p in directory.iterdir()) == sorted(["step-000000012", *theirs])
