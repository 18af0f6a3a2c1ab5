"""Checkpoints of the whole training state with ``torch.distributed.checkpoint`` (DCP).

A checkpoint is a directory ``step-<n>`` under the run's checkpoint folder, on local disk or on
any filesystem fsspec reaches (``s3://bucket/ckpt``, ``gs://``, ``abfs://``; its options in
``checkpoint.storage_options``):

  step-000000120/
    .metadata, __<rank>_0.distcp   DCP's files: every rank writes its own part (a pipeline
                                    stage, an FSDP shard; replicated tensors once)
    manifest.json                  progress, history and the SHA-256 of every file, written last

Every rank hashes each file as it writes it (SHA-256 and size, from the bytes on their way
out: nothing is read back). On local disk every rank writes into ``.step-<n>.partial``; once
all have finished, rank 0 checks that the folder lists what the ranks wrote, at the sizes they
wrote, writes the manifest and renames the folder, so a checkpoint is visible only when
complete. An object store has no rename (S3's is a copy of every byte), so there every rank
writes straight into ``step-<n>/`` and the manifest is the commit marker: rank 0 writes it last,
after the same check of the store's listing. A folder without one (a writer killed mid-upload)
is never listed, and the next commit deletes it once a newer good one exists.
With ``checkpoint.async_save`` (:class:`AsyncCheckpoints`, the default) a save returns once each
rank's part is copied into CPU buffers kept for the purpose; a thread serializes and writes it,
and the manifest follows as soon as every rank's files are written. A job stopped
meanwhile (Ctrl-C, SIGTERM, the launcher's stop) waits for the write within
``launch.release_timeout_s`` and commits it, or abandons it without a manifest (at once where a
peer was stopped before its own write began: the write cannot finish).

Loading verifies every file against the manifest, on local disk and on an object store alike:
its size, then its SHA-256 (each file is read whole once more for it: by the client choosing
it, and by the ranks loading it, each a share). A damaged checkpoint
(missing manifest, a file whose size or hash differs) is skipped. DCP's
``.metadata`` is a pickle, which ``torch.distributed.checkpoint`` would load with plain
``pickle.load``: here it is read (from disk or through fsspec alike) with an unpickler that
admits only DCP's own metadata classes, so a planted payload never runs; and items that are not
tensors, which DCP would unpickle freely, are refused.

Each manifest names the run that wrote it (``run``: ``checkpoint.run_id``, else the run's name;
see ``run_id`` below): a run resumes only from its own checkpoints and deletes only its own
beyond ``keep``, and never replaces another run's checkpoint of the same step (where
``step-<n>`` holds one, its own is ``step-<n>.<run>``), so runs that share a folder leave each
other's alone. A checkpoint without a run (written before runs were
recorded) is no run's: never resumed, never deleted.

The hashes catch accidental damage only: whoever can write the folder can rewrite them. With
``checkpoint.signing_key_file`` the manifest also carries an HMAC-SHA256 of its content, and a
checkpoint without the right one is refused.
"""

import collections
import contextlib
import dataclasses
import functools
import hashlib
import hmac
import io
import json
import logging
import os
import pathlib
import pickle
import shutil
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import torch
import torch.distributed as dist
from torch import nn

from workers.compat.cpython_private import PurePythonUnpickler
from workers.records import CheckpointFailedRecord

# torch.distributed.checkpoint is imported where it is used: it costs ~0.7 s, and the client
# imports this module to find the checkpoint a run continues from, which needs none of it.
# fsspec too (~60 ms), which only a URL needs.
# Re-exported: the section's model lives in a torch-free module, for config checks.
from workers.spec.sections import CheckpointConfig as CheckpointConfig

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"
SIGNATURE = "signature"
PREFIX = "step-"
METADATA = ".metadata"

# A checkpoint or a folder of them: a local path, or a URL as the user wrote it.
Location = Path | str
# What ranks wrote: each file's name -> (SHA-256, bytes), hashed as it was written.
Written = dict[str, tuple[str, int]]
StorageOptions = Mapping[str, Any] | None


class CheckpointDamaged(ValueError):
    """A checkpoint that must not be loaded: incomplete, altered, or carrying foreign code."""


@dataclass(frozen=True)
class _Remote:
    """A folder on a filesystem other than local disk, reached through fsspec."""

    fs: Any  # fsspec.AbstractFileSystem
    path: str  # as the filesystem names it (no protocol)
    url: str  # as the user wrote it: what is handed back, and what DCP's fsspec classes take

    def child(self, name: str) -> "_Remote":
        return _Remote(self.fs, f"{self.path}/{name}", f"{self.url}/{name}")


def _where(location: str | os.PathLike[str], storage_options: StorageOptions) -> Path | _Remote:
    """A local folder as a Path (``file://`` URLs included: local disk keeps its renames),
    anything else fsspec names as its filesystem and path."""
    if isinstance(location, os.PathLike) or ("://" not in location and "::" not in location):
        return Path(location)
    from fsspec.core import url_to_fs
    from fsspec.implementations.local import LocalFileSystem

    fs, path = url_to_fs(location, **dict(storage_options or {}))
    if isinstance(fs, LocalFileSystem):
        return Path(path)
    return _Remote(fs, path.rstrip("/"), location.rstrip("/"))


def local_path(location: str | os.PathLike[str], storage_options: StorageOptions) -> Path | None:
    """``location`` as a local path (a ``file://`` URL's too), or None where it is a URL of
    another filesystem (s3://, gs://, memory://)."""
    where = _where(location, storage_options)
    return where if isinstance(where, Path) else None


def _label(where: Path | _Remote) -> str:
    """``where`` for messages: the path, or the URL as written."""
    return str(where) if isinstance(where, Path) else where.url


def _name(where: Path | _Remote, name: str) -> str:
    """``name`` inside ``where``, for messages."""
    return f"{_label(where)}/{name}"


@dataclass
class Progress:
    """Where training stands: enough to continue exactly where it stopped."""

    epoch: int = 0  # the epoch in progress (0-based)
    batch: int = 0  # the next batch of that epoch
    step: int = 0  # optimizer steps taken
    # Loss, the task's metric sums, samples (workers/strategies/base.py EpochSums); []: none.
    sums: list[float] = field(default_factory=list)
    history: list[dict[str, float]] = field(default_factory=list)


@dataclass
class CheckpointState:
    """What a checkpoint holds besides the progress: this rank's part of the training state."""

    modules: list[nn.Module]
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler


@dataclass(frozen=True)
class CheckpointDestination:
    """Where a run's checkpoints go and how they are kept: the folder (a local path or an
    fsspec URL, ``storage_options`` its filesystem's), how many of the run's are kept, the key
    that signs their manifests, and the run they are of (see :func:`write_checkpoint`)."""

    directory: str | Path
    keep: int
    signing_key_file: str | None = None
    storage_options: StorageOptions = None
    run_id: str | None = None

    @classmethod
    def of(cls, config: CheckpointConfig, *, run_id: str | None) -> "CheckpointDestination":
        """The destination ``config`` names, for run ``run_id``."""
        assert config.directory is not None
        return cls(
            config.directory,
            keep=config.keep,
            signing_key_file=config.signing_key_file,
            storage_options=config.storage_options,
            run_id=run_id,
        )


def _state(
    modules: list[nn.Module], optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler
) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optimizer_state = get_state_dict(_whole(modules), optimizer)
    # Only the optimizer's tensors (momentum buffers): its hyperparameters come from the config
    # and the LR schedule, and DCP writes non-tensor entries from rank 0 alone, which would
    # lose the other pipeline stages' parameter groups.
    state = {"model": model_state, "optim": {"state": optimizer_state["state"]}}
    if scaler.is_enabled():
        state["scaler"] = {k: torch.tensor(v) for k, v in scaler.state_dict().items()}
    return state


