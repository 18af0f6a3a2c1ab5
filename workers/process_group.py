"""The worker plugin that holds a worker's torch.distributed membership.

One generation of a process group is one registration of :class:`ProcessGroupPlugin`, under a
name of its job's (``dask-train-process-group-<job id>``): jobs sharing a cluster never replace
or tear down each other's groups. Registering a job's next generation under that name makes
Dask tear the old one down first, so a job can bootstrap again and again on a warm cluster.
"""

import asyncio
import contextlib
import ctypes
import functools
import logging
import os
import queue
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import psutil
from distributed import Status, Worker, WorkerPlugin, get_worker
from distributed.comm import get_address_host_port

from workers import elastic
from workers.compat.distributed_private import running_task_keys

# torch is imported where it is used: the client imports this module (through the launcher and
# the config) to check a config, and that must not cost torch's seconds-long import.
if TYPE_CHECKING:
    import torch
    import torch.distributed

logger = logging.getLogger(__name__)

PLUGIN_PREFIX = "dask-train-process-group"
BACKENDS = ("gloo", "nccl")
CLOSING = frozenset({Status.closing, Status.closing_gracefully})
# gloo reads its variable for every group it makes (a device mesh's subgroups too), so it must
# stay set while the group lives; nccl may make gloo groups as well, so both are set.
SOCKET_IFNAME_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
LEAVE_TIMEOUT_S = 30.0
HAND_OFF_POLL_S = 0.01
# How long a stop that a finalizer dropped waits before it is raised again: the rank leaves
# the finalizer in microseconds; under load it may not have run since.
RESTOP_DELAY_S = 0.01


@dataclass(frozen=True)
class ProcessGroupSpec:
    """Everything a worker needs to join one generation of the group."""

    generation: str
    ranks: dict[str, int]  # worker address -> rank
    master_addr: str
    master_port: int
    backend: str
    init_timeout_s: float
    collective_timeout_s: float
    local_ranks: dict[str, int] = field(default_factory=dict)
    # Hosts in rank order: a worker's node rank is its host's place, its local world size the
    # number of ranks on that host (torchrun's GROUP_RANK and LOCAL_WORLD_SIZE).
    hosts: dict[str, str] = field(default_factory=dict)
    # A worker restarted at the same address is another process: it must not take the rank.
    worker_ids: dict[str, str] = field(default_factory=dict)
    socket_ifname: str | None = None  # the interface the backend's traffic uses on every rank
    job_id: str = ""  # the job this group belongs to: its plugin is named for it
    # An elastic job's rank hands off at its next step boundary when its worker closes
    # gracefully, within this bound (then it is stopped, as on any teardown).
    elastic: bool = False
    leave_timeout_s: float = 60.0

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def plugin_name(self) -> str:
        return plugin_name(self.job_id)

    def node_rank(self, address: str) -> int:
        ordered = list(dict.fromkeys(self.hosts[a] for a in sorted(self.ranks, key=self.ranks.get)))
        return ordered.index(self.hosts[address]) if address in self.hosts else 0

    def local_world_size(self, address: str) -> int:
        if address not in self.hosts:
            return 1
        return sum(host == self.hosts[address] for host in self.hosts.values())

    def validate(self) -> None:
        if sorted(self.ranks.values()) != list(range(len(self.ranks))):
            raise ValueError(f"ranks must be 0..{len(self.ranks) - 1}, got {self.ranks}")
        if self.backend not in BACKENDS:
            raise ValueError(f"launch.backend: {self.backend!r} is not one of {BACKENDS}")
        if not 0 < self.master_port < 65536:
            raise ValueError(f"master_port {self.master_port} is not a TCP port")
        if self.init_timeout_s <= 0 or self.collective_timeout_s <= 0:
            raise ValueError("timeouts must be positive")


@dataclass(frozen=True)
class Membership:
    """What a rank's code sees of the group it runs in."""

    generation: str
    rank: int
    local_rank: int
    world_size: int
    backend: str
    device: "torch.device"
    local_world_size: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"


