"""The ``[predict]`` section: how batch inference scores
(``workflows/prediction/prediction_request.py`` checks a request with it;
``workflows/prediction/batch_predict.py`` runs it)."""

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from workers.spec.errors import ConfigError, one_line


class PredictConfig(BaseModel):
    """How to score: the ``[predict]`` section of a config file, or ``--set predict.KEY=V``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    batch_size: int = Field(default=256, ge=1, description="images per forward pass per device")
    precision: Literal["fp32", "bf16", "fp16"] = Field(
        default="fp32", description="autocast dtype for the forward pass"
    )
    outputs: Literal["class", "probabilities", "top_k"] = Field(
        default="probabilities",
        description="class and confidence only; or every class's probability; or the top k",
    )
    top_k: int = Field(default=3, ge=1, description="outputs = 'top_k': how many classes")
    format: Literal["parquet", "zarr"] = Field(
        default="parquet", description="predictions.parquet, or predictions.zarr arrays"
    )
    partition_size: int = Field(default=1024, ge=1, description="samples per predict task")
    split: Literal["val", "train"] = Field(
        default="val", description="which split of a dataset store (or of train/ and val/)"
    )
    evaluate: bool | None = Field(
        default=None,
        description="metrics from the labels: None when the input's labels name the model's "
        "classes, True to insist, False never",
    )
    threads_per_worker: int | None = Field(
        default=None, ge=1, description="torch threads per worker while scoring"
    )
    timeout_s: float = Field(default=3600.0, gt=0, description="bound on the whole scoring")
    queue_timeout_s: float = Field(
        default=3600.0,
        gt=0,
        description="on a shared cluster, how long the job may wait for a free worker",
    )

    @classmethod
    def from_dict(cls, raw: dict[str, Any] | None) -> "PredictConfig":
        """Validate, with errors as one line naming ``predict.<field>``."""

        class _Section(BaseModel):
            model_config = ConfigDict(extra="forbid")
            predict: PredictConfig = PredictConfig()

        try:
            return _Section.model_validate({"predict": raw or {}}).predict
        except ValidationError as error:
            raise ConfigError(one_line(error)) from None