def save_checkpoint(
    destination: CheckpointDestination,
    state: CheckpointState,
    *,
    progress: Progress,
    commit: bool = True,
    writer: "AsyncCheckpoints | None" = None,
) -> Location | None:
    """Write this rank's part of the built-in trainer's checkpoint; every rank of the default
    group must call it.

    Returns the committed folder on rank 0. ``commit=False`` stops after writing, the state a
    crash between write and commit leaves behind. With ``writer`` (``checkpoint.async_save``)
    it returns once the state is serialized, and the writer commits it later (the
    destination is the writer's then).
    """
    rank = dist.get_rank()
    tensors = _state(state.modules, state.optimizer, state.scaler)
    tensors["progress"] = torch.tensor([progress.epoch, progress.batch, progress.step])
    # Each rank's own running sums of the epoch in progress, and its RNG.
    tensors[f"sums.rank{rank}"] = torch.tensor(progress.sums, dtype=torch.float64)
    tensors[f"rng.rank{rank}"] = torch.get_rng_state()
    fields = {"epoch": progress.epoch, "batch": progress.batch, "history": progress.history}
    if writer is not None:
        writer.save(tensors, step=progress.step, fields=fields)
        return None
    return write_checkpoint(destination, tensors, step=progress.step, fields=fields, commit=commit)


def write_checkpoint(
    destination: CheckpointDestination,
    tensors: dict[str, Any],
    *,
    step: int,
    fields: dict[str, Any],
    commit: bool = True,
) -> Location | None:
    """The one way a checkpoint is written (collective): each rank's ``tensors`` through DCP,
    then rank 0 adds the manifest (``fields`` plus the hash of every file, signed with the key
    in ``signing_key_file`` if given), so it is visible only when complete: on local disk by
    renaming ``.step-<n>.partial`` into place, on an object store by writing the manifest last
    into ``step-<n>/`` (no rename). ``storage_options``: the fsspec filesystem's, for a URL.

    ``run_id``: the run the checkpoint is of, in its manifest; retention deletes only that
    run's checkpoints beyond ``keep``, and a committed checkpoint of this step by another run
    is never replaced (this one is ``step-<n>.<run_id>`` then). None: every checkpoint in the
    folder counts as this run's (as before runs were recorded)."""
    run_id = destination.run_id
    where = _where(destination.directory, destination.storage_options)
    # Rank 0 chooses the folder and clears what a write of it left; every rank writes there.
    name = _decided(lambda: _prepared(where, step, run_id))
    fields = {**fields, "run": run_id}
    import torch.distributed.checkpoint as dcp

    from workers.compat.torch_private import hash_as_written

    if isinstance(where, _Remote):
        target: Path | _Remote = where.child(name)  # emptied by _prepared
        writer = _fsspec_writer(target.url, destination.storage_options)
    else:
        target = where / f".{name}.partial"
        writer = dcp.FileSystemWriter(target)
    written = hash_as_written(writer)
    dcp.save(tensors, storage_writer=writer)
    files = _gathered(written)  # every rank's files are written (uploaded)
    if not commit:
        dist.barrier()
        return None

    def committed() -> Location:
        manifest = _manifest(step, fields, _checked(target, files), destination.signing_key_file)
        if isinstance(where, _Remote):
            assert isinstance(target, _Remote)
            return _commit_remote(where, target, manifest, destination.keep, run_id)
        return _commit_local(where, name, manifest, destination.keep, run_id)

    return _agreed(committed)


def _gathered(written: Written) -> Written | None:
    """What every rank wrote, on rank 0 (None on the others): collective."""
    rank, world = dist.get_rank(), dist.get_world_size()
    parts: list[Any] | None = [None] * world if rank == 0 else None
    dist.gather_object(written, parts, dst=0)
    if parts is None:
        return None
    return dict(sorted(item for part in parts for item in part.items()))


def _folder_name(root: Path | _Remote, step: int, run_id: str | None) -> str:
    """``step-<n>``, unless that holds another run's committed checkpoint: then
    ``step-<n>.<run_id>``, so that two runs' checkpoints of one step never share a folder."""
    name = f"{PREFIX}{step:09d}"
    final = root.child(name) if isinstance(root, _Remote) else root / name
    if run_id is None or MANIFEST not in _file_names_if_any(final) or _run_of(final) == run_id:
        return name
    return f"{name}.{run_id}"


def _decided(decide: Callable[[], Any], *, failed: str = "not written") -> Any:
    """What ``decide()`` returns on rank 0, on every rank (collective): where it failed, every
    rank raises CheckpointDamaged (``failed``: what the message begins with), none waits for
    the others' timeout."""
    box: list[Any] = [None, None]
    if dist.get_rank() == 0:
        try:
            box = [decide(), None]
        except (CheckpointDamaged, OSError) as error:  # OSError: the store's, or the disk's
            box = [None, str(error) if isinstance(error, CheckpointDamaged) else repr(error)]
    dist.broadcast_object_list(box, src=0)
    if box[1] is not None:
        raise CheckpointDamaged(f"{failed}: {box[1]}")
    return box[0]


def _agreed(commit: Callable[[], Location]) -> Location | None:
    """Rank 0 commits, the others learn how it went (:func:`_decided`); the committed folder
    on rank 0. No rank starts the next save (which may clear this folder) before it is."""
    committed = _decided(commit, failed="not committed")
    return committed if dist.get_rank() == 0 else None


def _checked(where: Path | _Remote, files: Written | None) -> Written:
    """``files``, once the folder lists exactly them at the sizes the ranks wrote, and DCP's
    metadata refers to none other (one listing and the small .metadata: no file read back)."""
    assert files is not None  # rank 0's
    listed = _sizes(where)
    wrote = {name: size for name, (_, size) in files.items()}
    if listed != wrote:
        differ = sorted(set(listed.items()) ^ set(wrote.items()))
        raise CheckpointDamaged(
            f"{_label(where)}: holds {sorted(listed.items())}, the ranks wrote "
            f"{sorted(wrote.items())} (differing: {differ})"
        )
    referred = {i.relative_path for i in _metadata_of(where).storage_data.values()}
    missing = sorted(referred - set(listed))
    if missing:
        raise CheckpointDamaged(f"{_label(where)}: DCP's metadata refers to absent {missing}")
    return files


def _commit_local(root: Path, name: str, manifest: bytes, keep: int, run_id: str | None) -> Path:
    """Rank 0: the manifest into ``.<name>.partial``, then the folder renamed into place."""
    partial = root / f".{name}.partial"
    final = root / name
    _refuse_another_runs(final, run_id)  # it may have come since the write began
    _write_durably(partial / MANIFEST, manifest)
    shutil.rmtree(final, ignore_errors=True)  # a stale one of this run, from before a restart
    os.rename(partial, final)
    for old in _own(list_checkpoints(root), None, run_id)[keep:]:
        shutil.rmtree(old, ignore_errors=True)
    # What failed or abandoned writes of earlier steps left (one write is in flight at most,
    # and it is this one): never taken, and never finished now.
    for left in root.glob(f".{PREFIX}*.partial"):
        if left.name.removeprefix(".").removesuffix(".partial") < name:
            shutil.rmtree(left, ignore_errors=True)
    return final


