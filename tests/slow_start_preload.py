"""A Dask worker preload that makes a worker process start slowly, on demand: it waits the
seconds written in the file named by DASK_TRAIN_TEST_SLOW_START, when that file exists (at most
SLOW_START_BOUND_S), then appends its process id to that file's name plus ``.slept``.

Tests use it to make a restart take longer than one of Dask's bounds, without waiting on a
loaded machine for that to happen by chance; the ``.slept`` file shows that it did.
"""

import asyncio
import os
from pathlib import Path

SLOW_START_BOUND_S = 30.0


async def dask_setup(worker: object) -> None:
    # Preloads run before the worker registers with the scheduler: for the scheduler and the
    # cluster object the worker is still gone while this waits.
    marker = os.environ.get("DASK_TRAIN_TEST_SLOW_START")
    if marker and Path(marker).exists():
        await asyncio.sleep(min(float(Path(marker).read_text()), SLOW_START_BOUND_S))
        with open(f"{marker}.slept", "a") as slept:
            slept.write(f"{os.getpid()}\n")
