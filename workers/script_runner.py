"""An unmodified torchrun script on a rank: ``dask-train launch script.py args...``.

``run_script`` is a rank function of :func:`workflows.launch` like any user's: the worker's own
process group agrees on a rendezvous port, then the script runs as a child process of the
worker with torchrun's environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``, ``TORCHELASTIC_*``), so
its own ``init_process_group()`` forms a group of the script's processes. Its output goes to the
client as events, a batch of lines at a time. When the launcher stops the rank (a failure
elsewhere, Ctrl-C), the child and everything it started are stopped with it.
"""

import contextlib
import os
import select
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist
from distributed import get_worker

from workers.rank_context import RankContext
from workers.records import OutputRecord

OUTPUT_FLUSH_S = 0.1  # how long lines wait to travel together
KEEP_RECORDS = 200  # output records a rank hands back for those still in flight
STOP_GRACE_S = 5.0  # SIGTERM, then SIGKILL after this long
# Linux's PR_SET_PDEATHSIG (1): the kernel kills the child when the worker thread that started
# it ends, which is when the worker process dies (that thread waits for the child throughout).
# It survives exec; if the worker died before the call, the parent id has changed: exit.
_DIE_WITH_PARENT = """
import ctypes, os, signal, sys
try:
    ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)
except (OSError, AttributeError):
    pass
if os.getppid() != int(sys.argv[1]):
    sys.exit(1)
os.execv(sys.argv[2], sys.argv[2:])
"""


class ScriptFailed(RuntimeError):
    """The script exited with a non-zero code on a rank."""

    def __init__(self, rank: int, code: int, tail: list[str]) -> None:
        # The output itself already streamed to the client; the tail is for callers.
        super().__init__(f"rank {rank} exited with code {code}")
        self.rank, self.code, self.tail = rank, code, tail

    def __reduce__(self) -> tuple[type, tuple[int, int, list[str]]]:
        return type(self), (self.rank, self.code, self.tail)  # it travels to the client


@dataclass(frozen=True)
class ScriptSpec:
    """What to run: ``python SCRIPT ARGS`` or ``python -m MODULE ARGS``."""

    target: str  # a script path, or a module name with ``module``
    args: tuple[str, ...] = ()
    module: bool = False
    source: bytes | None = None  # the script's text, for workers that cannot see the file
    sha256: str | None = None
    cwd: str | None = None  # the client's working directory, used where it exists
    run_id: str = "dask-train"


@dataclass
class ScriptResult:
    rank: int
    exit_code: int
    output: list[dict[str, Any]]  # the last output records, for those still in flight


def run_script(ctx: RankContext, spec: ScriptSpec) -> ScriptResult:
    port = _agree_on_port(ctx)
    # The child first asks the kernel to kill it when its parent (this worker) dies, then
    # becomes the script; a preexec_fn would run Python between fork and exec in a
    # multi-threaded process, which can deadlock.
    command = [
        sys.executable,
        "-c",
        _DIE_WITH_PARENT,
        str(os.getpid()),
        sys.executable,
        "-u",
        *_target(spec),
        *spec.args,
    ]
    cwd = spec.cwd if spec.cwd and os.path.isdir(spec.cwd) else None
    child = subprocess.Popen(
        command,
        env=_environment(ctx, spec, port),
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        # Its own process group, so that stopping it stops what it started (DataLoader
        # workers); and it dies with the worker if the worker is killed.
        start_new_session=True,
    )
    stream = _OutputStream(ctx)
    try:
        stream.follow(child)
    except BaseException:
        _stop(child)  # stopped by the launcher (RankStopped), or a failure right here
        raise
    finally:
        stream.flush()
    if child.returncode != 0:
        raise ScriptFailed(ctx.rank, child.returncode, stream.tail)
    return ScriptResult(rank=ctx.rank, exit_code=0, output=stream.records[-KEEP_RECORDS:])


def _agree_on_port(ctx: RankContext) -> int:
    """A free port on rank 0's host for the script's rendezvous, new for every attempt."""
    chosen = [0]
    if ctx.rank == 0:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind(("", 0))
            chosen[0] = probe.getsockname()[1]
    dist.broadcast_object_list(chosen, src=0)
    return int(chosen[0])