def _commit_remote(
    root: _Remote, folder: _Remote, manifest: bytes, keep: int, run_id: str | None
) -> str:
    """Rank 0: the manifest into ``folder`` (the commit), then the old and partial ones gone."""
    # One PUT, which a store makes visible whole or not at all: the commit.
    folder.fs.pipe_file(f"{folder.path}/{MANIFEST}", manifest)
    try:
        _retain(root, keep, run_id)
    except OSError as error:
        # Housekeeping only: the checkpoint is committed, and the next commit tries again.
        logger.warning("%s: could not delete old checkpoints (%s)", root.url, error)
    return folder.url


def _manifest(
    step: int,
    fields: dict[str, Any],
    files: Written,
    signing_key_file: str | None,
    world_size: int | None = None,
) -> bytes:
    manifest = {
        "step": step,
        **fields,
        "world_size": dist.get_world_size() if world_size is None else world_size,
        "written_at": time.time(),
        # Each file's SHA-256 and bytes, as the ranks wrote them.
        "files": {name: digest for name, (digest, _) in files.items()},
        "sizes": {name: size for name, (_, size) in files.items()},
    }
    if signing_key_file is not None:
        manifest[SIGNATURE] = _signature(manifest, _read_key(signing_key_file))
    return json.dumps(manifest, indent=1).encode()


def _step_folders(root: _Remote) -> dict[str, set[str]]:
    """The step folders under ``root`` and the names of their files, in one listing."""
    root.fs.invalidate_cache(root.path)  # other processes wrote here since this one looked
    try:
        found = root.fs.find(root.path)
    except FileNotFoundError:
        return {}
    folders: dict[str, set[str]] = {}
    prefix = root.path + "/"
    for path in found:
        folder, _, rest = path.removeprefix(prefix).partition("/")
        if path.startswith(prefix) and folder.startswith(PREFIX) and rest:
            folders.setdefault(folder, set()).add(rest)
    return folders


def _retain(root: _Remote, keep: int, run_id: str | None) -> None:
    """Delete the run's good checkpoints beyond its newest ``keep``, and every partial one (no
    manifest) older than its newest good one: the writes that were interrupted."""
    folders = _step_folders(root)
    committed = sorted((n for n, files in folders.items() if MANIFEST in files), reverse=True)
    good = _own(committed, root, run_id)
    doomed = good[keep:]
    if good:
        doomed += [n for n, files in folders.items() if MANIFEST not in files and n < good[0]]
    for name in sorted(doomed):
        _remove(root.child(name))


def _remove(folder: _Remote) -> None:
    # The manifest first: a reader meanwhile sees an uncommitted folder, never a manifest
    # whose files are half gone.
    with contextlib.suppress(FileNotFoundError):
        folder.fs.rm_file(f"{folder.path}/{MANIFEST}")
    folder.fs.invalidate_cache(folder.path)  # other processes' files are to go too
    with contextlib.suppress(FileNotFoundError):
        folder.fs.rm(folder.path, recursive=True)
    folder.fs.invalidate_cache(folder.path)


def _fsspec_writer(url: str, storage_options: StorageOptions) -> Any:
    from workers.compat.torch_private import FSSPEC_WRITER

    # No fsync: an object is durable once its upload completes, and its stream has no file
    # descriptor (DCP would warn about it for every file).
    return FSSPEC_WRITER(url, sync_files=False, **dict(storage_options or {}))


# -- checkpoints that do not stop training --------------------------------------------------

STAGING = "memory://dask-train-staging"  # fsspec's memory filesystem: this process's RAM
# A rank stopped with its write in flight waits for it this share of launch.release_timeout_s
# at most: the launcher's own wait for the rank to let go starts about when the stop lands,
# and a rank still busy after it has its worker restarted.
STOP_WAIT_SHARE = 0.8
WRITTEN = ".written-rank"  # + <rank>: a rank's files are written (their hashes and sizes)
JOIN_POLL_S = 0.1  # waits in slices: the launcher's stop lands between them
# A stopped rank waits this long for its write's exchange of plans, which takes milliseconds
# once every rank's thread has begun: one still before it waits for a peer stopped before its
# own thread began, which never will (seen: a stopped CLI run held 12 s, 0.8 of
# launch.release_timeout_s, by such a write).
EXCHANGE_WAIT_S = 2.0
# Rank 0's thread waits for the other ranks' notes at least this long, or as long again as its
# own write took (they started together), before it leaves the commit to the next save.
EAGER_WAIT_S = 5.0
# The writers' own process group bounds its collectives by this: DCP's two short exchanges (the
# plans, then the metadata) around each rank's serialization into memory take milliseconds; a
# thread whose peer hung gives up after it instead of the 30 minutes of a group's default.
WRITER_GROUP_TIMEOUT_S = 300.0


# Asynchronous writes this process is carrying through now: a writer thread's past its exchange
# of plans, and a stopped rank's wait to commit or abandon its write in flight (``interrupted``).
# A job stopped for good waits for a stopped rank only while it writes
# (workers/process_group.py: release_generation).
_carrying_lock = threading.Lock()
_carrying = 0


@contextlib.contextmanager
def _carrying_a_write() -> Iterator[None]:
    global _carrying
    with _carrying_lock:
        _carrying += 1
    try:
        yield
    finally:
        with _carrying_lock:
            _carrying -= 1


def writing() -> bool:
    """Whether this process is writing a checkpoint that may still be committed: a writer
    thread past its exchange of plans (every rank's write began), or a stopped rank committing
    or abandoning its write in flight. A synchronous save does not count: once a stopped rank's
    connections are shut down its collectives cannot complete, so neither can the save."""
    return _carrying > 0


# How much nicer than the training's threads the writer thread runs: where they want the same
# cores, the training's run first, and the write takes the time they leave (it has until the
# next save).
WRITER_NICENESS = 10
MAX_NICENESS = 19  # Linux's lowest priority


def _yield_to_training() -> None:
    """Lower this thread's scheduling priority by ``WRITER_NICENESS``: on Linux a thread is a
    task of its own, whose niceness no other thread shares (elsewhere it would be the whole
    process's: left alone)."""
    if sys.platform != "linux":
        return
    thread = threading.get_native_id()
    with contextlib.suppress(OSError):  # a container that forbids it: the write goes on as is
        nice = os.getpriority(os.PRIO_PROCESS, thread)
        os.setpriority(os.PRIO_PROCESS, thread, min(nice + WRITER_NICENESS, MAX_NICENESS))


@dataclass
class _Write:
    """One checkpoint being written by a rank's thread."""

    step: int
    name: str  # step-<n>
    fields: dict[str, Any]
    target: Path | _Remote  # .step-<n>.partial on local disk, step-<n>/ on a store
    staged: dict[str, Any]  # the rank's state, copied into the writer's buffers
    staging: str  # where the thread serializes it first: a folder of fsspec's memory filesystem
    rank: int
    world_size: int
    thread: threading.Thread | None = None
    written: Written = field(default_factory=dict)  # this rank's files, hashed as written
    error: str | None = None
    started: float = field(default_factory=time.monotonic)
    # How long this rank's own files took to write, once they are written.
    took_s: float | None = None
    # Set once the write no longer counts (the job stopped): the thread writes no more files.
    abandoned: threading.Event = field(default_factory=threading.Event)
    # Set once DCP's exchange of plans among the writers' threads is done: every rank's began.
    exchanged: threading.Event = field(default_factory=threading.Event)
    # Set by the thread as it ends. Not Thread.is_alive(): a join that the launcher's stop
    # interrupts marks a thread still running as stopped (CPython's bpo-45274 handling).
    done: threading.Event = field(default_factory=threading.Event)
    # Rank 0: what its thread committed as soon as every rank's files were written.
    committed: "Location | None" = None