class RendezvousTimeout(TimeoutError):
    pass


class MembershipLost(RuntimeError):
    """This worker no longer holds the job's generation: the group was replaced or the worker
    restarted. Always an infrastructure failure, never a bug in the training code."""


class RankStopped(BaseException):
    """Raised inside a rank's thread when the launcher stops the job (a failure elsewhere,
    Ctrl-C). A BaseException, so that training code's ``except Exception`` cannot swallow it."""


def plugin_name(job_id: str) -> str:
    """The name a job's process-group plugin is registered under."""
    return f"{PLUGIN_PREFIX}-{job_id}" if job_id else PLUGIN_PREFIX


class ProcessGroupPlugin(WorkerPlugin):
    """Joins the worker to the process group in ``setup`` and leaves it in ``teardown``.

    Workers not named in the spec (one that joined the cluster later, or a restarted worker with a
    new address) do nothing: they must never try to rendezvous alone. A teardown while the job's
    ranks still run (its client went away and the scheduler dropped its hold) stops them first.
    """

    def __init__(self, spec: ProcessGroupSpec) -> None:
        spec.validate()  # on the client, before anything is sent
        self.spec = spec
        self.name = spec.plugin_name
        self.membership: Membership | None = None
        self._saved_environ: dict[str, str | None] | None = None
        # The backend's connections to the other ranks (socket inodes), closed when leaving.
        self._connections: frozenset[str] = frozenset()
        self._sigterm_loop: asyncio.AbstractEventLoop | None = None
        self._closing: asyncio.Future[None] | None = None  # the close a SIGTERM started

    async def setup(self, worker: Worker) -> None:
        address = worker.address
        if address not in self.spec.ranks:
            return
        if self.spec.worker_ids and self.spec.worker_ids.get(address) != worker.id:
            return
        # init_process_group blocks until every rank arrived; in the event loop that would stall
        # heartbeats and get the worker restarted, so it runs in a thread with a bound.
        # Dask's own connections, made by other threads while the group forms, are not the
        # backend's: they are told apart from its connections by their endpoints.
        dask_ports = {_port(a) for a in (worker.address, worker.scheduler.address, worker.nanny)}
        try:
            await asyncio.wait_for(
                asyncio.to_thread(self._join, address, dask_ports),
                # Connecting to the store and the backend's own rendezvous each have the bound.
                timeout=2 * self.spec.init_timeout_s + 10,
            )
        except TimeoutError as error:
            raise RendezvousTimeout(self._timeout_message(self.spec.ranks[address])) from error
        if self.spec.elastic:
            self.handle_sigterm(worker)

    def _join(self, address: str, dask_ports: set[int | None]) -> None:
        # Its functions take ``group=group.WORLD`` as a default argument: imported while a group
        # exists (torch._dynamo imports it, and torch.distributed.checkpoint that), they would
        # hold that group forever, and gloo closes its connections only when the group is freed.
        # Imported before any group, the default is None.
        import torch.distributed.nn.functional  # noqa: F401

        from workers.device_policy import this_worker

        spec = self.spec
        rank = spec.ranks[address]
        self._leave_an_earlier_group(address)
        # Before this generation's group, store and sockets exist: frozen, what of them is in a
        # reference cycle would never be freed (workers/between_jobs.py).
        this_worker().freeze_what_jobs_imported()
        device = self._device(address, rank)
        if spec.socket_ifname is not None:
            self._saved_environ = {name: os.environ.get(name) for name in SOCKET_IFNAME_VARIABLES}
            os.environ.update(dict.fromkeys(SOCKET_IFNAME_VARIABLES, spec.socket_ifname))
        try:
            store = self._connect_store(rank)
            before = set(_sockets().values())
            self._form_group(rank, device, store)
        except (RuntimeError, TimeoutError) as error:  # torch's DistStoreError is a RuntimeError
            self._restore_environ()
            if "timeout" in str(error).lower() or "timed out" in str(error).lower():
                raise RendezvousTimeout(self._timeout_message(rank)) from error
            raise
        except BaseException:
            self._restore_environ()
            raise
        self._store = store  # keep the TCP server of rank 0 alive for the group's lifetime
        if spec.backend == "gloo":  # nccl's sockets are its own business (and abort works)
            self._connections = _connections_since(
                before, exclude_ports={spec.master_port, *dask_ports}
            )
        self.membership = Membership(
            generation=spec.generation,
            rank=rank,
            local_rank=spec.local_ranks.get(address, 0),
            world_size=spec.world_size,
            backend=spec.backend,
            device=device,
            local_world_size=spec.local_world_size(address),
            node_rank=spec.node_rank(address),
            master_addr=spec.master_addr,
        )

    def _leave_an_earlier_group(self, address: str) -> None:
        """Leave a group this process still holds from an earlier generation; refuse to join
        while another job's rank holds it."""
        import torch.distributed as dist

        if not dist.is_initialized():
            return
        held = [p for p in _group_plugins() if p is not self and p.membership is not None]
        if held:
            # The queue gives a worker to one job at a time; torch has one default group per
            # process, so a second job here would take the first one's.
            raise RuntimeError(
                f"worker {address} already holds rank {held[0].membership.rank} of job "
                f"{held[0].spec.job_id}: a worker runs one rank of one job at a time"
            )
        # A previous generation whose teardown never ran (its worker plugin was replaced while
        # a job still held it): leave it before joining the new one.
        dist.destroy_process_group()

    def _device(self, address: str, rank: int) -> "torch.device":
        """The device this worker's rank runs on; for nccl, made CUDA's current one."""
        import torch

        from workers.devices import local_device

        device = local_device(self.spec.local_ranks.get(address, 0))
        if self.spec.backend == "nccl":
            if device.type != "cuda":
                raise RuntimeError(
                    f"launch.backend: nccl needs a CUDA device, but worker rank {rank} has none; "
                    "use backend = 'gloo' or 'auto'"
                )
            torch.cuda.set_device(device)
        return device

    def _connect_store(self, rank: int) -> "torch.distributed.TCPStore":
        """Rank 0's store: served by rank 0, reached by the others."""
        import torch.distributed as dist

        spec = self.spec
        connect_s = spec.init_timeout_s
        if rank != 0:
            # torch's store client waits 250-750 ms before trying again when rank 0's server is
            # not listening yet: a warm job's whole first step is ~0.1 s.
            connect_s = _wait_until_listening(spec.master_addr, spec.master_port, connect_s)
        return dist.TCPStore(
            spec.master_addr,
            spec.master_port,
            world_size=spec.world_size,
            is_master=rank == 0,
            timeout=timedelta(seconds=connect_s),
            wait_for_workers=False,
            # torch's own server would listen on every interface: the store, which anyone who
            # reaches it may read and write, listens only where the peers reach rank 0.
            master_listen_fd=_listen_at(spec.master_addr, spec.master_port) if rank == 0 else None,
        )

    def _form_group(
        self, rank: int, device: "torch.device", store: "torch.distributed.TCPStore"
    ) -> None:
        """Meet the other ranks at the store and form this generation's group."""
        import torch.distributed as dist

        spec = self.spec
        # Connecting the ranks uses the group's timeout, so the group starts with the
        # rendezvous bound and gets the (longer) collective bound once everyone is in. torch
        # before 2.12 cannot change it afterwards: there the group has the collective bound
        # from the start, and the store's timeout still bounds the rendezvous.
        set_timeout = getattr(dist, "set_timeout", None)
        dist.init_process_group(
            spec.backend,
            store=dist.PrefixStore(f"dask-train/{spec.generation}", store),
            rank=rank,
            world_size=spec.world_size,
            timeout=timedelta(
                seconds=spec.init_timeout_s if set_timeout else spec.collective_timeout_s
            ),
            device_id=device if spec.backend == "nccl" else None,
        )
        if set_timeout is not None:
            set_timeout(timedelta(seconds=spec.collective_timeout_s))

    def _timeout_message(self, rank: int) -> str:
        return (
            f"process group rendezvous timed out after {self.spec.init_timeout_s:g} s on rank "
            f"{rank}: not all {self.spec.world_size} ranks reached "
            f"{self.spec.master_addr}:{self.spec.master_port} (raise launch.init_timeout_s, or "
            "check that the workers can reach each other)"
        )

    def _restore_environ(self) -> None:
        # The worker outlives the group: the next generation may use another interface, or none.
        saved, self._saved_environ = self._saved_environ, None
        for name, value in (saved or {}).items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value

    async def teardown(self, worker: Worker) -> None:
        self._stop_handling_sigterm()
        if self.membership is not None and worker.status in CLOSING and self.spec.elastic:
            await self._hand_off()
        if self.membership is not None and rank_threads.stop(self.spec.generation):
            self.disconnect()  # a rank waiting in a collective fails now, then sees the stop
        await self.leave()

    async def _hand_off(self) -> None:
        """The worker closes gracefully (retired, scaled down, SIGTERM): its rank stops with
        the others at the job's next step boundary, its state kept by them, before it goes."""
        generation = self.spec.generation
        elastic.leaving(generation)
        deadline = time.monotonic() + self.spec.leave_timeout_s
        while rank_threads.running_now(generation) and time.monotonic() < deadline:
            await asyncio.sleep(HAND_OFF_POLL_S)
        if rank_threads.running_now(generation):
            logger.warning(
                "rank of %s did not reach a step boundary within launch.leave_timeout_s = %g s; "
                "stopping it",
                self.spec.job_id,
                self.spec.leave_timeout_s,
            )

    def handle_sigterm(self, worker: Worker) -> None:
        """A SIGTERM (a spot instance's notice) closes the worker gracefully: the scheduler
        retires it, and the rank hands off first (``_hand_off``). Only while an elastic
        job's rank is here, and only where nothing else handles the signal (``dask worker``
        does, closing the worker, which hands the rank off all the same)."""
        if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
            return
        loop = asyncio.get_running_loop()

        def closing() -> None:
            logger.warning("SIGTERM: closing worker %s gracefully", worker.address)
            self._closing = asyncio.ensure_future(worker.close_gracefully(reason="SIGTERM"))

        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            # Not the main thread, or a loop without signal support: the default stays.
            loop.add_signal_handler(signal.SIGTERM, closing)
            self._sigterm_loop = loop

    def _stop_handling_sigterm(self) -> None:
        loop, self._sigterm_loop = self._sigterm_loop, None
        if loop is not None:
            with contextlib.suppress(Exception):
                loop.remove_signal_handler(signal.SIGTERM)

    async def leave(self) -> None:
        """Leave the group (if joined) and restore the environment; safe to call twice."""
        if self.membership is not None:
            self.membership = None
            connections, self._connections = self._connections, frozenset()
            # Bounded: destroying a group whose peers are gone only closes local sockets.
            await asyncio.wait_for(asyncio.to_thread(_leave, connections), timeout=LEAVE_TIMEOUT_S)
        self._restore_environ()

    def disconnect(self) -> int:
        """End the backend's connections to the other ranks now, which makes every pending and
        later collective of this generation fail here and on the peers; returns how many.

        The rendezvous store's connections too: a group made after this one (the checkpoint
        writers', made at the first save) waits there for every rank's address, and a peer
        stopped before it came would keep this rank waiting for the group's timeout (seen in
        runs stopped as they wrote their first checkpoint: held until the launcher restarted
        the worker, 19 s)."""
        if self.spec.backend != "gloo":
            return 0
        return _shut_down(self._connections | _connections_at(self.spec.master_port))


