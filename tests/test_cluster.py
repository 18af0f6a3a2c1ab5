"""The cluster factory starts real worker processes fit for training."""

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time
import urllib.request

import dask
import psutil
import pytest
import torch
from distributed import Client
from torch.utils.data import DataLoader, TensorDataset

from tests.commands import run_python, session_leftovers
from workflows.cluster.training_cluster import (
    ClusterConfig,
    count_gpus,
    live_workers,
    start_cluster,
)


def _process_facts() -> dict[str, object]:
    return {
        "daemon": multiprocessing.current_process().daemon,
        "malloc_trim": os.environ.get("MALLOC_TRIM_THRESHOLD_"),
        "malloc_mmap": os.environ.get("MALLOC_MMAP_THRESHOLD_"),
        "omp_threads": os.environ.get("OMP_NUM_THREADS"),
        "pid": os.getpid(),
    }


def test_workers_are_separate_non_daemonic_processes_with_tuned_malloc(cluster):
    facts = cluster.client.run(_process_facts)
    assert len(facts) == 2
    assert len({f["pid"] for f in facts.values()}) == 2
    assert os.getpid() not in {f["pid"] for f in facts.values()}
    for f in facts.values():
        assert f["daemon"] is False
        # Dask's 65536 would halve throughput; ours keeps freed memory for reuse.
        assert f["malloc_trim"] == str(256 * 2**20)
        assert f["malloc_mmap"] == str(32 * 2**20)
        assert f["omp_threads"] == "1"
    workers = live_workers(cluster.client)
    assert len(workers) == 2
    assert all(w["nthreads"] == 1 for w in workers.values())


def test_live_workers_never_reads_the_clients_worker_less_cache(cluster):
    # A client refreshes its scheduler_info() cache without workers; with a fast refresh,
    # reading that cache soon shows a live cluster as empty, and a training job as "worker left".
    with (
        dask.config.set({"distributed.client.scheduler-info-interval": "5ms"}),
        Client(cluster.client.scheduler.address, timeout=30) as client,
    ):
        for _ in range(300):
            assert len(live_workers(client)) == 2


def test_waits_use_the_futures_own_client_when_a_newer_one_is_the_default(cluster):
    import distributed

    from workers.futures import wait_futures

    first = cluster.client
    future = first.submit(time.sleep, 1.0, pure=False)
    with pytest.raises(TimeoutError):
        future.result(timeout=0.01)  # its completion event now lives on first's event loop
    with Client(first.scheduler.address) as newer:
        assert distributed.client.default_client() is newer
        # Dask's own wait uses the newest client: it fails at once instead of waiting (a
        # clean-up that swallowed this let tasks write into a store being rebuilt).
        with pytest.raises(RuntimeError, match="different event loop"):
            distributed.wait([future], timeout=10)
        wait_futures([future], timeout_s=10)
        assert future.status == "finished"