def _planner_marking(on_exchanged: Callable[[], None]) -> Any:
    """DCP's default save planner, which calls ``on_exchanged`` once the plans are exchanged:
    past that point a write needs no other rank's thread to begin."""
    from torch.distributed.checkpoint import DefaultSavePlanner
    from torch.distributed.checkpoint.planner import SavePlan

    class MarkingPlanner(DefaultSavePlanner):
        def finish_plan(self, new_plan: SavePlan) -> SavePlan:
            on_exchanged()
            return super().finish_plan(new_plan)

    return MarkingPlanner()


def _exchanged(write: _Write, timeout_s: float) -> bool:
    """Wait, ``timeout_s`` at most, until ``write``'s plans are exchanged or its thread ended;
    whether one of them happened."""
    return _wait_in_slices(
        lambda: write.exchanged.is_set() or write.done.is_set(), write.exchanged, timeout_s
    )


def _join(write: _Write, timeout_s: float | None) -> bool:
    """Wait for ``write``'s thread (``timeout_s`` at most; None: however long it takes);
    whether it ended."""
    return _wait_in_slices(write.done.is_set, write.done, timeout_s)


def _wait_in_slices(
    happened: Callable[[], bool], event: threading.Event, timeout_s: float | None
) -> bool:
    """Wait until ``happened()`` (``event`` is set when it may have), ``timeout_s`` at most
    (None: however long it takes), in slices, so that the launcher's stop (an exception raised
    in this thread) lands; whether it happened."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while not happened():
        left = JOIN_POLL_S if deadline is None else min(JOIN_POLL_S, deadline - time.monotonic())
        if left <= 0:
            break
        event.wait(left)
    return happened()


class AsyncCheckpoints:
    """Checkpoints that do not stop training (``checkpoint.async_save``), for one rank of a job.

    ``save`` copies this rank's part into CPU buffers and returns: training waits for a memory
    copy, not for serialization, the disk or the network. The buffers are kept and reused by
    every save (torch's ``DefaultStager``; pinned on a GPU): a rank holds one more copy of its
    share of the state for the job's life, as torchtitan's async checkpoints do. A thread then
    serializes the copy through DCP into memory (fsspec's memory filesystem) and writes the
    files into ``step-<n>/`` (``.step-<n>.partial`` on local disk), hashing them on the way. At
    most one write is in flight: the next ``save``, or ``finish``, waits for it, and only once
    every rank's files are written does rank 0 add the manifest, the commit, so a checkpoint
    still being written is never taken. A write that failed on any rank is a warning and a
    record in ``failures`` (and ``on_failure``'s, on rank 0): it gets no manifest, the previous
    good checkpoint stays the newest, and a later commit deletes what it left.

    DCP's exchanges in the threads run on a gloo group of their own (made by the first save of
    each world), never on the training's: two threads' collectives on one group could
    interleave. Past that, the ranks agree in ``save`` and ``finish``, which every rank calls at
    the same point, as it would a synchronous save. A job stopped with a write in flight (the
    launcher's stop, Ctrl-C, SIGTERM, a failure) has no collective left: :meth:`interrupted`
    waits for it a bounded time, and commits it only if every rank's files are written by then.
    """

    def __init__(
        self,
        directory: str | Path,
        *,
        keep: int,
        signing_key_file: str | None = None,
        storage_options: StorageOptions = None,
        on_failure: Callable[[dict[str, Any]], None] | None = None,
        run_id: str | None = None,
    ) -> None:
        self.directory, self.keep, self.run_id = directory, keep, run_id
        self.signing_key_file, self.storage_options = signing_key_file, storage_options
        self.failures: list[dict[str, Any]] = []
        # Rank 0's record of each failed write (a CheckpointFailedRecord's event): the built-in
        # trainer sends it to the client.
        self.on_failure = on_failure
        self._pending: _Write | None = None
        # The world they were made in (its default group), the writers' group and the
        # buffers; made again in a new world (an elastic resize reshards the state).
        self._world: object | None = None
        self._group: Any = None
        self._stager: Any = None

    def _writers(self) -> tuple[Any, Any]:
        """The writers' process group and the stager of this world (collective the first time
        in each world: every rank calls ``save`` at the same point)."""
        world = dist.group.WORLD
        if self._world is not world:
            from datetime import timedelta

            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            self._close_stager()
            self._group = dist.new_group(
                backend="gloo", timeout=timedelta(seconds=WRITER_GROUP_TIMEOUT_S)
            )
            # Synchronous copies into cached buffers (pinned where a GPU copies into them):
            # the copy is what training waits for, so it is done before save returns.
            self._stager = DefaultStager(
                StagingOptions(
                    use_pinned_memory=torch.cuda.is_available(),
                    use_shared_memory=False,
                    use_async_staging=False,
                    use_non_blocking_copy=False,
                )
            )
            self._world = world
        return self._group, self._stager

    def _close_stager(self) -> None:
        if self._stager is not None:
            self._stager.close()
        self._world = self._group = self._stager = None

    def save(self, tensors: dict[str, Any], *, step: int, fields: dict[str, Any]) -> None:
        """Commit the write in flight, if any, then stage ``tensors`` (this rank's) as the
        checkpoint of ``step`` and start writing them (collective)."""
        self.finish()
        where = _where(self.directory, self.storage_options)
        name = _decided(lambda: _prepared(where, step, self.run_id))
        target = where.child(name) if isinstance(where, _Remote) else where / f".{name}.partial"
        group, stager = self._writers()
        write = _Write(
            step=step,
            name=name,
            fields=fields,
            target=target,
            staged=stager.stage(tensors),  # the buffers the last write read are free: finished
            # Each rank's own staging folder: the memory filesystem is per process, and the
            # names DCP gives the files (__<rank>_0.distcp) keep them apart in the folder.
            staging=f"{STAGING}/{uuid.uuid4().hex}",
            rank=dist.get_rank(),
            world_size=dist.get_world_size(),
        )
        write.thread = threading.Thread(
            target=self._write, args=(write, group), name=f"checkpoint-{name}", daemon=True
        )
        write.thread.start()
        self._pending = write

    def _write(self, write: _Write, group: Any) -> None:
        """The thread: the staged state serialized into memory (collective on ``group``, the
        writers' own), then its files into the target, hashed on the way. It counts as
        writing (``writing()``) from the exchange of plans on: before it, it may wait for a
        peer stopped before its own write began, which never will, and a rank stuck where a
        stop cannot reach it would be waited for as if its write could still finish."""
        with contextlib.ExitStack() as counted:

            def exchanged() -> None:
                if not write.exchanged.is_set():
                    counted.enter_context(_carrying_a_write())
                    write.exchanged.set()

            self._write_files(write, group, on_exchanged=exchanged)

    def _write_files(self, write: _Write, group: Any, *, on_exchanged: Callable[[], None]) -> None:
        import torch.distributed.checkpoint as dcp
        from fsspec.core import url_to_fs

        from workers.compat.torch_private import FSSPEC_WRITER

        _yield_to_training()
        memory, staging = url_to_fs(write.staging)
        try:
            dcp.save(
                write.staged,
                storage_writer=FSSPEC_WRITER(write.staging, sync_files=False),
                planner=_planner_marking(on_exchanged),
                process_group=group,
            )
            for path in sorted(memory.find(staging)):
                if write.abandoned.is_set():
                    write.error = "abandoned: the job stopped"
                    return
                name = path.rsplit("/", 1)[-1]
                # The file's own buffer, not a copy (cat_file's): at the write's peak a rank
                # held its state a third time for it (the plan counts the staged copy and the
                # serialized one).
                with memory.store[path].getbuffer() as data:
                    self._put(write.target, name, data)
                    write.written[name] = (hashlib.sha256(data).hexdigest(), data.nbytes)
            write.took_s = time.monotonic() - write.started
            # Committed as soon as every rank's files are written, not at the next save: a
            # worker lost in between must find this checkpoint (no collective from here).
            if write.rank != 0:
                self._put(
                    write.target, f"{WRITTEN}{write.rank}", json.dumps(write.written).encode()
                )
            else:
                write.committed = self._commit_when_written(write)
        except Exception as error:  # the record says what; the ranks decide in finish
            write.error = f"{type(error).__name__}: {error}"
        finally:
            with contextlib.suppress(FileNotFoundError):
                memory.rm(staging, recursive=True)
            write.done.set()

    def _commit_when_written(self, write: _Write) -> Location | None:
        """Rank 0's thread: the commit, once every other rank's note is there; None when one
        is not in time (a slower rank: ``finish`` commits it then, together) or the job
        stopped."""
        now = time.monotonic()
        until = now + max(EAGER_WAIT_S, now - write.started)
        files = dict(write.written)
        try:
            for rank in range(1, write.world_size):
                files |= self._written_by(write, rank, until)
        except _Abandoned:
            return None
        if write.abandoned.is_set():
            return None
        try:
            return self._commit(write, dict(sorted(files.items())))
        except (OSError, CheckpointDamaged) as error:
            logger.warning("checkpoint of step %d: commit left to finish: %s", write.step, error)
            return None

    def _put(self, target: Path | _Remote, name: str, data: bytes | memoryview) -> None:
        if isinstance(target, _Remote):
            # One PUT: whole or absent (bytes: what every fsspec filesystem takes).
            target.fs.pipe_file(f"{target.path}/{name}", bytes(data))
        else:
            # Whole or absent on local disk too: a file appears by its rename.
            part = target / f".{name}.{uuid.uuid4().hex[:8]}.part"
            _write_durably(part, data)
            os.replace(part, target / name)

    def finish(self, timeout_s: float | None = None) -> Location | None:
        """Wait for the write in flight (``timeout_s`` at most; None: however long it takes)
        and commit it if every rank's succeeded (collective). Returns the committed
        checkpoint on rank 0; None otherwise, and when nothing was in flight."""
        write = self._pending
        if write is None:
            return None
        assert write.thread is not None
        # A stop landing in the wait leaves the write pending, for interrupted().
        joined = _join(write, timeout_s)
        self._pending = None
        if not joined:  # abandoned: no manifest whenever it ends
            write.abandoned.set()
            outcome: dict[str, str] | str = f"still writing after {timeout_s:g} s"
        else:
            outcome = write.error or write.written
        outcomes: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(outcomes, outcome)
        failed = [f"rank {r}: {o}" for r, o in enumerate(outcomes) if isinstance(o, str)]
        committed = None
        if not failed and dist.get_rank() == 0:
            files = dict(sorted(item for part in outcomes for item in part.items()))
            try:
                committed = write.committed or self._commit(write, files)
            except (OSError, CheckpointDamaged) as error:
                failed = [f"rank 0's commit: {type(error).__name__}: {error}"]
        # Rank 0's verdict, its commit's included, to every rank; and no rank starts the next
        # save (which may clear this folder) before it is committed.
        verdict = [failed]
        dist.broadcast_object_list(verdict, src=0)
        if verdict[0]:
            self._failed(write, verdict[0])
            # A thread still writing may yet read the buffers and use the group: the next save
            # makes new ones (every rank, as every rank has this verdict).
            self._close_stager()
        return committed

    def interrupted(self, timeout_s: float) -> Location | None:
        """The job stops with a write in flight, no collective left (the launcher's stop,
        Ctrl-C, SIGTERM, a failure): wait for this rank's write, ``timeout_s`` at most, then
        commit it on rank 0 if every rank's files are written by then, else abandon it (no
        manifest: never taken, deleted by a later commit). Every rank calls it, none waits for
        another: a rank whose files are written says so in the folder (``.written-rank<r>``,
        with their hashes), and rank 0 waits for those at most as long again as its own write
        took (they started together), within ``timeout_s``. Returns the committed checkpoint
        on rank 0; None otherwise, and when nothing was in flight."""
        write, self._pending = self._pending, None
        if write is None:
            return None
        assert write.thread is not None
        with _carrying_a_write():
            return self._commit_or_abandon(write, timeout_s)

    def _commit_or_abandon(self, write: _Write, timeout_s: float) -> Location | None:
        deadline = time.monotonic() + timeout_s
        committed = None
        try:
            if not _exchanged(write, min(EXCHANGE_WAIT_S, timeout_s)):
                raise _Abandoned(f"rank {write.rank}: a peer stopped before its write began")
            if not _join(write, max(0.0, deadline - time.monotonic())):
                raise _Abandoned(f"rank {write.rank}: still writing after {timeout_s:g} s")
            if write.error:
                raise _Abandoned(f"rank {write.rank}: {write.error}")
            if write.rank != 0:
                return None  # its thread left the note: rank 0 commits
            if write.committed is not None:
                return write.committed
            files = dict(write.written)
            # As long again as its own write took, not since it started: a write that ended
            # long before the stop (its peer stopped meanwhile) gives the others a second.
            now = time.monotonic()
            took = write.took_s if write.took_s is not None else now - write.started
            until = min(deadline, now + max(1.0, took))
            for rank in range(1, write.world_size):
                files |= self._written_by(write, rank, until)
            committed = self._commit(write, dict(sorted(files.items())))
            logger.warning(
                "job stopped: the checkpoint of step %d in flight was written and committed",
                write.step,
            )
        except (_Abandoned, OSError, CheckpointDamaged) as error:
            if write.rank == 0:
                self._failed(write, [f"abandoned as the job stopped: {error}"])
        finally:
            write.abandoned.set()  # whatever happened, the thread writes no more
        return committed

    def _written_by(self, write: _Write, rank: int, until: float) -> Written:
        """The files ``rank`` says it wrote, once it says so (until ``until``)."""
        while True:
            try:
                note = json.loads(_read_bytes(write.target, f"{WRITTEN}{rank}"))
                return {name: (digest, size) for name, (digest, size) in note.items()}
            except _missing(write.target):
                if time.monotonic() >= until:
                    raise _Abandoned(f"rank {rank}: its files were not written in time") from None
                time.sleep(JOIN_POLL_S)

    def _failed(self, write: _Write, errors: list[str]) -> None:
        self.failures.append({"step": write.step, "errors": errors, "at": time.time()})
        logger.warning(
            "checkpoint of step %d not written, the previous one stays the newest: %s",
            write.step,
            "; ".join(errors),
        )
        if write.rank == 0 and self.on_failure is not None:
            record = CheckpointFailedRecord(step=write.step, error="; ".join(errors))
            try:
                self.on_failure(record.to_event())
            except Exception:  # the client may be gone (a stopped job): the warning stays
                logger.exception("could not report the failed checkpoint of step %d", write.step)

    def _commit(self, write: _Write, files: Written) -> Location:
        for rank in range(1, write.world_size):  # the notes are not the checkpoint's
            _delete(write.target, f"{WRITTEN}{rank}")
        # What the store lists is what the ranks wrote, at the sizes they wrote: nothing
        # missing, nothing else, nothing cut short.
        manifest = _manifest(
            write.step,
            {**write.fields, "run": self.run_id},
            _checked(write.target, files),
            self.signing_key_file,
            world_size=write.world_size,
        )
        if isinstance(write.target, _Remote):
            root = _where(self.directory, self.storage_options)
            assert isinstance(root, _Remote)
            return _commit_remote(root, write.target, manifest, self.keep, self.run_id)
        return _commit_local(write.target.parent, write.name, manifest, self.keep, self.run_id)


class _Abandoned(Exception):
    """A write in flight that will not be committed."""


def _delete(where: Path | _Remote, name: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        if isinstance(where, _Remote):
            where.fs.rm_file(f"{where.path}/{name}")
        else:
            (where / name).unlink()


def _prepared(root: Path | _Remote, step: int, run_id: str | None) -> str:
    """Rank 0: the folder name of this step's checkpoint (:func:`_folder_name`), and an empty
    folder to write its files into: ``.<name>.partial`` on local disk, ``<name>/`` itself on an
    object store. What a write of it left before a restart goes (on a store, another world
    size's files among them would mix with this one's, and the manifest would not match)."""
    name = _folder_name(root, step, run_id)
    if isinstance(root, _Remote):
        _remove(root.child(name))
    else:
        partial = root / f".{name}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    return name


def _run_of(where: Path | _Remote) -> Any:
    """The run a committed checkpoint's manifest names; None where it names none, is
    unreadable, or is not there."""
    try:
        manifest = json.loads(_read_bytes(where, MANIFEST))
    except (ValueError, *_missing(where)):
        return None
    return manifest.get("run") if isinstance(manifest, dict) else None


def _own(checkpoints: list[Any], root: _Remote | None, run_id: str | None) -> list[Any]:
    """Those of ``checkpoints`` (paths, or folder names under ``root``) that are ``run_id``'s,
    in order (one manifest read each); None: all of them."""
    if run_id is None:
        return list(checkpoints)
    where = (lambda c: root.child(c)) if root is not None else (lambda c: c)
    return [c for c in checkpoints if _run_of(where(c)) == run_id]


def _refuse_another_runs(final: Path | _Remote, run_id: str | None) -> None:
    """CheckpointDamaged where ``final`` is another run's committed checkpoint."""
    if run_id is None or MANIFEST not in _file_names_if_any(final):
        return
    owner = _run_of(final)
    if owner != run_id:
        raise CheckpointDamaged(
            f"{_label(final)} holds the checkpoint of run {owner!r} at this step, not of run "
            f"{run_id!r}: left alone; give each run its own checkpoint.directory, or "
            "checkpoint.run_id"
        )


def _file_names_if_any(where: Path | _Remote) -> set[str]:
    if isinstance(where, Path) and not where.is_dir():
        return set()
    return _file_names(where)


def list_checkpoints(
    directory: str | Path, storage_options: StorageOptions = None
) -> list[Location]:
    """Committed checkpoints, newest first: local folders renamed into place (partial ones
    start with a dot and are not listed), or on an object store the folders with a manifest
    (URLs, as ``directory`` is written)."""
    where = _where(directory, storage_options)
    if isinstance(where, _Remote):
        folders = _step_folders(where)
        committed = [n for n, files in folders.items() if MANIFEST in files]
        return [where.child(n).url for n in sorted(committed, reverse=True)]
    if not where.is_dir():
        return []
    found = [p for p in where.iterdir() if p.is_dir() and p.name.startswith(PREFIX)]
    return sorted(found, key=lambda p: p.name, reverse=True)


def verify_checkpoint(
    path: str | Path,
    signing_key_file: str | None = None,
    storage_options: StorageOptions = None,
    *,
    run_id: str | None = None,
    hashed: slice = slice(None),
) -> dict[str, Any]:
    """The manifest of an intact checkpoint (signed with the key in ``signing_key_file``, when
    given; of run ``run_id``, when given); raises :class:`CheckpointDamaged` otherwise.
    ``hashed``: which of its files (in the manifest's order) to hash, the others' sizes only
    (:func:`verify_checkpoint_together` gives each rank a share).

    On an object store, a store that cannot be reached or refuses access raises its own error:
    that is no damage, and no reason to pass over the checkpoint."""
    where = _where(path, storage_options)
    try:
        manifest = json.loads(_read_bytes(where, MANIFEST))
        files = manifest["files"]
    except (ValueError, KeyError, TypeError, *_missing(where)) as error:
        raise CheckpointDamaged(f"{path}: no readable {MANIFEST} ({error})") from None
    if not isinstance(manifest, dict) or not isinstance(files, dict):
        raise CheckpointDamaged(f"{path}: {MANIFEST} is malformed")
    if signing_key_file is not None:
        signature = manifest.get(SIGNATURE)
        if not isinstance(signature, str):
            raise CheckpointDamaged(
                f"{path}: {MANIFEST} is not signed, and checkpoint.signing_key_file is set"
            )
        expected = _signature(manifest, _read_key(signing_key_file))
        if not hmac.compare_digest(signature, expected):
            raise CheckpointDamaged(
                f"{path}: {MANIFEST}'s signature does not match the key in "
                "checkpoint.signing_key_file"
            )
    if run_id is not None and manifest.get("run") != run_id:
        raise CheckpointDamaged(
            f"{path}: the checkpoint of run {manifest.get('run')!r}, not {run_id!r}"
        )
    present = _file_names(where) - {MANIFEST}
    if present != set(files):
        raise CheckpointDamaged(
            f"{path}: files {sorted(present ^ set(files))} differ from the manifest"
        )
    sizes = manifest.get("sizes")
    if sizes:  # first, as it costs one listing: a file cut short is told as such
        found = _sizes(where)
        wrong = sorted(name for name in files if found.get(name) != sizes.get(name))
        if wrong:
            raise CheckpointDamaged(f"{path}: files {wrong} are not the size the manifest says")
    # Then every byte, wherever the checkpoint lives: a file changed in place keeps its size.
    for name, digest in list(files.items())[hashed]:
        try:
            found = _digest(where, name)
        except _missing(where) as error:  # removed since it was listed
            raise CheckpointDamaged(f"{_name(where, name)}: unreadable ({error})") from None
        if found != digest:
            raise CheckpointDamaged(f"{_name(where, name)}: checksum differs from the manifest")
    read_metadata(path, storage_options)  # refuses foreign pickles before DCP would load them
    return manifest


def verify_checkpoint_together(
    path: str | Path, signing_key_file: str | None = None, storage_options: StorageOptions = None
) -> dict[str, Any]:
    """:func:`verify_checkpoint` by every rank of the default group (collective), each hashing
    a share of the files: the checkpoint is read once for its hashes, not once a rank. Every
    rank raises CheckpointDamaged where any rank found damage."""
    rank, world = dist.get_rank(), dist.get_world_size()
    manifest, found = None, None
    try:
        manifest = verify_checkpoint(
            path, signing_key_file, storage_options, hashed=slice(rank, None, world)
        )
    except CheckpointDamaged as error:
        found = str(error)
    verdicts: list[Any] = [None] * world
    dist.all_gather_object(verdicts, found)
    damage = [verdict for verdict in verdicts if verdict is not None]
    if damage:
        raise CheckpointDamaged(damage[0])
    assert manifest is not None
    return manifest


def latest_good_checkpoint(
    directory: str | Path,
    signing_key_file: str | None = None,
    storage_options: StorageOptions = None,
    *,
    run_id: str | None = None,
) -> tuple[Location, dict[str, Any]] | None:
    """The newest intact checkpoint of run ``run_id`` (None: of any run), warning about each
    damaged one passed over; other runs' are passed over unread (their manifests aside)."""
    for path in list_checkpoints(directory, storage_options):
        if run_id is not None and _run_of(_where(path, storage_options)) != run_id:
            continue
        try:
            return path, verify_checkpoint(path, signing_key_file, storage_options, run_id=run_id)
        except CheckpointDamaged as error:
            logger.warning("skipping damaged checkpoint: %s", error)
    return None


def load_checkpoint(
    path: str | Path,
    *,
    modules: list[nn.Module],
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    signing_key_file: str | None = None,
    storage_options: StorageOptions = None,
) -> Progress:
    """Load a verified checkpoint into this rank's modules and optimizer (collective).

    The world size may differ from the one that wrote it: DCP reshards. The RNG state is
    restored where this rank's was saved.
    """
    # Verified again where it is loaded: the folder may have changed since the client looked.
    manifest = verify_checkpoint_together(path, signing_key_file, storage_options)
    metadata = read_metadata(path, storage_options)
    rank = dist.get_rank()
    state = _state(modules, optimizer, scaler)
    state["progress"] = torch.zeros(3, dtype=torch.int64)
    # Another world size has other ranks: a rank with no saved sums or RNG starts them afresh.
    sums_key, rng_key = f"sums.rank{rank}", f"rng.rank{rank}"
    if sums_key in metadata.state_dict_metadata:
        saved = metadata.state_dict_metadata[sums_key]
        state[sums_key] = torch.zeros(saved.size, dtype=torch.float64)  # the task's length
    if rng_key in metadata.state_dict_metadata:
        state[rng_key] = torch.get_rng_state()
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    dcp.load(
        state,
        storage_reader=safe_reader(path, storage_options),
        planner=tensors_only_planner(),
    )
    _, current = get_state_dict(_whole(modules), optimizer)
    set_state_dict(
        _whole(modules),
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict={
            "state": state["optim"]["state"],
            "param_groups": current["param_groups"],
        },
    )
    if "scaler" in state:
        scaler.load_state_dict({k: v.item() for k, v in state["scaler"].items()})
    if rng_key in state:
        torch.set_rng_state(state[rng_key])
    epoch, batch, step = state["progress"].tolist()
    return Progress(
        epoch=epoch,
        batch=batch,
        step=step,
        sums=state[sums_key].tolist() if sums_key in state else [],
        history=manifest["history"],
    )


def load_model_tensors(
    path: str | Path,
    modules: list[nn.Module],
    *,
    prefix: str,
    storage_options: StorageOptions = None,
) -> None:
    """The model's tensors of the DCP checkpoint at ``path`` (a folder, or a URL through
    fsspec; under ``prefix``: ``"model."`` in a run's checkpoint) into this rank's modules as
    laid out, each rank reading its own part of each: DCP reshards (collective). A tensor the
    checkpoint lacks is DCP's error."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    model = _whole(modules)
    state = {k: v for k, v in get_model_state_dict(model).items() if not v.is_meta}
    # DCP nests by the first dot: a run's checkpoint holds {"model": {...}, "optim": ...}.
    dcp.load(
        {prefix.rstrip("."): state} if prefix else state,
        storage_reader=safe_reader(path, storage_options),
        planner=tensors_only_planner(),
    )
    set_model_state_dict(model, state)


def _missing(where: Path | _Remote) -> tuple[type[Exception], ...]:
    """What reading a checkpoint's file raises when the file is not there: on local disk any
    OSError (as ever); on a store only its "no such key", since its other errors (unreachable,
    access refused) say nothing about the checkpoint."""
    return (FileNotFoundError,) if isinstance(where, _Remote) else (OSError,)


def _read_bytes(where: Path | _Remote, name: str) -> bytes:
    if isinstance(where, _Remote):
        return where.fs.cat_file(f"{where.path}/{name}")
    return (where / name).read_bytes()


def _file_names(where: Path | _Remote) -> set[str]:
    if isinstance(where, _Remote):
        where.fs.invalidate_cache(where.path)  # other processes wrote here since this one looked
        try:
            listed = where.fs.ls(where.path, detail=False)
        except FileNotFoundError:
            return set()
        return {p.rstrip("/").rsplit("/", 1)[-1] for p in listed}
    return {p.name for p in where.iterdir()}


def _sizes(where: Path | _Remote) -> dict[str, int]:
    """Each file's size in bytes, the manifest aside."""
    if isinstance(where, _Remote):
        where.fs.invalidate_cache(where.path)
        listed = where.fs.ls(where.path, detail=True)
        found = {e["name"].rstrip("/").rsplit("/", 1)[-1]: int(e["size"]) for e in listed}
    else:
        found = {p.name: p.stat().st_size for p in where.iterdir() if p.is_file()}
    found.pop(MANIFEST, None)
    return found


def _digest(where: Path | _Remote, name: str) -> str:
    if isinstance(where, _Remote):
        with where.fs.open(f"{where.path}/{name}", "rb") as file:
            return _sha256_of(file)
    return _sha256(where / name)


def _whole(modules: list[nn.Module]) -> nn.Module:
    """One module holding this rank's layers under the full model's names.

    A DDP wrapper's ``module.`` prefix and the split into stages both vanish, so a checkpoint's
    keys are the same whatever strategy and world size wrote it.
    """
    plain = [m.module if hasattr(m, "module") else m for m in modules]
    if len(plain) == 1:
        return plain[0]
    holder = nn.Module()
    for module in plain:
        for name, child in module.named_children():
            holder.add_module(name, child)
    return holder


# -- reading DCP's metadata without running foreign code ------------------------------------
#
# torch's own restricted unpickler (torch.load(weights_only=True)) reads only the pickle
# protocol torch.save writes (2): DCP writes .metadata with protocol 4+, whose STACK_GLOBAL,
# MEMOIZE and FRAME it refuses. So this one is built on Python's pure-Python unpickler
# (workers.compat.cpython_private), which runs each opcode through a table we can narrow:
# every global is an exact (module, name) pair from the list below (a dotted name, which
# protocol 4 resolves as an attribute chain, is never one), and only the listed classes may be
# called, created or have state set. Opcodes that name objects another way (INST, OBJ,
# NEWOBJ_EX, EXT1/2/4 via copyreg, persistent ids, buffers) are refused.


def _metadata_classes() -> dict[tuple[str, str], Any]:
    from torch.distributed.checkpoint import metadata

    from workers.compat.torch_private import DCP_PRIVATE_CLASSES

    return {
        (metadata.__name__, name): getattr(metadata, name)
        for name in (
            "Metadata",
            "TensorStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "MetadataIndex",
            "StorageMeta",
        )
    } | DCP_PRIVATE_CLASSES


class _MetadataUnpickler(PurePythonUnpickler):
    """Admits what DCP's metadata of a tensors-only checkpoint is made of, nothing else.

    BytesStorageMetadata is left out on purpose: DCP loads a bytes item with
    ``torch.load(weights_only=False)``, and this project only ever saves tensors.
    """

    dispatch = dict(PurePythonUnpickler.dispatch)  # type: ignore[attr-defined]

    def _refuse(self) -> None:
        raise CheckpointDamaged("checkpoint metadata uses a pickle opcode it never needs, refused")

    for _opcode in (
        pickle.INST,
        pickle.OBJ,
        pickle.NEWOBJ_EX,
        pickle.EXT1,
        pickle.EXT2,
        pickle.EXT4,
        pickle.PERSID,
        pickle.BINPERSID,
        pickle.NEXT_BUFFER,
        pickle.READONLY_BUFFER,
    ):
        dispatch[_opcode[0]] = _refuse
    del _opcode

    def __init__(self, file: io.BytesIO) -> None:
        from workers.compat.torch_private import GET_LAYOUT, GET_LAYOUT_NAME, MEM_FORMAT_ENCODING

        super().__init__(file)
        self._classes = _metadata_classes()
        self._plain_classes = set(self._classes.values())
        self._globals = {
            **self._classes,
            ("torch", "Size"): torch.Size,
            GET_LAYOUT_NAME: GET_LAYOUT,
            ("pathlib", "PosixPath"): pathlib.PosixPath,
            ("pathlib", "Path"): pathlib.Path,
            # Where Python 3.13 defines them, and so pickles them from (3.11: the same pairs).
            (pathlib.PosixPath.__module__, "PosixPath"): pathlib.PosixPath,
            (pathlib.Path.__module__, "Path"): pathlib.Path,
            ("collections", "OrderedDict"): collections.OrderedDict,
        }
        # What REDUCE may call: constructors of plain values, and torch's layout lookup.
        self._callables = {
            torch.Size,
            GET_LAYOUT,
            pathlib.PosixPath,
            pathlib.Path,
            collections.OrderedDict,
            MEM_FORMAT_ENCODING,
        }

    def find_class(self, module: str, name: str) -> Any:
        found = self._globals.get((module, name))
        if found is not None:
            return found
        if module == "torch" and name.isidentifier():
            dtype = vars(torch).get(name)  # a module attribute, never a chain
            if isinstance(dtype, torch.dtype):
                return dtype
        raise CheckpointDamaged(f"checkpoint metadata refers to {module}.{name}, refused")

    def load_reduce(self) -> None:
        if self.stack[-2] not in self._callables:
            raise CheckpointDamaged(f"checkpoint metadata calls {self.stack[-2]!r}, refused")
        super().load_reduce()

    def load_newobj(self) -> None:
        if self.stack[-2] not in self._plain_classes:
            raise CheckpointDamaged(f"checkpoint metadata creates {self.stack[-2]!r}, refused")
        super().load_newobj()

    def load_build(self) -> None:
        state, inst = self.stack[-1], self.stack[-2]
        # type(), not isinstance: a class object itself (whose attributes BUILD would set) or
        # a subclass never passes.
        if type(inst) not in self._plain_classes:
            raise CheckpointDamaged(f"checkpoint metadata sets the state of {inst!r}, refused")
        if "__setstate__" in vars(type(inst)):
            if not isinstance(state, tuple):  # TensorProperties: a tuple of plain values
                raise CheckpointDamaged("checkpoint metadata: malformed TensorProperties")
        else:
            fields = {f.name for f in dataclasses.fields(inst)}
            if not isinstance(state, dict) or not set(state) <= fields:
                raise CheckpointDamaged(
                    f"checkpoint metadata: malformed {type(inst).__name__} state"
                )
        super().load_build()

    dispatch[pickle.REDUCE[0]] = load_reduce
    dispatch[pickle.NEWOBJ[0]] = load_newobj
    dispatch[pickle.BUILD[0]] = load_build


def read_metadata(path: str | Path, storage_options: StorageOptions = None) -> Any:
    """DCP's metadata of the checkpoint at ``path``, unpickled with the restricted unpickler
    (from local disk or through fsspec alike); raises :class:`CheckpointDamaged` for anything
    but a tensors-only checkpoint's metadata."""
    return _metadata_of(_where(path, storage_options))


def _metadata_of(where: Path | _Remote) -> Any:
    from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

    label = _name(where, METADATA)
    try:
        data = _read_bytes(where, METADATA)
    except _missing(where) as error:
        raise CheckpointDamaged(f"{_label(where)}: no DCP metadata ({error})") from None
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except CheckpointDamaged as error:
        raise CheckpointDamaged(f"{label}: {error}") from None
    except Exception as error:
        raise CheckpointDamaged(f"{label}: unreadable ({error})") from None
    if type(metadata) is not Metadata or not isinstance(metadata.state_dict_metadata, dict):
        raise CheckpointDamaged(f"{label}: not DCP metadata")
    for key, item in metadata.state_dict_metadata.items():
        if type(item) is not TensorStorageMetadata:
            raise CheckpointDamaged(f"{label}: {key!r} is not a tensor, refused")
    return metadata


def _loadable(metadata: Any, load_id: Any) -> Any:
    """What DCP's own ``read_metadata`` adds to the metadata it read."""
    if getattr(metadata, "storage_meta", None) is None:
        from torch.distributed.checkpoint.metadata import StorageMeta

        metadata.storage_meta = StorageMeta()
    metadata.storage_meta.load_id = load_id
    return metadata


@functools.cache
def _dcp_classes() -> tuple[type, type, type]:
    """DCP's file and fsspec readers and its load planner, made safe; defined on first use
    (see the imports)."""
    import torch.distributed.checkpoint as dcp

    from workers.compat.torch_private import FSSPEC_READER

    class SafeReader(dcp.FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            return _loadable(read_metadata(Path(self.path)), self.load_id)

    class SafeFsspecReader(FSSPEC_READER):  # type: ignore[misc, valid-type]
        def __init__(self, url: str, storage_options: StorageOptions) -> None:
            self.storage_options = dict(storage_options or {})
            super().__init__(url, **self.storage_options)

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            # The bytes through fsspec, the same restricted unpickler as on local disk.
            return _loadable(read_metadata(self.path, self.storage_options), self.load_id)

    class TensorsOnlyPlanner(dcp.DefaultLoadPlanner):
        """DCP's planner, less its bytes path, which unpickles with ``weights_only=False``."""

        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            raise CheckpointDamaged(
                f"checkpoint item {read_item.dest_index.fqn!r} is not a tensor; refused unread"
            )

    return SafeReader, SafeFsspecReader, TensorsOnlyPlanner


def safe_reader(path: str | Path, storage_options: StorageOptions = None) -> Any:
    """A DCP storage reader of ``path`` (a local folder, or a URL through fsspec) whose
    metadata goes through :func:`read_metadata`."""
    where = _where(path, storage_options)
    if isinstance(where, _Remote):
        return _dcp_classes()[1](where.url, storage_options)
    return _dcp_classes()[0](where)


def tensors_only_planner() -> Any:
    """A DCP load planner that refuses any item that is not a tensor, unread."""
    return _dcp_classes()[2]()


def _read_key(signing_key_file: str) -> bytes:
    try:
        key = Path(signing_key_file).read_bytes().strip()
    except OSError as error:
        raise ValueError(
            f"checkpoint.signing_key_file: {signing_key_file}: cannot read it "
            f"({error.strerror or error})"
        ) from None
    if not key:
        raise ValueError(f"checkpoint.signing_key_file: {signing_key_file}: the file is empty")
    return key


def document_signature(document: dict[str, Any], signing_key_file: str) -> str:
    """The HMAC a manifest carries, over another JSON document of the run (its config.json:
    workflows/runs/trust.py), made with the same key the same way."""
    return _signature(document, _read_key(signing_key_file))


def _signature(manifest: dict[str, Any], key: bytes) -> str:
    """HMAC-SHA256 over the manifest's canonical JSON, its signature left out."""
    content = {k: v for k, v in manifest.items() if k != SIGNATURE}
    canonical = json.dumps(content, sort_keys=True, separators=(",", ":"), allow_nan=True)
    return "hmac-sha256:" + hmac.new(key, canonical.encode(), hashlib.sha256).hexdigest()


def _sha256(path: Path) -> str:
    with path.open("rb") as file:
        return _sha256_of(file)


def _sha256_of(file: IO[bytes]) -> str:
    digest = hashlib.sha256()
    for block in iter(lambda: file.read(1 << 20), b""):
        digest.update(block)
    return digest.hexdigest()


def _write_durably(path: Path, data: bytes | memoryview) -> None:
    with path.open("wb") as file:
        file.write(data)
        file.flush()
        os.fsync(file.fileno())