def _leave(connections: frozenset[str]) -> None:
    import torch.distributed as dist

    # gloo closes its connections only when the group object is freed, and anything may still
    # hold it: a traceback whose frames hold a DDP model, a module that took the group as a
    # default argument. Its peers' collectives fail only once they are closed. First: freeing
    # the group waits for the collectives it has begun, which may wait for a peer that waits
    # for this rank (measured: a peer in the checkpoint's barrier held 15 s, until restarted).
    _shut_down(connections)
    if dist.is_initialized():
        dist.destroy_process_group()


def _listen_at(host: str, port: int) -> int:
    """A socket listening on ``host:port`` only (an interface's address, 127.0.0.1 on a local
    cluster), for rank 0's store: its file descriptor, which the store owns from then on."""
    family, kind, protocol, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    listener = socket.socket(family, kind, protocol)
    try:
        # As torch's own server: a port whose last store's connections are in TIME_WAIT binds.
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(address)
        listener.listen(socket.SOMAXCONN)
    except OSError as error:
        listener.close()
        raise RuntimeError(
            f"rank 0 cannot listen for the rendezvous at {host}:{port} "
            f"({error.strerror or error}); launch.master_addr must be an address of rank 0's "
            "host"
        ) from None
    return listener.detach()


def _wait_until_listening(host: str, port: int, timeout_s: float) -> float:
    """Wait until ``host:port`` accepts a connection, ``timeout_s`` at most; returns what is
    left of it (the store's own connect gets that, and reports a failure naming the bound)."""
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        try:
            with socket.create_connection((host, port), timeout=min(left, 1.0)):
                return max(left, 1.0)
        except OSError:
            time.sleep(0.005)
    return 1.0


