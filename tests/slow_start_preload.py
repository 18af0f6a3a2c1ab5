"""A Dask worker preload that makes a worker process start slowly, on demand: it waits the
seconds written in the file named by DASK_TRAIN_TEST_SLOW_START, when that file exists.

Tests use it to make a restart take longer than one of Dask's bounds, without waiting on a
loaded machine for that to happen by chance.
"""

import asyncio
import os
from pathlib import Path


async def dask_setup(worker: object) -> None:
    # Preloads run before the worker registers with the scheduler: for the scheduler and the
    # cluster object the worker is still gone while this waits.
    marker = os.environ.get("DASK_TRAIN_TEST_SLOW_START")
    if marker and Path(marker).exists():
        await asyncio.sleep(float(Path(marker).read_text()))
