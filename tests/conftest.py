import gc
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from workflows.cluster.training_cluster import live_workers, start_cluster
from workflows.runs.config import RunConfig, load_config

REPO = Path(__file__).parents[1]
# What running the tests legitimately leaves in the checkout.
_CACHES = ("__pycache__", ".pytest_cache", ".ruff_cache", ".egg-info")
_BEFORE = pytest.StashKey[set[str] | None]()


def repo_entries(repo: Path = REPO) -> set[str] | None:
    """The files and folders in the checkout that git does not track (new or ignored), caches
    aside; None outside a git checkout, where there is nothing to compare. (Edits to tracked
    files are left out: someone may be editing while the tests run.)"""
    try:
        done = subprocess.run(
            ["git", "status", "--porcelain", "--ignored"],
            cwd=repo,
            capture_output=True,
            text=True,
            timeout=60,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0:
        return None
    entries = set()
    for line in done.stdout.splitlines():
        if not line.startswith(("??", "!!")) or line[3:] == ".venv/":
            continue
        if any(cache in line for cache in _CACHES):
            continue
        entries.add(line)
        # git shows an untracked or ignored folder as one line; its children too, so a new run
        # in a runs/ folder that was there before is seen.
        if line.endswith("/"):
            entries.update(f"{line}{child.name}" for child in (repo / line[3:]).iterdir())
    return entries


def pytest_sessionstart(session):
    session.config.stash[_BEFORE] = repo_entries()
    # A suite started in the background by a non-interactive shell (`make test &`, nohup)
    # inherits SIGINT ignored, and so do the processes it starts: then no Ctrl-C reaches
    # anything, and the Ctrl-C tests would wait for one forever. They test our handling of
    # Ctrl-C, so the suite takes Python's own handling back.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_collection_finish(session):
    # What collection imported (torch, Dask, every test module) lives as long as the suite:
    # frozen, the test process's full collections walk only what the tests make (measured with
    # gc.callbacks: 31 full collections took 11.6 s of a suite run). The fork server's reason
    # (workers/frozen_heap.py); what the tests leave is still collected.
    gc.collect()
    gc.freeze()


def pytest_sessionfinish(session, exitstatus):
    before = session.config.stash.get(_BEFORE, None)
    after = repo_entries()
    if before is None or after is None or after <= before:
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    left = ", ".join(sorted(line[3:] for line in after - before))
    message = f"tests left files in the repository {REPO}: {left} (write under tmp_path instead)"
    if reporter is not None:
        reporter.write_sep("=", message, red=True)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter):
    """The equivalence checks' margins, by kernel path: how close the worst result came to its
    allowance, and how far outside it the nearest refused bug landed (tests/reference.py)."""
    from tests.reference import MARGINS

    if not MARGINS:
        return
    groups: dict[str, list] = {}
    for margin in MARGINS:
        path = re.search(r"aten-[^-]+-onednn-[^-\]]+", margin.test)
        groups.setdefault(path.group(0) if path else "the suite's own path", []).append(margin)
    terminalreporter.write_sep("-", "equivalence margins: distance / allowance")
    for path, margins in groups.items():
        worst = max(margins, key=lambda m: m.worst)
        near = min(margins, key=lambda m: m.near_miss)
        bug = min(margins, key=lambda m: m.nearest_bug_fraction)
        terminalreporter.write_line(
            f"{path}: {len(margins)} checks. Worst result {worst.worst:.2f} ({worst.worst_tensor}"
            f" in {_short(worst.test)}); near miss {near.near_miss:.2f} (in {_short(near.test)});"
            " nearest planted bug "
            f"{bug.nearest_bug_fraction:.3g} ({bug.nearest_bug}, in {_short(bug.test)})"
        )


def _short(test: str) -> str:
    """A test's id without its module: the kernel path's tests by their case alone."""
    name = test.split("::")[-1]
    return name[name.index("[") :] if "kernels_matches" in name else name


@pytest.fixture(autouse=True)
def _ctrl_c_left_as_found():
    """A test (or a library it imports) that changes this process's SIGINT handler fails here,
    and the handler is put back: the Ctrl-C tests after it depend on Python's own (seen:
    importing dask_jobqueue set it to sys.exit, and two Ctrl-C tests of test_launch.py then
    failed, one only after its whole timeout)."""
    handler = signal.getsignal(signal.SIGINT)
    yield
    changed = signal.getsignal(signal.SIGINT)
    if changed is not handler:
        signal.signal(signal.SIGINT, handler)
        pytest.fail(f"the test left this process's SIGINT handler changed to {changed!r}")


