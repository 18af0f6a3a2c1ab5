"""The ``[tracking]`` section: where a run's metrics go besides ``metrics.jsonl``
(``workflows/observe/tracking.py`` writes them)."""

import importlib.util
from typing import Self

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from workers.spec.sections import Location

MLFLOW_SCHEMES = ("sqlite:///", "http://", "https://")


class TrackingConfig(BaseModel):
    """Where a run's metrics go besides ``metrics.jsonl``: TensorBoard, MLflow, or neither."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tensorboard: str | None = Field(
        default=None,
        description="a folder for TensorBoard's event files; `dask-train run` uses "
        "<run dir>/tensorboard",
    )
    mlflow_uri: Location = Field(
        default=None,
        description="sqlite:///path/mlflow.db or http(s)://host:port; needs the [mlflow] extra",
    )
    experiment: str | None = Field(
        default=None,
        description="the MLflow experiment (needs mlflow_uri); unset: the config's name",
    )

    @field_validator("tensorboard", "experiment")
    @classmethod
    def _not_blank(cls, value: str | None) -> str | None:
        if value is not None and not value.strip():
            raise ValueError("must not be empty (leave it out to turn it off)")
        return value

    @field_validator("mlflow_uri")
    @classmethod
    def _mlflow_uri(cls, value: str | None) -> str | None:
        if value is None:
            return None
        if not value.startswith(MLFLOW_SCHEMES):
            # MLflow 3 refuses the plain file store unless told otherwise: SQLite is the local
            # store that works out of the box.
            raise ValueError(
                f"{value!r} is not a tracking store this accepts; use sqlite:///path/mlflow.db "
                "for a local store or http(s)://host:port for an MLflow server"
            )
        if value.startswith("sqlite:///") and not value.removeprefix("sqlite:///"):
            raise ValueError("sqlite:/// needs a database file, e.g. sqlite:///runs/mlflow.db")
        if importlib.util.find_spec("mlflow") is None:
            raise ValueError(
                "MLflow is not installed; pip install 'dask-train[mlflow]' (or mlflow-skinny, "
                "sqlalchemy and alembic)"
            )
        return value

    @model_validator(mode="after")
    def _experiment_needs_mlflow(self) -> Self:
        if self.experiment is not None and self.mlflow_uri is None:
            raise ValueError("tracking.experiment: set tracking.mlflow_uri too, or leave it out")
        return self

    @property
    def enabled(self) -> bool:
        return self.tensorboard is not None or self.mlflow_uri is not None
