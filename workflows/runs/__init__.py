"""A run of the built-in trainer, client side, in the order it happens: its TOML read and
validated into the spec's ``RunConfig`` (``config``), resolved once on its cluster into the facts
every later step reads (``resolved_run``), its memory and stages planned (``planner``), driven on
the cluster (``driver``) with the terminal's progress (``progress``), and kept in its run
directory and bucket (``run_directory``, ``run_storage``, ``object_journal``) with its config's
signature (``trust``); the trained model handed back (``model_handback``); ``make screenshot``'s
short run (``screenshot``)."""