def _port(address: str | None) -> int | None:
    with contextlib.suppress(ValueError, TypeError):
        return get_address_host_port(address)[1]
    return None


def _sockets() -> dict[int, str]:
    """This process's open sockets: file descriptor -> ``socket:[inode]`` (Linux; elsewhere
    none, and the connections are left to the group's destruction)."""
    found = {}
    with contextlib.suppress(OSError):
        for name in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                link = os.readlink(f"/proc/self/fd/{name}")
                if link.startswith("socket:["):
                    found[int(name)] = link
    return found


def _connections_since(
    before: set[str], *, exclude_ports: set[int | None], only_port: int | None = None
) -> frozenset[str]:
    """The connected TCP sockets opened since ``before``, but for those with a port in
    ``exclude_ports`` at either end (the rendezvous store, Dask's own), and, given
    ``only_port``, only those with it at either end. Listening sockets are left out: shutting
    gloo's listener down makes its thread abort the process."""
    connections = set()
    for fd, inode in _sockets().items():
        if inode in before:
            continue
        with _duplicate(fd, inode) as sock:
            if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                continue
            try:
                ports = {sock.getsockname()[1], sock.getpeername()[1]}
            except OSError:
                continue  # not connected
            if not ports & exclude_ports and (only_port is None or only_port in ports):
                connections.add(inode)
    return frozenset(connections)


