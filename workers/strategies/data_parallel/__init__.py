"""The runtime of ``data_parallel`` (``local_gpus``); its plan:
``workers/spec/plans/data_parallel.py``."""
