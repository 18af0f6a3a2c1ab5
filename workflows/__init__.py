"""Client side of dask-train: config, cluster, launcher, drivers and CLI.

The public API is small::

    from workflows import launch, load_config, predict, start_cluster, train

    with start_cluster(n_workers=2) as cluster:
        mine = launch(my_training_function, cluster=cluster)  # fn(ctx, ...) on every rank
        result = train("workflows/configs/digits_ddp.toml", cluster=cluster)
        scored = predict(model="runs/<run>", input="data/stores/digits", output="preds",
                         cluster=cluster)
"""

import importlib
from typing import Any

from workflows.cluster import ClusterConfig, TrainingCluster, start_cluster
from workflows.config import ConfigError, RunConfig, load_config
from workflows.launcher import (
    LaunchConfig,
    LaunchError,
    ProcessGroup,
    RankFailed,
    WorkerSelection,
)
from workflows.predict import PredictConfig, PredictResult, predict
from workflows.security import SecurityConfig

# The driver is imported on first use: the scheduler imports workflows.dashboard and
# workflows.monitoring, and the driver (which imports them) must not come along.
_LAZY = {
    "CodeNotShippable": "workflows.code_shipping",
    "TrainResult": "workflows.driver",
    "train": "workflows.driver",
    "LaunchResult": "workflows.jobs",
    "TrainingFailed": "workflows.jobs",
    "launch": "workflows.jobs",
    "RankContext": "workers.rank_context",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "ClusterConfig",
    "CodeNotShippable",
    "ConfigError",
    "LaunchConfig",
    "LaunchError",
    "LaunchResult",
    "PredictConfig",
    "PredictResult",
    "ProcessGroup",
    "RankContext",
    "RankFailed",
    "RunConfig",
    "SecurityConfig",
    "TrainResult",
    "TrainingCluster",
    "TrainingFailed",
    "WorkerSelection",
    "launch",
    "load_config",
    "predict",
    "start_cluster",
    "train",
]
