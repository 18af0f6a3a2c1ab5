"""Client side of dask-train: config, cluster, launcher, drivers and CLI.

The public API is ``workflows.__all__``, imported from ``workflows`` and listed in the docs'
API reference (docs/reference/api.md); every other module and name is internal and may change.
It is small::

    from workflows import launch, load_config, predict, start_cluster, sweep, train

    with start_cluster(n_workers=2) as cluster:
        mine = launch(my_training_function, cluster=cluster)  # fn(ctx, ...) on every rank
        result = train("workflows/configs/digits_ddp.toml", cluster=cluster)
        scored = predict(model="runs/<run>", input="data/stores/digits", output="preds",
                         cluster=cluster)
        best = sweep(my_training_function, {"lr": ("log", 1e-4, 1e-1)}, n_trials=8,
                     metric="val_loss", cluster=cluster).best_params  # pip install '.[sweep]'
"""

import importlib
from typing import Any

# Each name is imported on first use, from its module: importing any part of the package (the
# CLI, the config) runs this file, and ``dask-train validate`` must not pay for torch, which the
# driver and batch inference import.
_HOMES = {
    "ClusterConfig": "workers.spec.cluster",
    "TrainingCluster": "workflows.cluster.training_cluster",
    "start_cluster": "workflows.cluster.training_cluster",
    "ConfigError": "workers.spec.errors",
    "RunConfig": "workers.spec.run",
    "load_config": "workflows.runs.config",
    "TrainResult": "workflows.runs.driver",
    "train": "workflows.runs.driver",
    "LaunchConfig": "workers.spec.launch",
    "LaunchError": "workflows.jobs.launcher",
    "RankFailed": "workflows.jobs.launcher",
    "WorkerSelection": "workers.spec.launch",
    "PredictConfig": "workers.spec.predict",
    "PredictResult": "workflows.prediction.batch_predict",
    "predict": "workflows.prediction.batch_predict",
    "SecurityConfig": "workers.spec.security",
    "CodeNotShippable": "workflows.jobs.code_shipping",
    "DataError": "workflows.jobs.collections",
    "CheckpointError": "workers.inference",
    "JobStopped": "workflows.jobs.launcher",
    "LaunchResult": "workflows.jobs.launch",
    "TrainingFailed": "workflows.jobs.launch",
    "launch": "workflows.jobs.launch",
    "SweepResult": "workflows.sweeps.sweep",
    "sweep": "workflows.sweeps.sweep",
    "RankContext": "workers.rank_context",
}


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'workflows' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOMES])


__all__ = [
    "CheckpointError",
    "ClusterConfig",
    "CodeNotShippable",
    "ConfigError",
    "DataError",
    "JobStopped",
    "LaunchConfig",
    "LaunchError",
    "LaunchResult",
    "PredictConfig",
    "PredictResult",
    "RankContext",
    "RankFailed",
    "RunConfig",
    "SecurityConfig",
    "SweepResult",
    "TrainResult",
    "TrainingCluster",
    "TrainingFailed",
    "WorkerSelection",
    "launch",
    "load_config",
    "predict",
    "start_cluster",
    "sweep",
    "train",
]
