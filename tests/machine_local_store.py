"""A Dask worker preload standing for a machine that keeps a copy of a dataset store on its own
disk: as the worker starts, the store folder named by DASK_TRAIN_TEST_LOCAL_STORE is copied to
``LOCAL_STORE_URL``, a ``memory://`` URL: fsspec's in-memory filesystem, which each process has
to itself. A worker started without this preload (a stock ``dask worker`` on another machine)
finds no store there, as a machine without the data would.
"""

import os

import fsspec

LOCAL_STORE_URL = "memory://machine-local/digits"


def copy_store(folder: str) -> None:
    """This process's copy of the store in ``folder`` at ``LOCAL_STORE_URL`` (once)."""
    memory = fsspec.filesystem("memory")
    if not memory.exists(LOCAL_STORE_URL):
        memory.put(folder, LOCAL_STORE_URL, recursive=True)


def dask_setup(worker: object) -> None:
    folder = os.environ.get("DASK_TRAIN_TEST_LOCAL_STORE")
    if folder:
        copy_store(folder)
