"""Process-group bootstrap over real worker processes with gloo."""

import ipaddress
import logging
import os
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch
import torch.distributed as dist

from tests.commands import run_python
from workers.process_group import (
    ProcessGroupPlugin,
    ProcessGroupSpec,
    current_membership,
)
from workflows import launch
from workflows.cluster.training_cluster import start_cluster
from workflows.jobs.launcher import (
    JobStopped,
    LaunchConfig,
    LaunchError,
    ProcessGroup,
    RankFailed,
    RankWatch,
)


def _all_reduce_probe(generation: str) -> dict[str, object]:
    membership = current_membership(generation)
    value = torch.tensor([float(membership.rank + 1)])
    dist.all_reduce(value)
    return {
        "rank": membership.rank,
        "world_size": dist.get_world_size(),
        "sum": value.item(),
        "backend": dist.get_backend(),
    }


def test_ranks_world_size_and_all_reduce_twice_on_one_cluster(cluster):
    generations = []
    for _ in range(2):
        with ProcessGroup(cluster.client, LaunchConfig(world_size=2)) as group:
            results = group.run(_all_reduce_probe, group.spec.generation)
            generations.append(group.spec.generation)
        assert [r["rank"] for r in results] == [0, 1]
        assert all(r["world_size"] == 2 for r in results)
        assert all(r["sum"] == 3.0 for r in results)  # 1 + 2
        assert all(r["backend"] == "gloo" for r in results)
    assert generations[0] != generations[1]


def test_ranks_follow_the_worker_list_and_master_is_rank0s_host(cluster):
    with ProcessGroup(cluster.client, LaunchConfig(world_size=2)) as group:
        spec = group.spec
        assert sorted(spec.ranks.values()) == [0, 1]
        assert spec.master_addr == "127.0.0.1"
        assert spec.master_port > 0
        assert spec.local_ranks == {group.workers[0]: 0, group.workers[1]: 1}


# A cluster started here has a known size: more ranks than it can have fail at once, not after
# launch.worker_wait_s (a remote cluster's wait is tests/test_multihost.py's).
@pytest.mark.timeout(60)
def test_more_ranks_than_workers_fails_fast_with_the_field_named(cluster):
    with pytest.raises(
        LaunchError, match=r"launch.world_size: 3 workers are needed.*has 2 and can have no more"
    ):
        ProcessGroup(cluster.client, LaunchConfig(world_size=3, worker_wait_s=600)).start()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has GPUs")
def test_nccl_without_gpus_is_refused_before_anything_starts(cluster):
    with pytest.raises(LaunchError, match=r"launch\.backend: nccl needs a GPU"):
        ProcessGroup(cluster.client, LaunchConfig(world_size=2, backend="nccl")).start()


def test_rendezvous_with_a_missing_rank_times_out_with_a_message(own_cluster):
    # Rank 1 names an address where no worker lives, so rank 0 waits alone until the timeout.
    client = own_cluster.client
    real = own_cluster.worker_addresses[0]
    spec = ProcessGroupSpec(
        generation="lonely",
        ranks={real: 0, "tcp://127.0.0.1:9": 1},
        master_addr="127.0.0.1",
        master_port=_free_port(own_cluster, real),
        backend="gloo",
        init_timeout_s=2,
        collective_timeout_s=300,
    )
    # Bounded by the rendezvous timeout, not the 300 s collective timeout: the message says
    # which bound ended the wait, and the test's own timeout fails it if none did.
    with pytest.raises(Exception, match="rendezvous timed out after 2 s on rank 0"):
        client.register_plugin(ProcessGroupPlugin(spec), name=spec.plugin_name)


def _free_port(cluster, address):
    from workers.process_group import describe_worker

    return cluster.client.run(describe_worker, workers=[address])[address]["free_port"]


def test_plugin_validates_its_spec_on_the_client():
    with pytest.raises(ValueError, match=r"ranks must be 0\.\.1"):
        ProcessGroupSpec(
            generation="g",
            ranks={"a": 0, "b": 2},
            master_addr="127.0.0.1",
            master_port=1234,
            backend="gloo",
            init_timeout_s=1,
            collective_timeout_s=1,
        ).validate()


def _membership_of_this_worker(generation: str, dask_worker) -> object:
    plugin = next(p for p in dask_worker.plugins.values() if isinstance(p, ProcessGroupPlugin))
    assert plugin.spec.generation == generation
    return plugin.membership


def test_a_worker_that_joins_later_does_not_try_to_rendezvous(own_cluster):
    client = own_cluster.client
    with ProcessGroup(client, LaunchConfig(world_size=2)) as group:
        own_cluster.cluster.scale(3)
        client.wait_for_workers(3, timeout=60)
        newcomer = next(a for a in own_cluster.worker_addresses if a not in group.workers)
        # The scheduler hands the registered plugin to the newcomer; it must stay out of the group.
        assert (
            client.run(_membership_of_this_worker, group.spec.generation, workers=[newcomer])[
                newcomer
            ]
            is None
        )
        assert [r["sum"] for r in group.run(_all_reduce_probe, group.spec.generation)] == [3, 3]


