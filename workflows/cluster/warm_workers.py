"""Warm replacements for stock ``dask worker`` processes: a nanny preload.

    dask worker SCHEDULER --preload-nanny workflows.cluster.warm_workers

A nanny starts its worker process afresh, and starts another when that one dies (a SIGKILL, the
kernel's OOM killer, a rank's abort): each a new interpreter that imports torch before it can
take a rank again, 4-6 s on a loaded machine, all of it lost by a fixed-size job waiting for
the replacement (issue 58 measured 5.8-6.6 s lost to one SIGKILL on a stock cluster). With this
preload the nanny forks its worker processes from a fork server that imported torch and what
ranks use once, as ``start_cluster``'s local workers are
(``workflows/cluster/training_cluster.py``): a replacement is back with torch loaded in a fraction
of a second. The fork server costs the machine its imports once, when the nanny starts, and ~400 MB
that the workers share."""

import dask

from workflows.cluster.training_cluster import ensure_fork_server


def dask_setup(nanny: object) -> None:
    """Dask's preload hook, run in the nanny before it starts its first worker process."""
    dask.config.set({"distributed.worker.multiprocessing-method": "forkserver"})
    ensure_fork_server()
