"""The cluster: one Dask worker per GPU, a CPU stand-in with the same interface, or an existing
cluster by address or scheduler file (workers started with the stock ``dask worker``,
``dask cuda worker``, dask-jobqueue, dask-kubernetes, ...), optionally over TLS.

Workers this module starts are non-daemonic (so a DataLoader inside a task may fork its own
workers) and do not get Dask's ``MALLOC_TRIM_THRESHOLD_=65536`` (measured here: it halves
torch's CPU training throughput); by default they get malloc settings that keep freed memory for
reuse instead.
"""

import ast
import asyncio
import atexit
import contextlib
import functools
import json
import logging
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self, TypeVar

import dask
from distributed import Client, Future, LocalCluster, Nanny
from distributed.core import Status
from distributed.security import Security

from workers.compat.distributed_private import adaptive_of
from workers.device_policy import policy_for
from workers.futures import wait_futures
from workers.preparation import RANK_MODULES
from workers.spec.cluster import ClusterConfig
from workflows.cluster.security import build_security

logger = logging.getLogger(__name__)
T = TypeVar("T")

# glibc returns freed blocks above the mmap threshold to the OS at once, and trims the heap top
# above the trim threshold; torch's CPU allocator has no cache, so every step's activations
# then page-fault in again. Measured here on the seed CNN (2 ranks, batch 128): ~2,500 samples/s
# with glibc's defaults, ~3,400 with these, ~1,400 with Dask's MALLOC_TRIM_THRESHOLD_=65536 alone.
TUNED_MALLOC = {"MALLOC_MMAP_THRESHOLD_": 32 * 2**20, "MALLOC_TRIM_THRESHOLD_": 256 * 2**20}
# The worker preload that applies them in a forked worker.
MALLOC = "workers.malloc"
# The worker preload that leaves a terminal's Ctrl-C to the process that started the workers.
QUIET_INTERRUPTS = "workers.quiet_interrupts"
ALL_OURS = (MALLOC, QUIET_INTERRUPTS)

# A local cluster closes the nanny of a worker that has been gone this long
# (distributed.deploy.lost-worker-timeout, 15 s by default), and nothing starts it again. A
# restart (Client.restart, or the launcher releasing the ranks of a failed job) takes the
# nanny's 4 s grace for the old process to exit plus a fresh process importing torch: over 15 s
# on a loaded machine, and then the restart never ends. Our nannies always restart their
# worker, so this only bounds a restart that is stuck anyway.
RESTART_GRACE = "10 minutes"
# Dask's nanny gives a worker process 4 s (0.8 of 5) to exit, then sends SIGKILL and allows
# what is left of the 5 s for the process to be reaped; a kill not reaped by then fails the
# whole restart ("did not shut down"). A worker that has trained exits slowly on a loaded
# machine, and after SIGKILL the kernel still has to free its heap: seen here at a load of 15
# on 2 cores, not reaped within that last second. SIGKILL stays at 4 s (a rank stuck in a
# collective never exits by itself); only the reaping gets this bound.
REAP_GRACE_S = 30.0