def _fail_on_rank_1(generation: str) -> int:
    membership = current_membership(generation)
    if membership.rank == 1:
        raise ValueError("rank 1 gave up")
    # Rank 0 waits in a collective for a peer that will never come: the launcher must free it.
    dist.barrier()
    return membership.rank


# Rank 0 is released well before its 300 s collective timeout, or the test times out.
@pytest.mark.timeout(150)
def test_a_failing_rank_is_reported_and_the_cluster_recovers(own_cluster):
    client = own_cluster.client
    group = ProcessGroup(client, LaunchConfig(world_size=2, collective_timeout_s=300))
    with (
        pytest.raises(RankFailed, match=r"rank 1 .* failed: ValueError: rank 1 gave up") as info,
        group,
    ):
        group.run(_fail_on_rank_1, group.spec.generation)
    assert info.value.rank == 1
    client.wait_for_workers(2, timeout=60)
    with ProcessGroup(client, LaunchConfig(world_size=2)) as again:
        assert [r["sum"] for r in again.run(_all_reduce_probe, again.spec.generation)] == [3, 3]


def test_a_cluster_without_workers_is_a_clear_bounded_error():
    with start_cluster(n_workers=1, dashboard_port=0) as empty:
        empty.cluster.scale(0)
        deadline = time.monotonic() + 30
        while empty.worker_addresses and time.monotonic() < deadline:
            time.sleep(0.1)
        with pytest.raises(
            LaunchError, match=r"2 workers are needed, but the cluster has 0 and can have no more"
        ):
            ProcessGroup(empty.client, LaunchConfig(world_size=2, worker_wait_s=1)).start()


class _KillsItsWorkerWhenSent:
    """A result whose worker is SIGKILLed as it sends it to the client: a nanny killing a
    worker past its memory limit after its rank finished, before the client fetched it."""

    def __reduce__(self):
        import os
        import signal

        os.kill(os.getpid(), signal.SIGKILL)


def _finish(generation: str) -> object:
    membership = current_membership(generation)
    return _KillsItsWorkerWhenSent() if membership.rank == 1 else membership.rank


def test_a_result_lost_with_its_worker_after_the_rank_finished_fails_the_run(own_cluster):
    # Dask would reschedule the lost task, pinned to the dead worker, and wait for it forever.
    with ProcessGroup(own_cluster.client, LaunchConfig(world_size=2)) as group:
        started = time.monotonic()
        with pytest.raises(
            RankFailed, match=r"rank 1's worker .* left the cluster before its result"
        ):
            group.run(_finish, group.spec.generation, timeout_s=60)
    assert time.monotonic() - started < 30


STARTING_THREADS = """
import sys, threading, time

from workers.process_group import RankStopped, rank_threads

unstarted = []
sys.unraisablehook = unstarted.append  # where a thread that dies unstarted is reported
for trial in range(200):
    generation = f"starting-threads-{trial}"
    inside, stopped = threading.Event(), threading.Event()

    def rank(generation=generation, inside=inside, stopped=stopped):
        try:
            with rank_threads.running(generation):
                inside.set()
                while True:
                    started = threading.Thread(target=int, daemon=True)
                    started.start()
                    started.join()
        except RankStopped:
            stopped.set()

    thread = threading.Thread(target=rank, daemon=True)  # hangs, rather than fails, if hit
    thread.start()
    assert inside.wait(timeout=10)
    time.sleep(trial % 7 * 1e-4)  # stops at every point of the loop
    assert rank_threads.stop(generation) == 1
    assert stopped.wait(timeout=10), f"stop {trial} did not end the rank: {unstarted}"
    thread.join(timeout=10)
assert unstarted == [], unstarted
print("200 stops")
"""


def test_a_stop_lands_in_the_rank_never_in_a_thread_it_is_starting():
    """CPython 3.11 gives a thread being started its creator's id until it runs, and an
    asynchronous exception sent by that id lands in the newest state that has it: a stop that
    came while a rank started a thread (a checkpoint's writer) killed the new thread unstarted,
    which hung the rank in ``Thread.start`` and never stopped it. A rank here does nothing but
    start threads; each of many stops must end it, and no thread may die unstarted. In a
    process of its own: a failure leaves hung threads behind."""
    done = run_python(STARTING_THREADS)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-2:] == ["200", "stops"]