def _connections_at(port: int) -> frozenset[str]:
    """This process's connected TCP sockets with ``port`` at either end (a store's clients,
    and its server's side of them where it runs here); listening sockets are left out."""
    return _connections_since(set(), exclude_ports=set(), only_port=port)


def _shut_down(connections: frozenset[str]) -> int:
    """Shut down the connections among ``connections`` that are still open; returns how many."""
    done = 0
    if not connections:
        return done
    for fd, inode in _sockets().items():
        if inode not in connections:
            continue
        with _duplicate(fd, inode) as sock:
            if sock is not None:
                with contextlib.suppress(OSError):  # already shut down, or reset by the peer
                    sock.shutdown(socket.SHUT_RDWR)
                    done += 1
    return done


@contextlib.contextmanager
def _duplicate(fd: int, inode: str) -> Iterator[socket.socket | None]:
    """A duplicate of ``fd``, or None when the descriptor no longer holds that socket (closed,
    and maybe reused, since it was listed). Shutting a duplicate down ends the connection;
    closing it does not."""
    try:
        duplicate = os.dup(fd)
    except OSError:
        yield None
        return
    try:
        if f"socket:[{os.fstat(duplicate).st_ino}]" != inode:
            yield None
            return
        sock = socket.socket(fileno=duplicate)
    except OSError:
        os.close(duplicate)
        yield None
        return
    with sock:
        yield sock


