"""The runtime of ``fsdp`` (``sharding``); its plan: ``workers/spec/plans/fsdp.py``."""
