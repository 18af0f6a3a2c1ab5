"""A run's spec: the config sections (:mod:`.sections`), the names a config may use
(:mod:`.names`), how the ranks divide the work (:mod:`.layout`) and each strategy's plan
(:mod:`.plans`).

A leaf: it imports nothing else of the project, and no torch, so the client (``workflows/``)
and the ranks (the rest of ``workers/``) both read it, and a config validates in a process that
never imports torch. ``tests/test_import_graph.py`` holds it to that.
"""