def _group_plugins(worker: Worker | None = None) -> list[ProcessGroupPlugin]:
    """This worker's process-group plugins (one per job that registered one)."""
    plugins = (worker or get_worker()).plugins.values()
    return [plugin for plugin in plugins if isinstance(plugin, ProcessGroupPlugin)]


def _plugin_of(generation: str, worker: Worker | None = None) -> ProcessGroupPlugin | None:
    found = [p for p in _group_plugins(worker) if p.spec.generation == generation]
    return found[0] if found else None


def current_membership(generation: str) -> Membership:
    """The membership of the worker running this task, checked against the job's generation."""
    worker = get_worker()
    plugin = _plugin_of(generation, worker)
    membership = getattr(plugin, "membership", None)
    if membership is None or membership.generation != generation:
        held = [p.membership.generation for p in _group_plugins(worker) if p.membership]
        held = held[0] if held else None
        raise MembershipLost(
            f"worker {worker.address} is not a member of process group generation {generation} "
            f"(it holds {held}); the group was replaced or this worker restarted"
        )
    return membership


def describe_worker(socket_ifname: str | None = None, *, dask_worker: Worker) -> dict[str, object]:
    """What the launcher needs to know about a worker before assigning it a rank (run with
    ``Client.run``, which passes the worker in): its interfaces, and with ``socket_ifname`` the
    IPv4 address of the first named one, where its peers reach it when it is rank 0."""
    import torch

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("", 0))
        free_port = probe.getsockname()[1]
    interfaces = psutil.net_if_addrs()
    ifname_address = None
    if socket_ifname is not None:
        first = socket_ifname.split(",")[0]
        ipv4 = [a.address for a in interfaces.get(first, []) if a.family == socket.AF_INET]
        ifname_address = ipv4[0] if ipv4 else None
    return {
        "cuda_devices": torch.cuda.device_count(),
        "free_port": free_port,
        "worker_id": dask_worker.id,
        "memory_limit": dask_worker.memory_manager.memory_limit,  # bytes; None: no limit
        "interfaces": sorted(interfaces),
        "ifname_address": ifname_address,
    }


