"""Waiting on Dask futures with the client that made them.

``distributed.wait`` waits on the default client: the newest one the process made, unless
another is made current. In a process with several clients (a notebook's own, a sweep's, a
worker's client inside a task) that may be another client, whose event loop cannot wait on
these futures: the wait fails at once with "bound to a different event loop" instead of
waiting. A clean-up that swallowed that error went on while tasks still wrote into a store.
"""

import concurrent.futures
from collections.abc import Sequence
from typing import Any, Literal

from distributed import Future, wait


def wait_futures(
    futures: Sequence[Future],
    *,
    timeout_s: float | None,
    return_when: Literal["ALL_COMPLETED", "FIRST_COMPLETED"] = "ALL_COMPLETED",
) -> Any:
    """``distributed.wait`` on the futures' own client; ``TimeoutError`` after ``timeout_s``."""
    if not futures:  # nothing to wait on, and no client to ask (there may be none)
        return concurrent.futures.wait([])  # what distributed.wait returns: (done, not_done)
    with futures[0].client.as_current():
        return wait(futures, timeout=timeout_s, return_when=return_when)