STOPPED_IN_A_FINALIZER = """
import threading, weakref

from workers.process_group import RankStopped, rank_threads

for trial in range(5):
    generation = f"finalizer-{trial}"
    in_finalizer, stopped = threading.Event(), threading.Event()

    class Tensor:  # what torch's WeakIdKeyDictionary keeps a weak reference to
        pass

    def forget(reference):  # the dictionary's callback: busy until the stop lands in it
        in_finalizer.set()
        while True:
            pass

    def rank(generation=generation):
        try:
            with rank_threads.running(generation):
                tensor = Tensor()
                reference = weakref.ref(tensor, forget)
                del tensor  # the callback runs here, in the rank's thread
                while True:  # the rank's own code, where the stop must land in the end
                    pass
        except RankStopped:
            stopped.set()

    thread = threading.Thread(target=rank, daemon=True)  # hangs, rather than fails, if hit
    thread.start()
    assert in_finalizer.wait(timeout=10)
    assert rank_threads.stop(generation) == 1
    assert stopped.wait(timeout=10), f"stop {trial} landed in the finalizer and was lost"
    thread.join(timeout=10)
print("5 stops")
"""


def test_a_stop_that_lands_in_a_finalizer_ends_the_rank_and_prints_nothing():
    """A stop that lands in a weakref callback (torch's WeakIdKeyDictionary has one per
    tensor) was dropped by CPython: printed as "Exception ignored in ..." on the terminal of a
    Ctrl-C'd ``dask-train run``, and the rank went on until its worker was killed. Here every
    stop lands in one, at once: each must still end the rank, and nothing be printed. In a
    process of its own: a failure leaves hung threads behind."""
    done = run_python(STOPPED_IN_A_FINALIZER)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-2:] == ["5", "stops"]
    assert done.stderr == ""


def _beyond_a_stops_reach(started: str) -> None:
    """A rank in a C call that does not return (as one waiting in gloo for a send posted
    before its connection went): a stop lands only once it returns."""
    Path(started, str(os.getpid())).touch()
    time.sleep(120)


class _Kept(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.mark.slow  # a cluster of its own, whose workers are killed, and the 3 s grace
def test_ranks_stopped_for_good_that_do_not_let_go_are_killed_without_a_warning(
    own_cluster, tmp_path
):
    """After a Ctrl-C, a rank out of its stop's reach is killed after STOPPED_RANK_GRACE_S:
    the expected way out, not the user's to act on. Its warnings (the launcher's "killing rank
    workers", and the nanny's "Restarting worker": a local cluster's nannies run in the CLI)
    were on the terminal of a Ctrl-C'd ``dask-train run``, after its one line."""
    kept = _Kept()
    launcher = logging.getLogger("workflows.jobs.launcher")
    # The scheduler's and asyncio's too: a teardown broadcast to a killed worker that the
    # scheduler still had ("broadcast to ... failed", "Future exception was never retrieved").
    others = ("distributed.nanny", "distributed.scheduler", "asyncio")
    watched = [launcher, *map(logging.getLogger, others)]
    level = launcher.level
    launcher.setLevel(logging.INFO)
    for logger in watched:
        logger.addHandler(kept)
    stop = threading.Event()

    def stop_once_both_sleep() -> None:
        if len(list(tmp_path.iterdir())) == 2:
            stop.set()

    try:
        with (
            pytest.raises(JobStopped),
            ProcessGroup(own_cluster.client, LaunchConfig(world_size=2)) as group,
        ):
            group.run(
                _beyond_a_stops_reach,
                str(tmp_path),
                watch=RankWatch(stop=stop, on_poll=stop_once_both_sleep),
            )
        own_cluster.client.wait_for_workers(2, timeout=120)  # the nannies restarted them
    finally:
        for logger in watched:
            logger.removeHandler(kept)
        launcher.setLevel(level)
    said = [(r.levelname, r.name, r.getMessage()) for r in kept.records]
    assert any(message.startswith("killing rank workers") for _, _, message in said), said
    assert [s for s in said if s[0] not in ("DEBUG", "INFO")] == [], said


def _listening(pids: list[int]) -> set[tuple[int, str, int]]:
    """The TCP sockets that ``pids`` listen on: (pid, address, port)."""
    return {
        (pid, c.laddr.ip, c.laddr.port)
        for pid in pids
        for c in psutil.Process(pid).net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN
    }


def _listening_while_grouped(ctx, pids: list[int]) -> set[tuple[int, str, int]]:
    """What ``pids`` listen on while every rank is in the group (its store served, gloo's
    pairs connected)."""
    dist.barrier()
    found = _listening(pids)
    dist.barrier()  # the store stays up until every rank has looked
    return found


def test_nothing_of_a_local_cluster_listens_beyond_loopback_during_a_launch(cluster):
    # Before, rank 0's rendezvous store listened on every interface (":::PORT"): an
    # unauthenticated key-value store, open to the network for each job's life.
    workers = list(cluster.client.run(os.getpid).values())
    ours = workers + [psutil.Process(pid).ppid() for pid in workers]  # and their nannies
    before = _listening(ours)
    result = launch(_listening_while_grouped, ours, cluster=cluster, world_size=2)
    during = result.results[0]
    opened = during - before
    assert opened, "the launch opened no listening socket: nothing was looked at"
    # Not on every interface (0.0.0.0, ::), nor on any but loopback's.
    assert all(ipaddress.ip_address(address).is_loopback for _, address, _ in during), sorted(
        during
    )