@pytest.fixture(autouse=True)
def _in_a_temporary_folder(tmp_path, monkeypatch):
    """Every test, and every process it starts, works in its own temporary folder: a run
    directory (runs/<name>-<time>) or a store with a relative default lands there, not in the
    checkout. Subprocesses still import the code under test, not an installed copy."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    )
    # A command that hangs can be made to print its threads' stacks (commands.py:
    # kill_showing_stacks).
    monkeypatch.setenv("PYTHONFAULTHANDLER", "1")


SHARED_WORKERS = 2
# How long a test's last tasks may take to wind down after it returned: a rank group is
# released asynchronously, within launch.release_timeout_s (15 s).
SETTLE_S = 30.0


def _cpu_capability() -> str:
    return torch.backends.cpu.get_cpu_capability()


@pytest.fixture(scope="session")
def cluster():
    """A real 2-worker cluster shared by the tests that leave it as they found it."""
    with start_cluster(n_workers=SHARED_WORKERS, dashboard_port=0) as training_cluster:
        # A suite run on another kernel path (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA) must
        # have its workers on that path too, or it compares nothing new.
        wanted = os.environ.get("ATEN_CPU_CAPABILITY")
        if wanted:
            seen = set(training_cluster.client.run(_cpu_capability).values())
            assert seen == {wanted.upper()}, f"ATEN_CPU_CAPABILITY={wanted}, workers run {seen}"
        isa = os.environ.get("ONEDNN_MAX_CPU_ISA")
        if isa:
            seen = set(training_cluster.client.run(os.environ.get, "ONEDNN_MAX_CPU_ISA").values())
            assert seen == {isa}, f"ONEDNN_MAX_CPU_ISA={isa}, workers have {seen}"
        yield training_cluster


def _busy(dask_worker) -> dict:
    """What keeps this worker from taking the next test's tasks (run with ``Client.run``)."""
    return {
        "status": dask_worker.status.name,
        "executing": sorted(str(ts.key) for ts in dask_worker.state.executing),
        "long_running": sorted(str(ts.key) for ts in dask_worker.state.long_running),
    }


def shared_cluster_problems(client) -> list[str]:
    """Why the shared cluster is not as a test found it: a worker missing, paused, or with a
    task still running in its one thread (every later task sent there would wait behind it).
    Waits up to SETTLE_S for such a task to end."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        problems = []
        workers = live_workers(client)
        if len(workers) != SHARED_WORKERS:
            problems.append(f"{len(workers)} workers instead of {SHARED_WORKERS}")
        for address, state in client.run(_busy, workers=list(workers)).items():
            if state["status"] != "running":
                problems.append(f"{address} is {state['status']}")
            if state["executing"] or state["long_running"]:
                running = state["executing"] + state["long_running"]
                problems.append(f"{address} still runs {running}")
        if not problems or time.monotonic() > deadline:
            return problems
        time.sleep(0.5)


@pytest.fixture(autouse=True)
def _shared_cluster_left_as_found(request):
    """A test that uses the shared cluster must leave it able to run the next test's tasks.
    One that does not fails here, naming what it left; the stuck workers are restarted so
    that the tests after it are not blamed for it."""
    if "cluster" not in request.fixturenames:
        yield
        return
    client = request.getfixturevalue("cluster").client
    yield
    problems = shared_cluster_problems(client)
    if problems:
        stuck = [p.split(" ", 1)[0] for p in problems if p.startswith("tcp://")]
        if stuck:
            client.restart_workers(sorted(set(stuck)), timeout=120)
        if len(live_workers(client)) < SHARED_WORKERS:
            client.wait_for_workers(SHARED_WORKERS, timeout=120)
        pytest.fail(f"the test left the shared cluster unusable: {'; '.join(problems)}")


@pytest.fixture(scope="module")
def four_workers():
    """A 4-worker cluster for the layouts two workers cannot hold (pipeline x data parallel,
    HSDP), one per module that needs it. Its workers fork from this process's fork server, so
    a start is about a second; kept for the whole session it would idle through most of it,
    and an idle worker still spends ~3% of a core (measured: Dask's event loop and monitors),
    which the tests running meanwhile on this 2-core machine wait for."""
    with start_cluster(n_workers=4, dashboard_port=0) as training_cluster:
        yield training_cluster


@pytest.fixture
def own_cluster():
    """A fresh 2-worker cluster for tests that restart, add or kill workers."""
    with start_cluster(n_workers=2, dashboard_port=0) as training_cluster:
        yield training_cluster


@pytest.fixture(scope="session")
def store_dir(tmp_path_factory):
    """Where this session's dataset stores live (shared, so each is built once)."""
    return tmp_path_factory.mktemp("stores")


@pytest.fixture(scope="session")
def make_config(store_dir):
    """Build a validated RunConfig from a dict, with the dataset store in the session folder."""

    def make(raw: dict | None = None, **training) -> RunConfig:
        raw = {k: dict(v) if isinstance(v, dict) else v for k, v in (raw or {}).items()}
        data = raw.setdefault("data", {})
        data.setdefault("store", str(store_dir / data.get("dataset", "digits")))
        raw["training"] = raw.get("training", {}) | training
        return load_config(raw)

    return make


def pytest_collection_modifyitems(config, items):
    # A `large` test runs when asked for by name (-m large, make test-large): minutes and
    # ~18 GB of host memory each, beyond what the suite's budget and CI machines allow.
    if "large" not in (config.option.markexpr or ""):
        skip_large = pytest.mark.skip(reason="a large test: make test-large runs it")
        for item in items:
            if "large" in item.keywords:
                item.add_marker(skip_large)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def s3(tmp_path_factory):
    """A real S3-compatible server for the session (moto's, a process on loopback; see
    workflows/benchmarks/local_s3.py); each module makes its own bucket on it. Started in ~1 s,
    so only when a test asks for it."""
    from workflows.benchmarks.local_s3 import s3_server

    with s3_server(tmp_path_factory.mktemp("s3") / "moto.log") as server:
        yield server
