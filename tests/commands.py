"""The batch CLI as the tests run it: a real process running this checkout's code."""

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil

CONFIGS = Path(__file__).parents[1] / "workflows" / "configs"


def dask_train(*args: str) -> list[str]:
    """The command line of ``dask-train ARGS``."""
    return [sys.executable, "-c", "from workflows.cli import main; main()", *args]


def run_dask_train(*args: str, timeout: float = 300, **options) -> subprocess.CompletedProcess:
    """Run ``dask-train ARGS`` to its end (``options`` go to ``subprocess.run``: cwd, env)."""
    return subprocess.run(
        dask_train(*args), capture_output=True, text=True, timeout=timeout, **options
    )


def run_python(code: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter (``python -c``) to its end, capturing its output:
    what a new process imports and prints, not this test process's state."""
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout
    )


def digits_run(
    store_dir: Path, output: Path, *, config: str = "digits_ddp.toml", **training
) -> list[str]:
    """The arguments of ``run`` on an example digits config that keep its store, dashboard and
    run directory in the test; ``training`` overrides ``[training]`` keys."""
    return [
        *("run", str(CONFIGS / config)),
        *("--set", f"data.store='{store_dir / 'digits'}'"),
        *("--set", "cluster.dashboard_port=0"),
        *(item for key, value in training.items() for item in ("--set", f"training.{key}={value}")),
        *("--output", str(output)),
    ]


def kill_showing_stacks(process: subprocess.Popen) -> str:
    """Kill a command that hangs, and return what it printed to stderr since (when it was
    started with ``stderr=PIPE`` and nothing reads it): each of its threads' stack. The tests
    start every command with Python's fault handler on (``PYTHONFAULTHANDLER``, conftest.py),
    which prints them on SIGABRT; a hang that shows up once in many runs is then diagnosable
    from that one run's report."""
    process.send_signal(signal.SIGABRT)
    try:
        return process.communicate(timeout=30)[1] or ""
    except subprocess.TimeoutExpired:
        process.kill()
        return process.communicate(timeout=30)[1] or ""


def session_leftovers(session: int) -> list[psutil.Process]:
    """The processes still alive in the session a command was started in with
    ``start_new_session=True`` (its id is the command's pid): what it left behind. Zombies
    are not counted: they have exited, and wait for this machine's init to reap them."""
    alive = []
    for candidate in psutil.process_iter():
        with contextlib.suppress(psutil.Error, ProcessLookupError):
            if os.getsid(candidate.pid) == session and candidate.status() != psutil.STATUS_ZOMBIE:
                alive.append(candidate)
    return alive


@contextlib.contextmanager
def stock_dask_worker(
    scheduler: str, log: Path, *args: str, env: dict[str, str] | None = None
) -> Iterator[subprocess.Popen]:
    """A stock ``dask worker SCHEDULER ARGS`` process, as a deployment starts one on a new
    machine: a fresh interpreter that has imported nothing of torch, with a nanny unless ARGS
    say ``--no-nanny``. Its output goes to ``log``; it and its children are killed by pid on
    leaving. ``env``: variables to set in its environment."""
    with open(log, "ab") as output:
        worker = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "distributed.cli.dask_worker",
                scheduler,
                "--nthreads",
                "1",
                "--no-dashboard",
                *args,
            ],
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, **(env or {})},
        )
    try:
        yield worker
    finally:
        for process in [*session_leftovers(worker.pid)]:
            with contextlib.suppress(psutil.Error, ProcessLookupError):
                process.kill()
        worker.kill()
        worker.wait(timeout=30)
