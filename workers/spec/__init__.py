"""A run's spec, the first place to read: every section of its configuration, one module a
section (the trainer's in :mod:`.sections`; the client's in :mod:`.cluster`, :mod:`.security`,
:mod:`.launch`, :mod:`.tracking`; batch inference's in :mod:`.predict`), the whole
:class:`~workers.spec.run.RunConfig` that composes them (:mod:`.run`), how a bad one is told
(:mod:`.errors`), the names a config may use (:mod:`.names`), how the ranks divide the work
(:mod:`.layout`) and each strategy's plan (:mod:`.plans`).

A leaf: it imports nothing else of the project, and no torch, so the client (``workflows/``)
and the ranks (the rest of ``workers/``) both read it, and a config validates in a process that
never imports torch. ``tests/test_import_graph.py`` holds it to that.
"""