def malloc_settings(memory_limit: int | None) -> dict[str, int]:
    """The tuned settings, shrunk for workers with little memory: the heap may keep up to the
    trim threshold of freed memory, which counts against the worker's limit."""
    if not memory_limit:
        return dict(TUNED_MALLOC)
    trim = min(TUNED_MALLOC["MALLOC_TRIM_THRESHOLD_"], memory_limit // 8)
    return {
        "MALLOC_MMAP_THRESHOLD_": min(TUNED_MALLOC["MALLOC_MMAP_THRESHOLD_"], trim // 2),
        "MALLOC_TRIM_THRESHOLD_": trim,
    }


def worker_process_config(
    *, malloc: dict[str, int] | None, fork: bool = False
) -> dict[str, object]:
    """Dask settings for the worker processes we start, applied for the cluster's whole life
    (the nanny reads them again on every restart). ``malloc=None`` leaves glibc's defaults;
    ``fork`` starts workers from a fork server (see :func:`ensure_fork_server`)."""
    environ = malloc if malloc else dict.fromkeys(TUNED_MALLOC)  # None unsets
    config: dict[str, object] = {
        "distributed.worker.daemon": False,
        "distributed.deploy.lost-worker-timeout": RESTART_GRACE,
        **{f"distributed.nanny.pre-spawn-environ.{k}": v for k, v in environ.items()},
    }
    # Set either way: another cluster's settings may still be in Dask's config.
    config["distributed.worker.multiprocessing-method"] = "forkserver" if fork else "spawn"
    # A forked worker's glibc was set up in the fork server: the malloc variables reach its
    # environment, and this preload applies them with mallopt. Every worker we start leaves
    # Ctrl-C to us. The user's own preloads are kept (they were dropped); ours are taken out
    # first, as an earlier cluster may have put them in Dask's config.
    ours = [MALLOC, QUIET_INTERRUPTS] if fork else [QUIET_INTERRUPTS]
    preload = dask.config.get("distributed.worker.preload", None) or []
    preload = [p for p in ([preload] if isinstance(preload, str) else preload) if p not in ALL_OURS]
    config["distributed.worker.preload"] = [*preload, *ours]
    argv = dask.config.get("distributed.worker.preload-argv", None) or []
    if argv and not isinstance(argv[0], str):  # one argument list per preload; none for ours
        argv = argv[: len(preload)]
        config["distributed.worker.preload-argv"] = [*argv, *([] for _ in ours)]
    return config


# A forked worker starts with torch loaded, ~400 MB of its memory limit: smaller workers (an
# out-of-core preprocessing cluster) are spawned as before.
FORK_MIN_MEMORY = 2 * 2**30
# Imported once by the fork server, so that a worker forked from it starts with them loaded.
FORK_SERVER_PRELOAD = (
    *RANK_MODULES,  # what every rank imports (workers/preparation.py)
    "workers.malloc",
    # Every worker imports it when its HTTP server starts: 0.3-0.6 s of each start (typing's
    # generics), most of what a replacement for a lost worker took to rejoin.
    "distributed.http.worker.prometheus",
    "workers.frozen_heap",  # last: what the fork server imported stays out of the workers' GC
)


def ensure_fork_server() -> None:
    """Start workers from a fork server that has imported torch: measured here, a SIGKILLed
    worker is back with torch loaded in 0.10-0.15 s, against 4.5 s and more when spawned
    afresh (each new interpreter imports torch again); that is most of what a recovery costs.

    There is one fork server per process, and every worker forked from it inherits its
    environment; so it is started here, once, with Dask's pre-spawn settings (one thread per
    BLAS/OpenMP pool, a fixed hash seed) and without any cluster's malloc settings, which
    each worker applies itself (``workers.malloc``).
    """
    import multiprocessing.forkserver

    from distributed.utils import get_mp_context

    from workers.compat.cpython_private import forkserver_preload

    context = get_mp_context()  # sets distributed's own preload list the first time
    preload = [*forkserver_preload(), *FORK_SERVER_PRELOAD]
    context.set_forkserver_preload([m for m in dict.fromkeys(preload) if m != "__main__"])
    neutral = {
        name: str(value)
        for name, value in dask.config.get("distributed.nanny.pre-spawn-environ").items()
        if value is not None and name not in TUNED_MALLOC
    }
    neutral.setdefault("PYTHONHASHSEED", "6640")  # as the nanny sets it for spawned workers
    with _environ_restored([*TUNED_MALLOC, *neutral]):
        for name in TUNED_MALLOC:
            os.environ.pop(name, None)
        os.environ.update(neutral)
        multiprocessing.forkserver.ensure_running()  # no-op when it already runs
    _stop_fork_server_at_exit()


@functools.cache
def _stop_fork_server_at_exit() -> None:
    atexit.register(_stop_fork_server)


def _stop_fork_server() -> None:
    """Stop the fork server as this process exits, unless workers forked from it still run.
    By itself it sees its parent gone only once its imports are done: a process that exits
    before then (a run refused, interrupted or failed seconds after start_fork_server_early)
    would leave it running for seconds more, holding the stdout and stderr it inherited, which
    a caller reading them to the end waits on. Workers still running are their cluster's to
    close (in a script, Dask's exit hook runs after this one; the CLI closes its cluster before
    its last hook skips Dask's), and their nannies learn of their exit through the fork server:
    then it is left to exit by itself."""
    import psutil

    from workers.compat.cpython_private import forkserver_pid

    pid = forkserver_pid()  # no public handle on it
    if pid is None:
        return
    with contextlib.suppress(psutil.Error, ProcessLookupError, ChildProcessError):
        if psutil.Process(pid).children():
            return
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def start_fork_server_early(config: ClusterConfig) -> None:
    """Start the fork server that ``config``'s local workers will be forked from, without
    waiting for it. Its imports (torch and what ranks use: ~6 s of one core, most of a local
    cluster's start) then run beside the caller's own; the CLI calls this as soon as the config
    is read, before it imports torch itself. Nothing happens for an existing cluster or for
    workers that are spawned."""
    if not config.existing and _LocalWorkers.of(config).fork:
        ensure_fork_server()


@dataclass(frozen=True)
class _LocalWorkers:
    """What a local cluster is made of, worked out once from its config: ``gpus`` (0 for a
    CPU cluster), how many workers, each one's memory limit in bytes (None: no limit) and
    whether they are forked from the fork server."""

    gpus: int
    count: int
    memory: int | None
    fork: bool

    @classmethod
    def of(cls, config: ClusterConfig) -> "_LocalWorkers":
        from distributed.worker_memory import parse_memory_limit

        gpus = count_gpus() if config.kind in ("auto", "cuda") else 0
        count = config.n_workers or gpus or 2
        memory = parse_memory_limit(
            config.memory_limit, nthreads=1, total_cores=count, logger=logger
        )
        # A small worker is spawned: forked, it would start with torch loaded (~400 MB).
        fork = config.fork_workers and (not memory or memory >= FORK_MIN_MEMORY)
        return cls(gpus=gpus, count=count, memory=memory, fork=fork)


def count_gpus() -> int:
    """GPUs NVML can see: 0 on a machine without the NVIDIA driver's library (or without
    pynvml). Any other NVML failure (a driver that is not loaded, no permission, a GPU lost)
    raises :class:`NvmlError`: a GPU host that cannot be read must not quietly become a CPU
    cluster."""
    try:
        import pynvml
    except ImportError:
        return 0
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as error:
        return no_gpus_or_raise(error)
    try:
        return int(pynvml.nvmlDeviceGetCount())
    except pynvml.NVMLError as error:
        return no_gpus_or_raise(error)
    finally:
        with contextlib.suppress(pynvml.NVMLError):
            pynvml.nvmlShutdown()


class NvmlError(RuntimeError):
    """NVML is installed but failed: the GPUs of this host cannot be counted."""


def no_gpus_or_raise(error: Exception) -> int:
    """0 when ``error`` says the NVIDIA driver's library is missing (a machine without NVIDIA
    GPUs); otherwise raise an :class:`NvmlError` that names NVML's error."""
    import pynvml

    if isinstance(error, pynvml.NVMLError_LibraryNotFound):
        return 0
    raise NvmlError(
        f"cluster.kind: NVML could not count the GPUs: {type(error).__name__}: {error}; fix the "
        "NVIDIA driver, or set cluster.kind = 'cpu' to train without GPUs"
    ) from error


class TrainingCluster:
    """A Dask client plus, when we started it, the local cluster behind it.

    Made by `start_cluster`; a context manager that closes what it started. Pass it as
    ``cluster=`` to `launch`, `train`, `predict` and `sweep`.

    Attributes:
        client: The ``distributed.Client``.
        cluster: The local cluster started here, or ``None`` when connected to a scheduler.
        kind: ``"cuda"`` (a ``LocalCUDACluster``), ``"cpu"`` (a ``LocalCluster``) or
            ``"remote"``.
        config: The `ClusterConfig` it was made from.
    """

    def __init__(self, config: ClusterConfig) -> None:
        self.config = config
        self._config_scope: dask.config.set | None = None
        self.cluster: LocalCluster | None = None
        self.kind = "remote"
        _refuse_an_unguarded_script(local=not config.existing)
        security = build_security(config.security)
        try:
            if not config.existing:
                workers = _LocalWorkers.of(config)
                # Asked of the device policy, so that the GPU path needs no word of glibc.
                tuned = (
                    config.tune_malloc
                    and policy_for("cuda" if workers.gpus else "cpu").tunes_malloc
                )
                malloc = malloc_settings(workers.memory) if tuned else None
                if config.fork_workers and not workers.fork:
                    logger.info(
                        "workers of %d MB are spawned, not forked: a forked worker starts with "
                        "torch loaded (~400 MB)",
                        (workers.memory or 0) // 2**20,
                    )
                self._config_scope = dask.config.set(
                    worker_process_config(malloc=malloc, fork=workers.fork)
                )
                if workers.fork:
                    ensure_fork_server()
                # The nanny's own environment stays out of this process (_Nanny.instantiate).
                self.cluster, self.kind = _bounded(
                    lambda: _start_local(config, workers, security), config.start_timeout_s
                )
                self.client = Client(
                    self.cluster, timeout=config.connect_timeout_s, security=security
                )
            else:
                address = config.scheduler or _read_scheduler_file(
                    str(config.scheduler_file), config.connect_timeout_s
                )
                self.client = _connect(address, config.connect_timeout_s, security)
        except BaseException:
            self.close()
            raise

    @property
    def dashboard_link(self) -> str | None:
        """The Dask dashboard's URL; the Training page is at ``/training`` beside it."""
        return self.client.dashboard_link if hasattr(self, "client") else None

    @property
    def worker_addresses(self) -> list[str]:
        """The addresses of the workers alive now, sorted."""
        return sorted(live_workers(self.client))

    def close(self) -> None:
        """Close the client, and the local cluster when it was started here."""
        client = getattr(self, "client", None)
        if client is not None:
            client.close()
        if self.cluster is not None:
            # Dask closes each nanny within 5 s: 4 s for the worker to stop, then a SIGKILL and
            # what is left of the 5 s to reap it. On a loaded machine that last second is not
            # always enough, and the close raised TimeoutError after a finished run. The nannies
            # are closed first here, with a longer bound; the cluster's close then finds them
            # closed.
            nannies = [w for w in self.cluster.workers.values() if isinstance(w, Nanny)]
            self.cluster.sync(_close_nannies, nannies, NANNY_CLOSE_TIMEOUT_S)
            self.cluster.close()
            self.cluster = None
        if self._config_scope is not None:
            self._config_scope.__exit__(None, None, None)
            self._config_scope = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"TrainingCluster(kind={self.kind!r}, dashboard={self.dashboard_link!r})"


NANNY_CLOSE_TIMEOUT_S = 30.0


async def _close_nannies(nannies: list[Nanny], timeout_s: float) -> None:
    # Bounded as a whole too: a nanny whose worker never answers must not hold the close; the
    # cluster's own close then kills what is left.
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(
            asyncio.gather(*(nanny.close(timeout=timeout_s) for nanny in nannies)),
            timeout_s + 15,
        )


def start_cluster(config: ClusterConfig | None = None, **overrides: object) -> TrainingCluster:
    """Start (or connect to) the cluster described by ``config``; keyword overrides win.

    Without ``scheduler`` or ``scheduler_file`` it starts a local cluster: one worker per GPU
    that NVML sees, else 2 single-threaded CPU worker processes. Call it under
    ``if __name__ == "__main__":`` in a script.

    Args:
        config: A `ClusterConfig` (the ``[cluster]`` section); default all defaults.
        **overrides: `ClusterConfig` fields, e.g. ``n_workers=2``, ``dashboard_port=0`` or
            ``scheduler="tcp://host:8786"``.

    Returns:
        The client and, for a local cluster, the cluster; close it, or use it in ``with``.

    Raises:
        pydantic.ValidationError: An override is not a `ClusterConfig` field or not valid.
        ScriptWithoutMainGuard: Called while a worker process imports the script (the
            missing main guard).
        TimeoutError: A local cluster did not start within ``start_timeout_s``.
        ConnectionError: The scheduler (or its file) was not reached within
            ``connect_timeout_s``.
        NvmlError: NVML is installed but cannot count the GPUs.

    Example:
        ```python
        with start_cluster(n_workers=2, dashboard_port=0) as cluster:
            print(cluster.dashboard_link)
        ```
    """
    # Validated again as a whole, so overrides are checked (and nested sections may be dicts).
    config = ClusterConfig.model_validate({**(config or ClusterConfig()).model_dump(), **overrides})
    return TrainingCluster(config)


class ScriptWithoutMainGuard(RuntimeError):
    """start_cluster() ran while a worker process imported the user's script."""


GUARD_FIX = (
    'put the code that starts the cluster under if __name__ == "__main__": (Dask\'s worker '
    "processes import the main script again)"
)


def _refuse_an_unguarded_script(local: bool) -> None:
    """Fail at once when a script starts a cluster outside ``if __name__ == "__main__":``.

    Dask starts worker processes with multiprocessing's spawn, which runs the parent's main
    script again in each of them under the name ``__mp_main__``. Unguarded, every worker would
    start a cluster of its own while the parent waits minutes for workers that never come.
    Seen from a worker (the script's top level running as ``__mp_main__``), and, so that the
    parent stops at once too, from the parent: a call from the main script's top level that
    no ``__name__`` test encloses.
    """
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "<module>":
            name = frame.f_globals.get("__name__")
            if name == "__mp_main__":
                raise ScriptWithoutMainGuard(
                    f"start_cluster() was called while a worker process imported "
                    f"{frame.f_code.co_filename}: {GUARD_FIX}"
                )
            # spawn and forkserver both run the main script again in each worker process.
            spawns = dask.config.get("distributed.worker.multiprocessing-method") != "fork"
            if name == "__main__" and local and spawns:
                path = frame.f_globals.get("__file__")
                if path and _unguarded(path, frame.f_lineno):
                    raise ScriptWithoutMainGuard(
                        f"{path}, line {frame.f_lineno}: the cluster is started at the script's "
                        f"top level; {GUARD_FIX}"
                    )
        frame = frame.f_back


def _unguarded(path: str, line: int) -> bool:
    """Whether ``line`` of the script lies outside every ``if __name__ == "__main__":``."""
    try:
        tree = ast.parse(Path(path).read_text(), path)
    except (OSError, SyntaxError, ValueError):
        return False  # not a readable script (a zipapp, a frozen binary): nothing to say
    for node in ast.walk(tree):
        inside = isinstance(node, ast.If) and (
            node.body[0].lineno <= line <= (node.body[-1].end_lineno or line)
        )
        if inside and _tests_main(node.test):
            return False
    return True


def _tests_main(test: ast.expr) -> bool:
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1):
        return False
    sides = [test.left, test.comparators[0]]
    names = [s.id for s in sides if isinstance(s, ast.Name)]
    constants = [s.value for s in sides if isinstance(s, ast.Constant)]
    return names == ["__name__"] and constants == ["__main__"]


def _bounded(start: Callable[[], T], timeout_s: float) -> T:
    """``start()`` within ``timeout_s``, waited for in slices so Ctrl-C lands at once.

    LocalCluster's constructor has no timeout of its own, and a KeyboardInterrupt inside it
    would leave a half-started cluster that nothing holds. It runs in a thread here; when the
    wait ends early (timeout, Ctrl-C), whatever that thread still makes is closed by it.
    """
    outcome: dict[str, Any] = {}
    done = threading.Event()
    abandoned = threading.Event()

    def run() -> None:
        try:
            outcome["value"] = start()
        except BaseException as error:
            outcome["error"] = error
        done.set()
        if abandoned.is_set() and "value" in outcome:
            _close_quietly(outcome["value"])

    thread = threading.Thread(target=run, name="dask-train-cluster-start", daemon=True)
    thread.start()
    try:
        if not done.wait(timeout_s):
            raise TimeoutError(
                f"cluster.start_timeout_s: the local cluster did not start within "
                f"{timeout_s:g} s (a loaded machine may need more; see the log for the workers' "
                "errors)"
            )
    except BaseException:
        abandoned.set()
        if done.is_set() and "value" in outcome:
            _close_quietly(outcome["value"])
        raise
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def _close_quietly(started: Any) -> None:
    cluster = started[0] if isinstance(started, tuple) else started
    with contextlib.suppress(Exception):
        cluster.close(timeout=10)


@contextlib.contextmanager
def _environ_restored(keys: Iterable[str]) -> Iterator[None]:
    saved = {key: os.environ.get(key) for key in keys}
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


class _SpawnEnviron:
    """Undo what a nanny writes into this process's ``os.environ`` to spawn a worker.

    Dask's nanny copies its pre-spawn environment (our malloc settings, its PYTHONHASHSEED) into
    the environment of the process that holds it, here the client's, on every spawn: the first
    one and every restart. Left there, the values reach the client's own subprocesses and
    override the settings of any cluster started later in this process (``os.environ`` wins
    over the config). Several nannies spawn at once on one event loop, in any order, so the
    values from before the first of them are kept and put back when the last one is done.
    """

    _lock = threading.Lock()
    _spawning = 0
    _saved: dict[str, str | None] = {}

    @classmethod
    @contextlib.contextmanager
    def around(cls, keys: Iterable[str]) -> Iterator[None]:
        with cls._lock:
            for key in keys:
                cls._saved.setdefault(key, os.environ.get(key))
            cls._spawning += 1
        try:
            yield
        finally:
            with cls._lock:
                cls._spawning -= 1
                if cls._spawning == 0:
                    saved, cls._saved = cls._saved, {}
                    for key, value in saved.items():
                        if value is None:
                            os.environ.pop(key, None)
                        else:
                            os.environ[key] = value


class _Nanny(Nanny):
    """Dask's nanny, minus the environment it leaves behind in this process, and with time to
    reap a killed worker process."""

    async def kill(self, timeout: float = 5, reason: str = "nanny-kill") -> None:
        # Restarts (Client.restart, the launcher releasing a failed job's ranks) call this with
        # Dask's default of 5 s.
        worker_process = self.process
        try:
            await super().kill(timeout=timeout, reason=reason)
        except TimeoutError:
            # Dask raises this only once SIGKILL was sent and the process is still not reaped.
            process = getattr(worker_process, "process", None)
            if process is None:  # reaped and released meanwhile
                return
            try:
                await process.join(REAP_GRACE_S)  # raises TimeoutError past the bound
            except ValueError as error:  # reaped and closed meanwhile
                if "closed" not in str(error):
                    raise

    async def instantiate(self) -> Status:
        # Every start and restart of the worker process goes through here.
        with _SpawnEnviron.around([*self.pre_spawn_env, *TUNED_MALLOC]):
            return await super().instantiate()


def _start_local(
    config: ClusterConfig, workers: _LocalWorkers, security: Security | None
) -> tuple[LocalCluster, str]:
    dashboard = f"{config.dashboard_host}:{config.dashboard_port}"
    # Every connection, the workers' to each other included, over TLS when it is on.
    secured = {"security": security, "protocol": "tls://"} if security else {}
    if config.kind == "cuda" and workers.gpus == 0:
        raise RuntimeError("cluster.kind: 'cuda' was asked for, but NVML sees no GPU")
    if workers.gpus:
        from dask_cuda import LocalCUDACluster

        cluster = LocalCUDACluster(
            n_workers=workers.count,
            worker_class=_Nanny,
            threads_per_worker=1,
            memory_limit=config.memory_limit,
            dashboard_address=dashboard,
            **secured,
        )
        return cluster, "cuda"
    cluster = LocalCluster(
        n_workers=workers.count,
        threads_per_worker=1,
        processes=True,
        worker_class=_Nanny,
        memory_limit=config.memory_limit,
        dashboard_address=dashboard,
        **secured,
    )
    return cluster, "cpu"


def _read_scheduler_file(path: str, timeout_s: float) -> str:
    """The address in a scheduler file. A batch system may start the run before the scheduler
    has written it, so wait for it, within the connect timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with open(os.path.expanduser(path)) as file:
                return str(json.load(file)["address"])
        except (FileNotFoundError, ValueError, KeyError) as error:
            # ValueError/KeyError: the scheduler is still writing it.
            if time.monotonic() > deadline:
                reason = "no such file" if isinstance(error, FileNotFoundError) else "no address"
                raise ConnectionError(
                    f"cluster.scheduler_file: {path}: {reason} after waiting {timeout_s:g} s "
                    "(start the scheduler with --scheduler-file, or fix the path)"
                ) from None
            time.sleep(0.1)


def _connect(address: str, timeout_s: float, security: Security | None) -> Client:
    try:
        return Client(address, timeout=timeout_s, security=security)
    except TypeError as error:
        # Dask's way of saying that a tls:// address came without certificates.
        if "ssl_context" not in str(error):
            raise
        raise ConnectionError(
            f"cluster.security: the scheduler at {address} uses TLS; give "
            "cluster.security.tls_ca_file, tls_cert and tls_key (or Dask's distributed.comm.tls "
            "settings)"
        ) from error
    except (OSError, TimeoutError) as error:
        raise ConnectionError(
            f"cluster.scheduler: could not reach the scheduler at {address} within "
            f"{timeout_s:g} s ({error})"
        ) from error


def most_workers(client: Client) -> int | None:
    """The most workers ``client``'s cluster can ever have: a local cluster's size, or its
    adaptive maximum; None for a cluster we did not start (it may grow)."""
    cluster = getattr(client, "cluster", None)
    if cluster is None or not hasattr(cluster, "worker_spec"):
        return None
    adaptive = adaptive_of(cluster)
    if adaptive is not None and getattr(adaptive, "state", None) in ("starting", "running"):
        maximum = adaptive.maximum
        return None if maximum == math.inf else int(maximum)
    return len(cluster.worker_spec)


class WorkersGone(RuntimeError):
    """Every worker that some tasks were bound to left the cluster."""


# How often a wait on tasks bound to some workers asks whether any of them is still there.
WORKERS_CHECK_S = 1.0


def wait_on_workers(
    client: Client, futures: Sequence[Future], workers: Collection[str], *, timeout_s: float
) -> None:
    """Wait for ``futures``, whose tasks only ``workers`` may run: ``TimeoutError`` after
    ``timeout_s``. Dask holds such a task while none of them is there (one killed for good, or
    restarted by its nanny at another address) until that bound, an hour for some callers; so
    once none is left this raises :class:`WorkersGone` within ``WORKERS_CHECK_S``."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        try:
            wait_futures(futures, timeout_s=max(0.0, min(WORKERS_CHECK_S, left)))
            return
        except TimeoutError:
            if left <= WORKERS_CHECK_S:
                raise
        if not set(workers) & set(live_workers(client)):
            raise WorkersGone(f"{', '.join(sorted(workers))} left the cluster")


def live_workers(client: Client) -> dict[str, dict]:
    """The scheduler's current view of its workers: address -> identity.

    Asks the scheduler on every call. ``Client.scheduler_info()`` returns a cache that the
    client's own periodic refresh overwrites with a worker-less summary, so reading it can
    show a live worker as gone.
    """
    return client.sync(client.scheduler.identity, n_workers=-1)["workers"]