class _RankThreads:
    """The threads of this worker that are inside a rank function, by generation.

    Only such a thread is ever stopped with an asynchronous exception, and at most once: one
    raised in Dask's own task machinery (after the function returned) would corrupt the
    worker's bookkeeping.

    Nor while it starts a thread: CPython 3.11 makes the new thread's state with its
    creator's id, which it keeps until the new thread runs, and ``PyThreadState_SetAsyncExc``
    raises in the first state with the id, the newest. A stop sent then killed the new thread
    as it started, not the rank (seen in runs stopped as they started a checkpoint: the writer
    died unstarted, the rank went on and its peer waited in a collective until the launcher
    restarted them, 19 s). So a rank's ``Thread.start`` is marked
    (``_guard_thread_starts``), and a stop that finds it there is raised by the rank itself
    once the new thread runs.

    Nor lost in a finalizer: a stop that lands while the rank runs a weakref callback or a
    ``__del__`` (torch's ``WeakIdKeyDictionary`` has one per tensor that autograd tracked; a
    stop after Ctrl-C hit it under load) is dropped by CPython, which prints "Exception
    ignored in ..." through ``sys.unraisablehook``. The worker of a local cluster writes to the
    user's terminal, and the rank went on training until the launcher killed its worker. So
    the hook (:meth:`_on_unraisable`) prints no ``RankStopped``, and raises it again in a rank
    still inside its stopped function once it has left the finalizer.
    """

    # The generations stopped here, newest last: a rank of one that starts after its stop (its
    # task began while the job was torn down, a client killed) is stopped as it starts, where
    # no stop would reach it any more.
    STOPPED_KEPT = 1024

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._threads: dict[int, str] = {}  # thread ident -> generation
        self._stopped: dict[str, None] = {}  # an ordered set
        self._starting: set[int] = set()  # rank threads inside Thread.start
        self._deferred: set[int] = set()  # of those, the ones stopped meanwhile
        # Stopped threads still inside their rank function: where a stop that a finalizer
        # dropped is raised again.
        self._stopping: set[int] = set()
        self._previous_unraisablehook: Callable[[Any], object] | None = None
        # The threads whose stop a finalizer dropped, for _raise_dropped_stops.
        self._dropped: queue.SimpleQueue[int] = queue.SimpleQueue()

    @contextlib.contextmanager
    def running(self, generation: str) -> Iterator[None]:
        _guard_thread_starts()
        self._catch_dropped_stops()
        ident = threading.get_ident()
        with self._lock:
            if generation in self._stopped:
                raise RankStopped(f"process group generation {generation} was stopped")
            self._threads[ident] = generation
        try:
            yield
        finally:
            with self._lock:
                self._threads.pop(ident, None)
                self._starting.discard(ident)  # left by a stop that landed inside the mark
                self._deferred.discard(ident)
                self._stopping.discard(ident)  # no stop is raised again from here on
            # A stop that arrived as the function ended must not fire in Dask's code.
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident), None)

    def running_now(self, generation: str) -> bool:
        """Whether a thread of this worker is inside a rank function of ``generation``."""
        with self._lock:
            return generation in self._threads.values()

    def stop(self, generation: str) -> int:
        """Raise :class:`RankStopped` in this generation's threads; returns how many."""
        with self._lock:
            self._stopped[generation] = None
            while len(self._stopped) > self.STOPPED_KEPT:
                del self._stopped[next(iter(self._stopped))]
            targets = [ident for ident, g in self._threads.items() if g == generation]
            for ident in targets:
                self._raise_stop(ident)
                del self._threads[ident]
                self._stopping.add(ident)
        return len(targets)

    def _raise_stop(self, ident: int) -> None:
        """Under the lock: raise :class:`RankStopped` in the rank thread ``ident``."""
        if ident in self._starting:
            self._deferred.add(ident)  # raised by the thread once its new one runs
        else:
            # Raised at the thread's next Python instruction: a rank inside a C call (a
            # collective) sees it once that call returns, which its peers leaving makes happen.
            ctypes.pythonapi.PyThreadState_SetAsyncExc(
                ctypes.c_ulong(ident), ctypes.py_object(RankStopped)
            )

    def _catch_dropped_stops(self) -> None:
        """Put :meth:`_on_unraisable` in front of ``sys.unraisablehook``, once a process, and
        start the thread that raises dropped stops again."""
        with self._lock:
            if self._previous_unraisablehook is not None:
                return
            self._previous_unraisablehook = sys.unraisablehook
            sys.unraisablehook = self._on_unraisable
        # One thread for the process, started here: the hook runs in the rank, which must not
        # start one there (a stop raised meanwhile would be deferred into the hook, and lost).
        threading.Thread(
            target=self._raise_dropped_stops, name="dask-train-stops", daemon=True
        ).start()

    def _on_unraisable(self, unraisable: Any) -> None:
        """A stop that landed in a finalizer: CPython drops it. Not printed, whatever the
        thread (it is ours, and expected: the job was stopped); a rank still inside its stopped
        function has it raised again by :meth:`_raise_dropped_stops` (raised here, in the hook,
        it would be dropped too). Every other unraisable goes to the hook before. Kept short:
        a stop raised again while the rank is still in here would be printed and dropped."""
        if issubclass(unraisable.exc_type, RankStopped):
            self._dropped.put(threading.get_ident())
            return
        previous = self._previous_unraisablehook or sys.__unraisablehook__
        previous(unraisable)

    def _raise_dropped_stops(self) -> None:
        while True:
            ident = self._dropped.get()
            # Once the rank has left the finalizer and the hook; should the stop land in
            # another finalizer, the hook sees it again.
            time.sleep(RESTOP_DELAY_S)
            with self._lock:
                if ident in self._stopping:  # not if its rank function is over
                    self._raise_stop(ident)

    @contextlib.contextmanager
    def starting_a_thread(self) -> Iterator[None]:
        """Around ``Thread.start``: a rank thread is not stopped inside, but right after."""
        ident = threading.get_ident()
        with self._lock:
            # A stopped one too: its stop may be raised again (``_raise_dropped_stops``).
            rank = ident in self._threads or ident in self._stopping
            if rank:
                self._starting.add(ident)
        if not rank:
            yield
            return
        try:
            yield
        finally:
            with self._lock:
                self._starting.discard(ident)
                stopped = ident in self._deferred
                self._deferred.discard(ident)
        if stopped:
            raise RankStopped("the job was stopped while this rank started a thread")


