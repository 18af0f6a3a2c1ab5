"""The runtime of ``pipeline`` (``schedule``); its plan: ``workers/spec/plans/pipeline.py``."""
