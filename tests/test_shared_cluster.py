"""Jobs sharing one cluster: isolation, the scheduler's queue, leases and adaptive clusters.

Real clusters, real worker processes, real clients in other processes.
"""

import _thread
import ast
import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import pytest
import torch.distributed as dist
from distributed import Client

from tests.commands import dask_train, kill_showing_stacks
from tests.reference import assert_equivalent
from tests.test_launch import _wait_for_file, ddp_loop, one_process_reference
from workers.process_group import ProcessGroupPlugin
from workflows import launch, start_cluster
from workflows.jobs.admission import (
    Admission,
    AdmissionError,
    Request,
    Waits,
    WorkerSelection,
)
from workflows.jobs.launcher import LaunchError
from workflows.observe.dashboard import training_page_url
from workflows.observe.monitoring import queue_snapshot


def where_and_sum(ctx, seconds: float) -> tuple[int, int]:
    """This rank's worker pid, and an all-reduce over the job's ranks after ``seconds``."""
    import torch

    time.sleep(seconds)
    total = torch.tensor([ctx.rank + 1])
    dist.all_reduce(total)
    return os.getpid(), int(total)


def held_until(ctx, flag: str) -> int:
    """Reports once, then holds its worker until ``flag`` exists (120 s at most)."""
    ctx.report(started=1)
    _wait_for_file(flag, timeout_s=120)
    return ctx.rank


@contextlib.contextmanager
def holding(cluster, flag, *, world_size: int):
    """A job named "holder" holds ``world_size`` workers (reporting once) until the block ends."""
    holder = threading.Thread(
        target=lambda: launch(
            held_until, str(flag), cluster=cluster, world_size=world_size, name="holder"
        ),
        daemon=True,
    )
    holder.start()
    try:
        wait_for_holder(cluster.client, "holder")
        yield
    finally:
        flag.touch()
        holder.join(timeout=120)
    assert not holder.is_alive(), "the holder did not end"


def _in_threads(*calls) -> list:
    """Run each call in a thread of its own; their results (or exceptions), in order."""
    results: list = [None] * len(calls)

    def run(i: int) -> None:
        try:
            results[i] = calls[i]()
        except BaseException as error:  # handed to the test's thread
            results[i] = error

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=240)
    assert not any(t.is_alive() for t in threads), "a job did not end within 240 s"
    return results


def _plugins_on_scheduler(dask_scheduler) -> list[str]:
    return sorted(dask_scheduler.worker_plugins)


def _group_plugins(dask_worker) -> list[str]:
    return [p.name for p in dask_worker.plugins.values() if isinstance(p, ProcessGroupPlugin)]


def _nothing_left_of(client, job_prefix: str) -> None:
    queue = client.run_on_scheduler(queue_snapshot)
    assert not [j for j in queue["holding"] + queue["queued"] if job_prefix in j["job_id"]], queue
    assert not [p for p in client.run_on_scheduler(_plugins_on_scheduler) if job_prefix in p]
    for plugins in client.run(_group_plugins).values():
        assert not [p for p in plugins if job_prefix in p]


def test_two_one_rank_jobs_run_at_once_on_different_workers(cluster):
    first, second = _in_threads(
        lambda: launch(where_and_sum, 1.0, cluster=cluster, world_size=1, name="left"),
        lambda: launch(where_and_sum, 1.0, cluster=cluster, world_size=1, name="right"),
    )
    (left_pid, left_sum), (right_pid, right_sum) = first.results[0], second.results[0]
    assert left_sum == right_sum == 1  # each rank alone in its own group
    assert left_pid != right_pid
    assert set(cluster.client.run(os.getpid).values()) == {left_pid, right_pid}
    _nothing_left_of(cluster.client, "left-")


