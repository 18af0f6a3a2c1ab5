"""glibc's malloc settings for a worker forked from a fork server (a Dask worker preload).

A spawned process reads ``MALLOC_TRIM_THRESHOLD_`` and ``MALLOC_MMAP_THRESHOLD_`` when glibc
starts; a forked one inherits the fork server's, made before the cluster's settings were
known. So the worker applies the values its nanny gave it with ``mallopt``, which sets the
same two parameters.
"""

import ctypes
import os

# mallopt parameter numbers from glibc's malloc.h.
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
VARIABLES = {"MALLOC_TRIM_THRESHOLD_": M_TRIM_THRESHOLD, "MALLOC_MMAP_THRESHOLD_": M_MMAP_THRESHOLD}


def apply_malloc_settings() -> dict[str, int]:
    """Apply the variables that are set; returns what was applied (empty off glibc)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return {}
    applied = {}
    for name, parameter in VARIABLES.items():
        value = os.environ.get(name)
        if value is not None and value.isdigit() and libc.mallopt(parameter, int(value)) == 1:
            applied[name] = int(value)
    return applied


def dask_setup(worker: object) -> None:
    """The preload hook: runs once in each worker process as it starts."""
    apply_malloc_settings()


def release_free_memory() -> bool:
    """Hand the memory glibc's malloc holds free back to the kernel (``malloc_trim``): what an
    earlier job freed then stops counting as resident. False off glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    return bool(libc.malloc_trim(0))
