"""A cluster of stock processes, as users start one by hand or a deployment does: ``dask
scheduler`` and ``dask worker`` commands, each a fresh interpreter (nothing forked from a parent
that imported torch), every worker with its nanny. Each process is killed by its pid when the
cluster is left."""

import contextlib
import json
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
from distributed import Client

START_S = 120.0  # a worker's interpreter imports distributed: seconds on a loaded machine


class StockCluster:
    """``dask scheduler`` and ``workers`` ``dask worker`` processes; ``add_worker()`` starts
    one more, as a deployment adds a machine."""

    def __init__(self, workers: int, folder: Path, worker_args: tuple[str, ...] = ()) -> None:
        self.folder, self.worker_args = folder, worker_args
        self.scheduler_file = folder / "scheduler.json"
        self.processes: list[subprocess.Popen] = []
        self._log = open(folder / "cluster.log", "ab")  # noqa: SIM115 (closed on leaving)
        self.client: Client | None = None
        try:
            self._start(
                "distributed.cli.dask_scheduler",
                *("--port", "0", "--no-dashboard", "--scheduler-file", str(self.scheduler_file)),
            )
            self.address = self._scheduler_address()
            self.client = Client(self.address)
            for _ in range(workers):
                self.add_worker()
            self.client.wait_for_workers(workers, timeout=START_S)
        except BaseException:
            self.close()  # what started: a failed start leaves no process behind
            raise

    def _scheduler_address(self) -> str:
        deadline = time.monotonic() + START_S
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError, ValueError, KeyError):  # not written yet, or half
                return json.loads(self.scheduler_file.read_text())["address"]
            time.sleep(0.05)
        raise TimeoutError(f"dask scheduler wrote no {self.scheduler_file} in {START_S:g} s")

    def add_worker(self) -> subprocess.Popen:
        """A new ``dask worker`` (a nanny and its worker process), without waiting for it."""
        return self._start(
            "distributed.cli.dask_worker",
            self.address,
            "--nthreads",
            "1",
            "--no-dashboard",
            *self.worker_args,
        )

    def _start(self, module: str, *args: str) -> subprocess.Popen:
        process = subprocess.Popen(
            [sys.executable, "-m", module, *args],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            cwd=self.folder,
        )
        self.processes.append(process)
        return process

    def close(self) -> None:
        with contextlib.suppress(Exception):
            if self.client is not None:
                self.client.close()
        for process in reversed(self.processes):
            with contextlib.suppress(psutil.Error, ProcessLookupError):
                children = psutil.Process(process.pid).children(recursive=True)
                process.send_signal(signal.SIGKILL)
                for child in children:
                    child.kill()
            process.wait(timeout=30)
        self._log.close()


@contextlib.contextmanager
def stock_cluster(workers: int, worker_args: tuple[str, ...] = ()) -> Iterator[StockCluster]:
    """A `StockCluster` in a temporary folder, closed on leaving."""
    with tempfile.TemporaryDirectory() as folder:
        cluster = StockCluster(workers, Path(folder), worker_args)
        try:
            yield cluster
        finally:
            cluster.close()