def test_a_second_two_rank_job_waits_with_one_line_and_shows_on_metrics(cluster, caplog, tmp_path):
    flag = tmp_path / "release"
    seen: dict = {}
    page = training_page_url(cluster.dashboard_link)
    metrics = page.rsplit("/training", 1)[0] + "/metrics"

    def on_event(record: dict) -> None:
        if record.get("kind") == "queued":
            seen["queued"] = record
            seen["metrics"] = urllib.request.urlopen(metrics, timeout=30).read().decode()
            seen["page"] = urllib.request.urlopen(page + "?refresh=0", timeout=30).read().decode()
            flag.touch()  # now the holder may finish

    with (
        caplog.at_level(logging.WARNING, logger="workflows.jobs.admission"),
        holding(cluster, flag, world_size=2),
    ):
        waited = launch(where_and_sum, 0.0, cluster=cluster, world_size=2, on_event=on_event)
    assert [total for _, total in waited.results] == [3, 3]
    lines = [r.getMessage() for r in caplog.records if "waits for" in r.getMessage()]
    assert (
        len(lines) == 1
        and "waits for 2 of 2 eligible workers, held by holder (2 since" in (lines[0])
    ), lines
    assert seen["queued"]["holders"][0]["name"] == "holder"
    assert "dask_train_queued_jobs 1.0" in seen["metrics"]
    assert "waits for 2 workers" in seen["page"] and "holds 2 workers" in seen["page"]
    _nothing_left_of(cluster.client, "holder-")


def test_the_queue_wait_is_bounded_and_a_queued_ctrl_c_leaves_nothing(cluster, tmp_path):
    flag = tmp_path / "release"

    def interrupt_once_queued(record: dict) -> None:
        if record.get("kind") == "queued":
            _thread.interrupt_main()  # Ctrl-C while the job waits in the queue

    with holding(cluster, flag, world_size=2):  # the launches below: in the main thread
        with pytest.raises(LaunchError, match=r"^launch.queue_timeout_s: job late-\w+ waited"):
            launch(
                where_and_sum,
                0.0,
                cluster=cluster,
                world_size=2,
                name="late",
                config={"queue_timeout_s": 0.5},
            )
        with pytest.raises(KeyboardInterrupt):
            launch(
                where_and_sum,
                0.0,
                cluster=cluster,
                world_size=2,
                name="interrupted",
                on_event=interrupt_once_queued,
            )
        _nothing_left_of(cluster.client, "late-")
        _nothing_left_of(cluster.client, "interrupted-")
    _nothing_left_of(cluster.client, "holder-")


def test_a_worker_lost_by_one_job_restarts_only_that_job(four_workers, tmp_path):
    flag = tmp_path / "a-finished"
    b_running = threading.Event()

    def note_b(record: dict) -> None:
        if record.get("kind") == "report" and record.get("step") == 2:
            b_running.set()

    def job_b():
        return launch(
            ddp_loop,
            5,
            0.1,
            0,
            0,
            str(flag),
            cluster=four_workers,
            world_size=2,
            name="b",
            on_event=note_b,
        )

    def job_a():
        assert b_running.wait(120), "job B never started"
        try:
            # Rank 1's worker SIGKILLs itself at step 3, a step after the checkpoint of 2.
            return launch(
                ddp_loop,
                6,
                0.1,
                2,
                3,
                cluster=four_workers,
                world_size=2,
                name="a",
                checkpoint_dir=tmp_path / "a",
            )
        finally:
            flag.touch()

    b, a = _in_threads(job_b, job_a)
    assert not isinstance(a, BaseException), a
    assert not isinstance(b, BaseException), b
    assert [r["resumed_from_step"] for r in a.recoveries] == [2]
    assert b.recoveries == [] and b.attempts == 1
    for parameters in a.results:
        assert_equivalent(parameters, one_process_reference(6, 0.1))
    for parameters in b.results:
        assert_equivalent(parameters, one_process_reference(5, 0.1))


# A client in a process of its own that holds both workers until it is killed or frozen:
# python holds.py SCHEDULER NAME [LEASE_S].
CLIENT_THAT_HOLDS = """
import sys, time
from distributed import Client
from workflows import launch

def forever(ctx):
    ctx.report(started=1)
    while True:
        time.sleep(0.01)

if __name__ == "__main__":
    address, name, *lease = sys.argv[1:]
    config = {"lease_s": float(lease[0])} if lease else {}
    with Client(address) as client:
        launch(forever, cluster=client, world_size=2, name=name, config=config)
"""


