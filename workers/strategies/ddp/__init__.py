"""The runtime of ``ddp`` (``replicas``); its plan: ``workers/spec/plans/ddp.py``."""
