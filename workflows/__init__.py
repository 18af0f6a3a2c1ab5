"""Client side of dask-train: config, cluster, launcher, drivers and CLI.

The public API is small::

    from workflows import launch, load_config, predict, start_cluster, train

    with start_cluster(n_workers=2) as cluster:
        mine = launch(my_training_function, cluster=cluster)  # fn(ctx, ...) on every rank
        result = train("workflows/configs/digits_ddp.toml", cluster=cluster)
        scored = predict(model="runs/<run>", input="data/stores/digits", output="preds",
                         cluster=cluster)
"""

from workers.rank_context import RankContext
from workflows.cluster import ClusterConfig, TrainingCluster, start_cluster
from workflows.code_shipping import CodeNotShippable
from workflows.config import ConfigError, RunConfig, load_config
from workflows.driver import TrainResult, train
from workflows.launch import LaunchResult, TrainingFailed, launch
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