@pytest.mark.timeout(180)
def test_a_killed_clients_workers_go_to_the_next_job_in_the_queue(cluster, tmp_path):
    client = cluster.client
    holder = subprocess.Popen(_holding_client(client, tmp_path, "killed-client"))
    try:
        # Killed once its ranks run: it holds workers, a plugin and tasks on them.
        _wait_until_it_holds(client, holder, "killed-client")
    finally:
        holder.kill()
        holder.wait(timeout=30)
    # The queue bound is the lease's: the killed client's workers must be free by then.
    result = launch(
        where_and_sum, 0.0, cluster=cluster, world_size=2, config={"queue_timeout_s": 20.0}
    )
    assert [total for _, total in result.results] == [3, 3]
    _nothing_left_of(client, "killed-client-")


def _processing(client) -> list:
    return [key for keys in client.processing().values() for key in keys]


def _holding_client(client, folder, name: str, *lease_s: float) -> list[str]:
    """The command of a CLIENT_THAT_HOLDS job called ``name`` (with a lease of ``lease_s``)."""
    script = folder / "holds.py"
    script.write_text(CLIENT_THAT_HOLDS)
    return [sys.executable, str(script), client.scheduler.address, name, *map(str, lease_s)]


def _wait_until_it_holds(client, holder: subprocess.Popen, name: str) -> None:
    """Until the job ``name`` of the process ``holder`` runs its ranks (90 s at most)."""
    deadline = time.monotonic() + 90
    while not any(name in str(k) for k in _processing(client)):
        assert holder.poll() is None and time.monotonic() < deadline, "it never held workers"
        time.sleep(0.05)


FROZEN_LEASE_S = 4.0  # renewed every 1.3 s: a busy machine may delay a renewal 2.6 s


def _clients(dask_scheduler) -> set[str]:
    return set(dask_scheduler.clients)


@pytest.mark.timeout(180)
def test_a_frozen_clients_lease_expires_and_its_workers_go_to_the_next_job(
    cluster, tmp_path, caplog
):
    """A real client in another process holds both workers, then is frozen (SIGSTOP): its
    connection stays open, so only the lease can free its workers. The next client's job
    waits behind it, then gets them, within its queue bound, while the frozen client is
    still connected."""
    client = cluster.client
    before = client.run_on_scheduler(_clients)
    holder = subprocess.Popen(_holding_client(client, tmp_path, "frozen-client", FROZEN_LEASE_S))
    try:
        # Frozen once its ranks run: it holds the workers, a plugin and tasks on them.
        _wait_until_it_holds(client, holder, "frozen-client")
        (frozen_client,) = client.run_on_scheduler(_clients) - before
        os.kill(holder.pid, signal.SIGSTOP)
        events: list[dict] = []
        with caplog.at_level(logging.WARNING, logger="workflows.jobs.admission"):
            result = launch(
                where_and_sum,
                0.0,
                cluster=cluster,
                world_size=2,
                name="after-frozen",
                # Far above the lease (4 s) and the scheduler's check every 0.5 s: a bound only.
                config={"queue_timeout_s": 60.0},
                on_event=events.append,
            )
        assert [total for _, total in result.results] == [3, 3]
        # It waited for the frozen job's workers, and the lease, not a disconnect, freed them.
        (queued,) = [e for e in events if e["kind"] == "queued"]
        assert [h["name"] for h in queued["holders"]] == ["frozen-client"]
        assert any(e["kind"] == "admitted" for e in events)
        dropped = [r.getMessage() for r in caplog.records if "frozen-client-" in r.getMessage()]
        assert len(dropped) == 1 and "its lease ran out (4 s unrenewed)" in dropped[0], dropped
        assert frozen_client in client.run_on_scheduler(_clients)
        assert holder.poll() is None  # frozen all along, not gone
        _nothing_left_of(client, "frozen-client-")
    finally:
        os.kill(holder.pid, signal.SIGCONT)
        holder.kill()
        holder.wait(timeout=30)


def _hold_without_renewing(request: Request, dask_scheduler) -> dict:
    from workflows.jobs.admission import WorkerQueue

    queue = dask_scheduler.plugins.get("dask-train-queue") or WorkerQueue()
    return queue.request(request)


