"""The private APIs of the client-only libraries dask-train relies on, one module per library
(see ``workers/compat/`` for torch, distributed and the standard library, which code on the
workers needs too).

- :mod:`workflows.compat.optuna_private`: Optuna (sweeps; the ``[sweep]`` extra)
"""
