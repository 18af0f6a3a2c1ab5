"""A real S3-compatible server for the tests and `make bench-checkpoint`: moto's server mode
(the test extra), started as a process on loopback (not an in-process mock: the workers reach
it over HTTP through s3fs, as they would reach a bucket), and killed by its pid when done."""

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# moto accepts any credentials; these only have to be the same on every side.
KEY, SECRET = "dask-train-test-key", "dask-train-test-secret"
START_TIMEOUT_S = 30.0  # moto imports in ~1 s here; a loaded 2-core machine takes longer


@dataclass(frozen=True)
class S3Server:
    endpoint: str  # http://127.0.0.1:<port>
    pid: int

    @property
    def storage_options(self) -> dict[str, Any]:
        """s3fs's options for this server: what ``checkpoint.storage_options`` holds."""
        return {"endpoint_url": self.endpoint, "key": KEY, "secret": SECRET}

    @property
    def environment(self) -> dict[str, str]:
        """The same options where boto finds them (a CLI, a worker): environment variables."""
        return {
            "AWS_ACCESS_KEY_ID": KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET,
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_DEFAULT_REGION": "us-east-1",
        }

    def filesystem(self) -> Any:
        """An s3fs filesystem on this server (fsspec caches it: one per process)."""
        import s3fs

        return s3fs.S3FileSystem(**self.storage_options)

    def bucket(self, name: str) -> str:
        """A new, empty bucket; its URL."""
        self.filesystem().mkdir(name)
        return f"s3://{name}"


@contextlib.contextmanager
def s3_server(
    log: Path, *, host: str = "127.0.0.1", prefix: tuple[str, ...] = ()
) -> Iterator[S3Server]:
    """moto's server on a free port of ``host`` (it picks one: port 0), its log in ``log``;
    ``prefix`` runs it inside a network namespace (``ip netns exec NAME``)."""
    with log.open("wb") as out:
        process = subprocess.Popen(
            [*prefix, sys.executable, "-m", "moto.server", "-H", host, "-p", "0"],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=log.parent,
            # Its own session: a Ctrl-C meant for pytest does not reach it first.
            start_new_session=True,
        )
    try:
        endpoint = _wait_for_port(process, log, host)
        if not prefix:  # from here: a namespace's address is not reachable from this one
            _wait_until_serving(endpoint, process)
        yield S3Server(endpoint=endpoint, pid=process.pid)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, signal.SIGKILL)
        process.wait(timeout=30)


def _wait_for_port(process: subprocess.Popen, log: Path, host: str) -> str:
    """The address the server's log says it listens on (Werkzeug: "Running on http://...")."""
    deadline = time.monotonic() + START_TIMEOUT_S
    pattern = rb"Running on (http://" + re.escape(host).encode() + rb":\d+)"
    while time.monotonic() < deadline:
        found = re.search(pattern, log.read_bytes())
        if found:
            return found.group(1).decode()
        if process.poll() is not None:
            raise RuntimeError(f"moto's server exited ({process.returncode}): {log.read_text()}")
        time.sleep(0.05)
    raise TimeoutError(f"moto's server did not start within {START_TIMEOUT_S} s: {log.read_text()}")


def _wait_until_serving(endpoint: str, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        try:
            with urllib.request.urlopen(endpoint, timeout=5):
                return
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                raise
            time.sleep(0.05)