def test_a_lease_not_renewed_expires_and_frees_its_workers(cluster):
    client = cluster.client
    launch(where_and_sum, 0.0, cluster=cluster, world_size=1)  # the queue is on the scheduler
    frozen = Request(
        job_id="frozen-0",
        name="frozen",
        client="a client that stopped renewing",
        minimum=2,
        maximum=2,
        selection=WorkerSelection(),
        lease_s=1.0,
    )
    assert len(client.run_on_scheduler(_hold_without_renewing, frozen)["granted"]) == 2
    result = launch(
        where_and_sum, 0.0, cluster=cluster, world_size=2, config={"queue_timeout_s": 20.0}
    )
    assert [total for _, total in result.results] == [3, 3]
    _nothing_left_of(client, "frozen-")


@pytest.mark.timeout(180)
def test_an_adaptive_cluster_grows_for_a_queued_job_and_shrinks_after(tmp_path):
    with start_cluster(n_workers=1, dashboard_port=0) as training_cluster:
        training_cluster.cluster.adapt(minimum=1, maximum=2, interval="200ms", wait_count=2)
        result = launch(
            where_and_sum,
            0.0,
            cluster=training_cluster,
            world_size=2,
            config={"worker_wait_s": 120.0},
        )
        assert [total for _, total in result.results] == [3, 3]
        deadline = time.monotonic() + 60
        while len(training_cluster.client.scheduler_info(n_workers=-1)["workers"]) > 1:
            assert time.monotonic() < deadline, "the cluster did not shrink back to 1 worker"
            time.sleep(0.2)


# A local cluster's size is known: the job fails at once, not after launch.worker_wait_s.
@pytest.mark.timeout(60)
def test_a_job_larger_than_the_cluster_can_be_fails_at_once_naming_the_field(cluster):
    with pytest.raises(LaunchError, match=r"launch.world_size: 3 .* has 2 and can have no more"):
        launch(where_and_sum, 0.0, cluster=cluster, world_size=3, config={"worker_wait_s": 600})
    _nothing_left_of(cluster.client, "where_and_sum-")