def test_waiting_on_no_futures_needs_no_client():
    # A fresh process has no client at all: Dask's own wait asks for the default one first.
    code = "from workers.futures import wait_futures; print(wait_futures([], timeout_s=1))"
    done = run_python(code, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "DoneAndNotDoneFutures(done=set(), not_done=set())"


def test_without_malloc_tuning_workers_get_glibc_defaults_not_dasks_trim():
    with start_cluster(n_workers=1, dashboard_port=0, tune_malloc=False) as plain:
        (facts,) = plain.client.run(_process_facts).values()
    assert facts["malloc_trim"] is None
    assert facts["malloc_mmap"] is None


RESTART_IN_A_FRESH_PROCESS = """
import json, os, time
from workflows.cluster.training_cluster import TUNED_MALLOC, start_cluster

keys = [*TUNED_MALLOC, "PYTHONHASHSEED"]
before = {key: os.environ.get(key) for key in keys}


def settled():
    # A nanny may spawn once more in the background after restart() returned (its worker's
    # exit also triggers a start): its values are rightly there until that spawn is done.
    deadline = time.monotonic() + 60
    while (now := {key: os.environ.get(key) for key in keys}) != before:
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)
    return now


with start_cluster(n_workers=2, dashboard_port=0) as tuned:
    started = settled()
    tuned.client.restart(timeout=120)
    restarted = settled()
with start_cluster(n_workers=1, dashboard_port=0, tune_malloc=False) as plain:
    (trim,) = plain.client.run(lambda: os.environ.get("MALLOC_TRIM_THRESHOLD_")).values()
print(json.dumps({"before": before, "started": started, "restarted": restarted, "trim": trim}))
"""


def test_a_restart_leaves_no_worker_environment_in_this_process():
    # The nanny writes its pre-spawn environment into the process that holds it on every spawn,
    # restarts too; left there, it would override the malloc settings of a later cluster. In a
    # process of its own: in the suite's, another cluster's worker may be spawning at any time
    # (a job's release restarts workers in the background), and its values are rightly there
    # while it does.
    done = subprocess.run(
        [sys.executable, "-c", RESTART_IN_A_FRESH_PROCESS],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.splitlines()[-1])
    assert seen["started"] == seen["before"]
    assert seen["restarted"] == seen["before"]
    assert seen["trim"] is None


def _iterate_with_loader_processes(n: int) -> list[int]:
    dataset = TensorDataset(torch.arange(n))
    loader = DataLoader(dataset, batch_size=8, num_workers=2)
    return sorted(int(i) for (batch,) in loader for i in batch)


def test_dataloader_worker_processes_run_inside_a_dask_task(cluster):
    # Fails with "daemonic processes are not allowed to have children" on stock workers.
    seen = cluster.client.submit(_iterate_with_loader_processes, 40, pure=False).result(timeout=60)
    assert seen == list(range(40))


def test_gpu_count_agrees_with_torch():
    assert count_gpus() == torch.cuda.device_count()


def test_dashboard_is_served_on_loopback(cluster):
    link = cluster.dashboard_link
    assert link.startswith("http://127.0.0.1:")
    with urllib.request.urlopen(link, timeout=10) as response:
        assert response.status == 200


def test_connect_to_an_existing_cluster_by_address(cluster):
    address = cluster.cluster.scheduler_address
    with start_cluster(scheduler=address) as remote:
        assert remote.kind == "remote"
        assert remote.worker_addresses == cluster.worker_addresses
    # Closing a connection must not close somebody else's cluster.
    assert len(cluster.worker_addresses) == 2


def test_unreachable_scheduler_is_a_clear_bounded_error():
    # The message names the bound it gave up after: the 2 s asked for, not the default 30 s.
    with pytest.raises(ConnectionError, match=r"cluster\.scheduler: could not reach .* within 2 s"):
        start_cluster(scheduler="tcp://127.0.0.1:9", connect_timeout_s=2)


@pytest.mark.skipif(count_gpus() > 0, reason="this machine has GPUs")
def test_asking_for_cuda_without_gpus_is_a_clear_error():
    with pytest.raises(RuntimeError, match=r"cluster\.kind: 'cuda'.*no GPU"):
        start_cluster(kind="cuda", dashboard_port=0)


def test_an_existing_cluster_cannot_be_sized():
    with pytest.raises(ValueError, match=r"cluster\.n_workers"):
        ClusterConfig(scheduler="tcp://127.0.0.1:8786", n_workers=2)


def _visible_device() -> tuple[str, int]:
    return os.environ.get("CUDA_VISIBLE_DEVICES", ""), torch.cuda.current_device()


@pytest.mark.gpu
def test_one_cuda_worker_per_gpu_each_sees_its_own_gpu_as_cuda0():
    with start_cluster(dashboard_port=0) as gpu_cluster:
        assert gpu_cluster.kind == "cuda"
        seen = gpu_cluster.client.run(_visible_device)
        assert len(seen) == torch.cuda.device_count()
        first_devices = {visible.split(",")[0] for visible, _ in seen.values()}
        assert len(first_devices) == len(seen)
        assert all(current == 0 for _, current in seen.values())


UNGUARDED = """\
from workflows import start_cluster

with start_cluster(n_workers=2, dashboard_port=0) as cluster:
    print("started", cluster.dashboard_link, flush=True)
"""


def _run_in_own_session(args: list[str], cwd) -> subprocess.CompletedProcess:
    """Run ``args`` in a session of its own; afterwards no process of that session may live."""
    process = subprocess.Popen(
        args,
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)

    _, alive = psutil.wait_procs(session_leftovers(process.pid), timeout=30)
    assert alive == [], f"processes left behind: {alive}"
    return subprocess.CompletedProcess(args, process.returncode, stdout, stderr)


def test_a_script_that_starts_a_cluster_without_the_main_guard_fails_at_once(tmp_path):
    script = tmp_path / "example.py"
    script.write_text(UNGUARDED)
    done = _run_in_own_session([sys.executable, str(script)], tmp_path)
    assert done.returncode == 1
    assert "started" not in done.stdout  # no cluster, so no workers that re-import the script
    assert done.stderr.splitlines()[-1] == (
        "workflows.cluster.training_cluster.ScriptWithoutMainGuard: "
        f"{script}, line 3: the cluster is started at "
        "the script's top level; put the code that starts the cluster under "
        'if __name__ == "__main__": (Dask\'s worker processes import the main script again)'
    )


def test_a_worker_importing_an_unguarded_script_stops_at_the_cluster_start(tmp_path):
    # What multiprocessing's spawn does in each new worker process: run the parent's main
    # script under the name __mp_main__.
    script = tmp_path / "example.py"
    script.write_text(UNGUARDED)
    code = f"import runpy; runpy.run_path({str(script)!r}, run_name='__mp_main__')"
    done = _run_in_own_session([sys.executable, "-c", code], tmp_path)
    assert done.returncode == 1
    assert done.stderr.splitlines()[-1].endswith(
        f"start_cluster() was called while a worker process imported {script}: put the code "
        'that starts the cluster under if __name__ == "__main__": (Dask\'s worker processes '
        "import the main script again)"
    )


def test_a_guarded_script_starts_its_cluster(tmp_path):
    script = tmp_path / "example.py"
    body = "".join(f"    {line}\n" for line in UNGUARDED.splitlines()[2:])
    script.write_text(
        "from workflows import start_cluster\n\nif __name__ == '__main__':\n"
        + body.replace("n_workers=2", "n_workers=1")
    )
    done = _run_in_own_session([sys.executable, str(script)], tmp_path)
    assert done.returncode == 0, done.stderr
    assert "started http://127.0.0.1:" in done.stdout


def test_a_local_cluster_start_is_bounded_and_what_it_started_is_closed(tmp_path):
    # A bound no start can meet, so the timeout path runs whatever the machine's load.
    code = (
        "from workflows import start_cluster\n"
        "if __name__ == '__main__':\n"
        "    start_cluster(n_workers=1, dashboard_port=0, start_timeout_s=0.001)\n"
    )
    (tmp_path / "start.py").write_text(code)
    done = _run_in_own_session([sys.executable, "start.py"], tmp_path)
    assert done.returncode == 1
    # The abandoned start goes on logging until the interpreter exits, so its lines may follow
    # the traceback: the error is looked for among the lines, not taken as the last one.
    assert (
        "TimeoutError: cluster.start_timeout_s: the local cluster did not start within 0.001 s "
        "(a loaded machine may need more; see the log for the workers' errors)"
    ) in done.stderr.splitlines(), done.stderr
