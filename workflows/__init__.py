"""Client side of dask-train: config, cluster, launcher, drivers and CLI.

The public API is small::

    from workflows import load_config, predict, start_cluster, train

    with start_cluster(n_workers=2) as cluster:
        result = train("workflows/configs/digits_ddp.toml", cluster=cluster)
        scored = predict(model="runs/<run>", input="data/stores/digits", output="preds",
                         cluster=cluster)
"""

from workflows.cluster import ClusterConfig, TrainingCluster, start_cluster
from workflows.config import ConfigError, RunConfig, load_config
from workflows.driver import TrainResult, train
from workflows.launcher import (
    LaunchConfig,
    LaunchError,
    ProcessGroup,
    RankFailed,
    WorkerSelection,
)
from workflows.predict import PredictConfig, PredictResult, predict
from workflows.security import SecurityConfig

__all__ = [
    "ClusterConfig",
    "ConfigError",
    "LaunchConfig",
    "LaunchError",
    "PredictConfig",
    "PredictResult",
    "ProcessGroup",
    "RankFailed",
    "RunConfig",
    "SecurityConfig",
    "TrainResult",
    "TrainingCluster",
    "WorkerSelection",
    "load_config",
    "predict",
    "start_cluster",
    "train",
]
