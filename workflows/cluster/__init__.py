"""The cluster the jobs run on: one Dask worker per GPU, CPU worker processes behind the same
interface, or an existing cluster by address (``training_cluster``); its TLS (``security``); the
nanny preload that keeps replacement workers warm (``warm_workers``)."""