def _target(spec: ScriptSpec) -> list[str]:
    if spec.module:
        return ["-m", spec.target]
    path = Path(spec.target)
    if path.is_file() and (spec.sha256 is None or _sha256(path.read_bytes()) == spec.sha256):
        return [str(path)]  # the same file is here: siblings it imports are here too
    if spec.source is None:
        raise FileNotFoundError(f"{spec.target}: not on this worker, and no copy was sent")
    folder = Path(get_worker().local_directory) / "dask-train-scripts" / spec.run_id
    folder.mkdir(parents=True, exist_ok=True)
    copy = folder / path.name
    copy.write_bytes(spec.source)
    return [str(copy)]


def _environment(ctx: RankContext, spec: ScriptSpec, port: int) -> dict[str, str]:
    worker = get_worker()
    # Modules shipped to this worker (zip archives, its local directory) are the child's too.
    shipped = [p for p in sys.path if p.endswith(".zip") or p == worker.local_directory]
    inherited = os.environ.get("PYTHONPATH")
    return os.environ | {
        "RANK": str(ctx.rank),
        "LOCAL_RANK": str(ctx.local_rank),
        "WORLD_SIZE": str(ctx.world_size),
        "LOCAL_WORLD_SIZE": str(ctx.local_world_size),
        "GROUP_RANK": str(ctx.node_rank),
        "ROLE_RANK": str(ctx.rank),
        "ROLE_WORLD_SIZE": str(ctx.world_size),
        "ROLE_NAME": "default",
        "MASTER_ADDR": ctx.master_addr,
        "MASTER_PORT": str(port),
        "TORCHELASTIC_RESTART_COUNT": str(ctx.attempt),
        "TORCHELASTIC_MAX_RESTARTS": str(ctx.max_failures),
        "TORCHELASTIC_RUN_ID": spec.run_id,
        "TORCHELASTIC_USE_AGENT_STORE": "False",
        "PYTHONPATH": os.pathsep.join([*shipped, *([inherited] if inherited else [])]),
        "PYTHONUNBUFFERED": "1",
    }


class _OutputStream:
    """The child's lines, sent as events a batch at a time; the last ones kept."""

    def __init__(self, ctx: RankContext) -> None:
        self.ctx = ctx
        self.records: list[dict[str, Any]] = []
        # Output records sent so far: each one's seq. Not len(records), which stops growing
        # at KEEP_RECORDS, and the client drops a record whose seq it has seen.
        self.sent = 0
        self.tail: list[str] = []
        self._lines: list[str] = []
        self._since = time.monotonic()

    def follow(self, child: subprocess.Popen) -> None:
        assert child.stdout is not None
        descriptor = child.stdout.fileno()
        os.set_blocking(descriptor, False)
        pending = b""
        while True:
            # A short wait in Python, not a blocking read: a stop must reach this thread.
            ready, _, _ = select.select([descriptor], [], [], OUTPUT_FLUSH_S)
            chunk = os.read(descriptor, 1 << 16) if ready else b""
            if ready and not chunk:  # end of output: the child closed it or exited
                break
            pending += chunk
            *complete, pending = pending.split(b"\n")
            self._add([line.decode(errors="replace") + "\n" for line in complete])
            if time.monotonic() - self._since >= OUTPUT_FLUSH_S:
                self.flush()
        if pending:
            self._add([pending.decode(errors="replace")])
        child.wait()

    def _add(self, lines: list[str]) -> None:
        self._lines += lines
        self.tail = (self.tail + lines)[-20:]
        if lines:
            self.ctx.heartbeat()

    def flush(self) -> None:
        self._since = time.monotonic()
        if not self._lines:
            return
        record = OutputRecord(
            rank=self.ctx.rank, attempt=self.ctx.attempt, seq=self.sent, lines=self._lines
        ).to_event()
        self.sent += 1
        self._lines = []
        self.records.append(record)
        del self.records[:-KEEP_RECORDS]
        self.ctx.emit(record)


def _stop(child: subprocess.Popen) -> None:
    """SIGTERM to the child's process group, SIGKILL after a grace period."""
    for signum, wait_s in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, STOP_GRACE_S)):
        if child.poll() is not None:
            break
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signum)
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.wait(timeout=wait_s)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(child.pid, signal.SIGKILL)  # what the script itself started


def _sha256(data: bytes) -> str:
    import hashlib

    return hashlib.sha256(data).hexdigest()