rank_threads = _RankThreads()


@functools.cache
def _guard_thread_starts() -> None:
    """Once per process: every ``threading.Thread.start`` goes through
    :meth:`_RankThreads.starting_a_thread` (a dictionary lookup for a thread that runs no
    rank)."""
    start = threading.Thread.start

    @functools.wraps(start)
    def guarded_start(thread: threading.Thread) -> None:
        with rank_threads.starting_a_thread():
            start(thread)

    threading.Thread.start = guarded_start  # type: ignore[method-assign]


def running_tasks(*, dask_worker: Worker) -> list[str]:
    """The keys of the tasks this worker runs now, seceded ones too (run with ``Client.run``,
    which a paused worker still answers)."""
    return [str(key) for key in running_task_keys(dask_worker)]


async def release_generation(
    generation: str, stop: bool = False, *, dask_worker: Worker
) -> dict[str, object]:
    """Let go of one generation on this worker (run with ``Client.run``, in its event loop).

    gloo cannot abort a collective that is already waiting (``ProcessGroup.abort()`` returns,
    the wait goes on), nor close its connections while anything still holds the group; what
    ends the wait is a connection shut down. So a worker whose rank task is over leaves the
    group and shuts its connections down, which makes its peers' pending collectives fail at
    once; a worker whose task still runs is told to stop (``stop``, for rank functions of
    :func:`workflows.launch`), shuts its own connections down so that a collective it waits
    in fails now, and reports itself busy, and the launcher asks again. Returns
    ``{"busy": bool, "writing": bool}``: ``writing``, whether a checkpoint write that may still
    be committed goes on here (``workers.checkpoint.writing``), which a job stopped for good
    waits for; a rank busy with anything else by then waits where gloo does not wake it.
    """
    plugin = _plugin_of(generation, dask_worker)
    membership = getattr(plugin, "membership", None)
    member = membership is not None and membership.generation == generation
    if stop:
        rank_threads.stop(generation)
    running = [key for key in running_task_keys(dask_worker) if generation in str(key)]
    if running:
        if stop and member:
            # The stop lands once the thread is back in Python code; a rank waiting in a
            # collective would otherwise wait for its peers to leave (and one that entered it
            # after they left, or whose peer's group lingers, for its whole timeout). Ending
            # this worker's connections fails that collective now.
            plugin.disconnect()
        from workers.checkpoint import writing  # torch: imported already, a rank runs here

        return {"busy": True, "writing": writing()}
    if member:
        # Leaving closes the backend's sockets; no rank of this generation runs here any more.
        await plugin.leave()
    return {"busy": False, "writing": False}
