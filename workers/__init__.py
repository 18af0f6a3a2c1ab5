"""Code that runs inside a Dask worker: the process-group plugin, data, models, strategies and
the per-rank training loop. Nothing in here starts or talks to a Dask client."""
