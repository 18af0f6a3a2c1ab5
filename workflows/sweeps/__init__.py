"""Hyperparameter sweeps whose trials are multi-rank jobs: the search space (``sweep_space``), the
sweep over Optuna (``sweep``), which trial holds which workers (``sweep_owners``) and the sweep's
directory (``sweep_directory``)."""