def test_the_readmes_sharing_example_runs_as_pasted(tmp_path):
    from tests.test_cluster import _run_in_own_session
    from tests.test_launch import _readme_block

    script = tmp_path / "sharing.py"
    script.write_text(_readme_block("one waits in the queue for the other"))
    done = _run_in_own_session([sys.executable, str(script)], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert ast.literal_eval(done.stdout.splitlines()[-1]) == {"first": [0, 1], "second": [0, 1]}
    assert "waits for 2 of 2 eligible workers" in done.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["sharing.py"]


def _block_the_event_loop(seconds: float, dask_scheduler=None) -> None:
    time.sleep(seconds)  # a plain function runs on the scheduler's event loop itself


def test_a_scheduler_that_does_not_answer_the_queue_is_an_error_not_a_hang(cluster):
    client = cluster.client
    # The job's own client, on an event loop of its own: the cluster's client shares the
    # scheduler's, which the test blocks.
    job_client = Client(client.scheduler.address)
    request = Request(
        job_id="unanswered-0",
        name="unanswered",
        client=job_client.id,
        minimum=1,
        maximum=1,
        selection=WorkerSelection(),
        lease_s=1.0,
    )
    admission = Admission(
        job_client, request, Waits(queue_timeout_s=60.0, worker_wait_s=60.0, call_timeout_s=0.5)
    )
    busy = threading.Thread(target=client.run_on_scheduler, args=(_block_the_event_loop, 3.0))
    busy.start()
    try:
        time.sleep(0.2)  # the scheduler is busy now (3 s); the bound below is 0.5 s
        unanswered = r"did not answer the queue \(install_queue\) within 0.5 s"
        with pytest.raises(AdmissionError, match=unanswered):
            admission.hold()
    finally:
        busy.join(timeout=30)
        job_client.close()
    # The scheduler reads the request once it answers again, after the client gave up on it:
    # what it holds goes back, given back by the client or at the end of its lease.
    deadline = time.monotonic() + 30
    while "unanswered-0" in str(client.run_on_scheduler(queue_snapshot)):
        assert time.monotonic() < deadline, "the unanswered request still holds its worker"
        time.sleep(0.1)
    _nothing_left_of(client, "unanswered-")


@pytest.mark.timeout(180)
def test_sigterm_of_a_queued_cli_job_exits_130_and_leaves_nothing(cluster, tmp_path):
    client = cluster.client
    flag = tmp_path / "release"
    script = tmp_path / "job.py"
    script.write_text("import torch.distributed as dist\ndist.init_process_group()\n")
    with holding(cluster, flag, world_size=2):
        queued = subprocess.Popen(
            dask_train("launch", "--scheduler", client.scheduler.address, str(script)),
            stderr=subprocess.PIPE,
            text=True,
            cwd=tmp_path,
        )
        lines = []
        for line in queued.stderr:  # bounded by the test's timeout
            lines.append(line)
            if "waits for 2 of 2 eligible workers, held by holder" in line:
                break
        queued.send_signal(signal.SIGTERM)
        try:
            rest = queued.communicate(timeout=60)[1]
        except subprocess.TimeoutExpired:
            # Stopped here, not left running; its threads' stacks say where its shutdown stuck.
            rest = kill_showing_stacks(queued)
            pytest.fail(f"no exit 60 s after SIGTERM; its stderr:\n{''.join(lines)}{rest}")
        assert queued.returncode == 130, "".join(lines) + rest
        queue = client.run_on_scheduler(queue_snapshot)
        assert [j["name"] for j in queue["holding"]] == ["holder"] and not queue["queued"], queue


def wait_for_holder(client, name: str) -> None:
    deadline = time.monotonic() + 60
    while not any(j["name"] == name for j in client.run_on_scheduler(queue_snapshot)["holding"]):
        assert time.monotonic() < deadline, f"job {name} never got its workers"
        time.sleep(0.02)


def where_the_data_was_placed(ctx) -> tuple[str, tuple[str, ...]]:
    from distributed import get_worker

    return get_worker().address, ctx._job.data.workers


def test_a_jobs_dask_collections_are_placed_on_the_workers_it_gets(cluster, tmp_path):
    import dask.array as da

    flag = tmp_path / "release"
    client = cluster.client
    # The holder takes the first worker in rank order, where an idle cluster's plan would go.
    with holding(cluster, flag, world_size=1):
        x = da.random.default_rng(0).random((64, 4), chunks=16)
        y = da.zeros(64, chunks=16, dtype="int64")
        result = launch(
            where_the_data_was_placed, cluster=cluster, world_size=1, data={"train": (x, y)}
        )
    ((address, planned),) = result.results
    assert planned == (address,)
    held = client.run_on_scheduler(queue_snapshot)  # the holder is gone: nothing held
    assert not held["holding"], held


def ends_after(ctx, seconds: float) -> float:
    time.sleep(seconds)
    return time.time()


def starts(ctx) -> float:
    return time.time()


def test_no_later_job_takes_a_worker_an_earlier_waiting_job_could_use(cluster, caplog, tmp_path):
    # A one-worker job that arrives while a two-worker job waits gets no worker before the
    # two-worker job has had both, though one would be free first.
    client, flag = cluster.client, tmp_path / "release"
    runs: dict = {}

    def run(name: str, *args, **kwargs) -> threading.Thread:
        def target() -> None:
            runs[name] = launch(*args, cluster=cluster, name=name, **kwargs)

        thread = threading.Thread(target=target, daemon=True)
        thread.start()
        return thread

    def wait_until_queued(name: str) -> None:
        deadline = time.monotonic() + 60
        while not any(j["name"] == name for j in client.run_on_scheduler(queue_snapshot)["queued"]):
            assert time.monotonic() < deadline, f"job {name} never queued"
            time.sleep(0.02)

    with caplog.at_level(logging.WARNING, logger="workflows.jobs.admission"):
        threads = [run("holder", held_until, str(flag), world_size=2)]
        wait_for_holder(client, "holder")
        threads.append(run("second", ends_after, 0.3, world_size=2))
        wait_until_queued("second")
        threads.append(run("third", starts, world_size=1))
        wait_until_queued("third")
        flag.touch()
        for thread in threads:
            thread.join(timeout=120)
    assert min(runs["third"].results) >= max(runs["second"].results)
    (line,) = [r.getMessage() for r in caplog.records if "job third-" in r.getMessage()]
    assert "waits for 1 of 2 eligible workers, held by holder (2 since" in line, line
    assert line.endswith(", 1 queued ahead"), line
