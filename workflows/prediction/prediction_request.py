"""A prediction request checked on the client, before a cluster starts or a task runs.

``prepare`` resolves the trained model (a run directory brings its config and the statistics
of its store; a bare checkpoint takes them from a config), builds it once on the CPU to check
the checkpoint, lists the input into partitions (``workflows/prediction/prediction_input.py``),
matches the input's classes to the model's and refuses an output path that exists. What it hands
back, a :class:`PreparedPrediction`, leaves nothing to fail but the cluster; ``run_prepared``
(``workflows/prediction/batch_predict.py``) scores it.

Its errors name the CLI's options (``--output: ...``); ``predict()`` in Python gives them as
its keyword arguments (``predict(output=...): ...``), see :func:`naming_keywords`.
"""

import json
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
from fsspec import AbstractFileSystem

from workers.inference import ModelSpec, ScoreJob, input_shape
from workers.model_sources import ModelError
from workers.sources import InputPlan, InputRequest
from workers.spec.cluster import ClusterConfig
from workers.spec.errors import ConfigError
from workers.spec.predict import PredictConfig
from workers.spec.run import RunConfig
from workers.spec.tracking import TrackingConfig
from workflows.data.stores import read_manifest
from workflows.prediction.prediction_input import plan_input
from workflows.runs.config import load_config, read_raw_config
from workflows.runs.run_storage import checked_url
from workflows.runs.trust import CONFIG_SIGNATURE, check_config_trusted


def load_predict_config(
    source: str | Path | dict[str, Any], overrides: list[str] | tuple[str, ...] = ()
) -> tuple[RunConfig, PredictConfig]:
    """A config file with an optional ``[predict]`` section → (run config, predict settings)."""
    raw = read_raw_config(source, overrides)
    section = raw.pop("predict", {})
    return load_config(raw), PredictConfig.from_dict(section)


@dataclass(frozen=True)
class TrainedModel:
    """A checkpoint and what it was trained with: model, image size, statistics, classes."""

    checkpoint: str
    config: RunConfig
    classes: list[str]
    mean: list[float]
    std: list[float]
    image_size: int


def resolve_model(
    model: str | Path, config: RunConfig | None = None, *, trust_config: bool = False
) -> TrainedModel:
    """A run directory (or its ``model.pt``) brings its own config and statistics; a bare
    checkpoint takes model and data from ``config``, statistics from that config's store.
    ``model`` may be an fsspec URL (a run kept in a bucket), reached with ``config``'s
    ``data.storage_options`` or the environment's credentials. A run's config.json that names
    its model by import path is refused unless trusted (workflows/runs/trust.py)."""
    given = checked_url("--model", str(model))
    given = given if "://" in given else str(Path(given).expanduser())
    options = dict(config.data.storage_options) if config is not None else {}
    fs, path = fsspec.core.url_to_fs(given, **options)
    if not fs.exists(path):
        raise ConfigError(
            f"--model: {given} does not exist; give a run directory (dask-train run) or a "
            "checkpoint"
        )
    is_dir = fs.isdir(path)
    run_dir = path if is_dir else path.rstrip("/").rsplit("/", 1)[0]
    checkpoint = f"{run_dir}/model.pt" if is_dir else path
    summary: dict[str, Any] = {}
    if fs.isfile(f"{run_dir}/config.json"):
        config = _run_config(fs, run_dir, config, trust_config=trust_config)
        if fs.isfile(f"{run_dir}/summary.json"):
            summary = json.loads(fs.cat_file(f"{run_dir}/summary.json")).get("store", {})
    elif is_dir:
        raise ConfigError(f"--model: {given} holds no config.json; is it a run directory?")
    elif config is None:
        raise ConfigError(
            f"--model: {given} is a bare checkpoint; give the config it was trained with "
            "(model.name, data.store, data.image_size)"
        )
    if not fs.isfile(checkpoint):
        raise ConfigError(
            f"--model: {fs.unstrip_protocol(checkpoint)} does not exist (the run did not finish?)"
        )
    checkpoint = fs.unstrip_protocol(checkpoint) if "://" in given else str(Path(checkpoint))
    return _with_statistics(checkpoint, config, summary)


def _run_config(
    fs: AbstractFileSystem, run_dir: str, config: RunConfig | None, *, trust_config: bool
) -> RunConfig:
    """The config a run directory's config.json holds, checked as trusted (against ``config``'s
    own model and signing key) before anything it names is imported."""
    source = f"--model: {fs.unstrip_protocol(run_dir)}/config.json"
    try:
        raw = json.loads(fs.cat_file(f"{run_dir}/config.json"))
    except json.JSONDecodeError as error:
        raise ConfigError(f"{source} is not a run config: {error}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{source} is not a run config: not a JSON object")
    signed = f"{run_dir}/{CONFIG_SIGNATURE}"
    check_config_trusted(  # before anything it names is imported
        raw,
        source,
        own_model=config.model.name if config is not None else None,
        trust_config=trust_config,
        signing_key_file=config.checkpoint.signing_key_file if config else None,
        signature=fs.cat_file(signed).decode() if fs.isfile(signed) else None,
    )
    try:
        return load_config(raw)
    except ConfigError as error:
        raise ConfigError(f"{source} is not a run config: {error}") from None


def _with_statistics(checkpoint: str, config: RunConfig, summary: dict[str, Any]) -> TrainedModel:
    """The trained model with the statistics and classes it was trained with: from the run's
    ``summary`` where it recorded them, else from the store ``config`` names."""
    if all(key in summary for key in ("mean", "std", "classes")):
        mean, std, classes = summary["mean"], summary["std"], summary["classes"]
        image_size = int(summary.get("image_size", config.data.image_size))
    else:
        # Run directories from before statistics were recorded, and bare checkpoints: the
        # store the model was trained on still knows them.
        url = config.data.store_url
        manifest = read_manifest(url, storage_options=config.data.storage_options)
        if manifest is None:
            raise ConfigError(
                f"data.store: {url} holds no complete dataset store, so the normalization the "
                f"model {checkpoint} was trained with is unknown; point data.store at its store"
            )
        mean, std, classes = manifest["mean"], manifest["std"], manifest["classes"]
        image_size = int(manifest.get("image_size", config.data.image_size))
    return TrainedModel(
        checkpoint=str(checkpoint),
        config=config,
        classes=list(classes),
        mean=[float(v) for v in mean],
        std=[float(v) for v in std],
        image_size=image_size,
    )


@dataclass(frozen=True)
class PreparedPrediction:
    """A request checked on the client: nothing left to fail before scoring but the cluster."""

    name: str
    trained: TrainedModel
    settings: PredictConfig
    plan: InputPlan
    spec: ModelSpec
    job: ScoreJob
    output: str
    storage_options: dict[str, Any]
    cluster: ClusterConfig
    notes: tuple[str, ...] = ()
    tracking: TrackingConfig = field(default_factory=TrackingConfig)


# The options of `dask-train predict` and the keyword arguments of predict() they stand for.
KEYWORDS = {"--model": "model", "--input": "input", "--output": "output"}


def naming_keywords(error: ValueError) -> ValueError:
    """``error`` as ``predict()`` raises it: the same type and message, naming the keyword
    argument (``predict(output=...): ...``) where it names the CLI's option (``--output: ...``)."""
    option, separator, rest = str(error).partition(": ")
    if not separator or option not in KEYWORDS:
        return error
    return type(error)(f"predict({KEYWORDS[option]}=...): {rest}")


def prepare(
    *,
    model: str | Path,
    input: str | Path,
    output: str | Path,
    config: RunConfig | str | Path | dict[str, Any] | None = None,
    settings: PredictConfig | dict[str, Any] | None = None,
    trust_config: bool = False,
) -> PreparedPrediction:
    """Check everything about a request without starting anything; errors name the field or
    file (ConfigError, CheckpointError), the output path first of all, as soon as the model's
    storage options are known: before the model is built or the input listed."""
    if config is not None and not isinstance(config, RunConfig):
        config = load_config(config)
    if not isinstance(settings, PredictConfig):
        settings = PredictConfig.from_dict(settings)
    trained = resolve_model(model, config, trust_config=trust_config)
    if trained.config.training.resolved_task != "classification":
        raise ConfigError(
            f"--model: {trained.checkpoint} was trained for {trained.config.training.resolved_task}"
            f" (training.loss = {trained.config.training.loss}); batch prediction scores "
            "classifiers only"
        )
    options = dict(trained.config.data.storage_options)
    output_url = _check_output(output, options)
    token = uuid.uuid4().hex
    spec, shape = _model_spec(trained, settings, options, token=token)
    if settings.outputs == "top_k" and settings.top_k > len(trained.classes):
        raise ConfigError(
            f"predict.top_k: {settings.top_k} is more than the model's {len(trained.classes)} "
            "classes"
        )
    request = InputRequest(
        image_size=trained.image_size,
        channels=shape[0],
        split=settings.split,
        partition_size=settings.partition_size,
        storage_options=options,
    )
    plan = plan_input(input, request)
    if not plan.count:
        raise ConfigError(f"--input: {plan.url} holds no samples")
    job, notes = _score_job(trained, plan, settings, token=token, options=options)
    cluster_config = config.cluster if isinstance(config, RunConfig) else trained.config.cluster
    return PreparedPrediction(
        name=trained.config.name,
        trained=trained,
        settings=settings,
        plan=plan,
        spec=spec,
        job=job,
        output=output_url,
        storage_options=options,
        cluster=cluster_config,
        notes=tuple(notes),
        # MLflow: the store this request names, else the one the model's run logged to.
        tracking=config.tracking
        if config is not None and config.tracking.mlflow_uri
        else trained.config.tracking,
    )


def _model_spec(
    trained: TrainedModel, settings: PredictConfig, options: dict[str, Any], *, token: str
) -> tuple[ModelSpec, tuple[int, ...]]:
    """What the workers build the model from, and the input shape it takes: built here once,
    which checks the checkpoint file against the model."""
    spec = ModelSpec(
        name=trained.config.model.name,
        kwargs=dict(trained.config.model.kwargs),
        num_classes=len(trained.classes),
        image_size=trained.image_size,
        checkpoint=_read_bytes(trained.checkpoint, options),
        source=trained.checkpoint,
        precision=settings.precision,
        threads=settings.threads_per_worker,
        token=token,
    )
    import torch

    try:
        shape = input_shape(spec.build(torch.device("cpu")), spec.image_size)  # checks the file
    except ModelError as error:  # the run's model cannot be built here (its code is missing)
        raise ConfigError(f"--model: {trained.checkpoint}: {error}") from None
    return spec, shape


def _score_job(
    trained: TrainedModel,
    plan: InputPlan,
    settings: PredictConfig,
    *,
    token: str,
    options: dict[str, Any],
) -> tuple[ScoreJob, list[str]]:
    """What each partition's task is given, and notes for the user: the input's classes
    mapped to the model's (:func:`_label_map`); an input normalized with other statistics than
    the model's is re-normalized with the model's (and a note says so)."""
    label_map, notes = _label_map(plan, trained, settings)
    same_statistics = plan.mean is None or (
        np.allclose(plan.mean, trained.mean, rtol=0, atol=0)
        and np.allclose(plan.std, trained.std, rtol=0, atol=0)
    )
    if not same_statistics:
        notes.append(
            f"the input store was normalized with other statistics; re-normalized with the "
            f"model's (mean {_short(trained.mean)}, std {_short(trained.std)})"
        )
    job = ScoreJob(
        token=token,
        batch_size=settings.batch_size,
        outputs=settings.outputs,
        top_k=settings.top_k,
        classes=tuple(trained.classes),
        image_size=trained.image_size,
        mean=tuple(trained.mean),
        std=tuple(trained.std),
        input_mean=None if same_statistics else tuple(plan.mean or ()),
        input_std=None if same_statistics else tuple(plan.std or ()),
        label_map=label_map,
        storage_options=options,
    )
    return job, notes


def _short(values: list[float]) -> str:
    return "[" + ", ".join(f"{v:.4f}" for v in values) + "]"


def _label_map(
    plan: InputPlan, trained: TrainedModel, settings: PredictConfig
) -> tuple[tuple[int, ...] | None, list[str]]:
    """Input class → model class by name, when the input has labels and they can be used."""
    if settings.evaluate is False:
        return None, []
    if plan.classes is None:
        if settings.evaluate:
            raise ConfigError(f"predict.evaluate: the input {plan.url} has no labels")
        return None, ["the input has no labels: no metrics"]
    unknown = [c for c in plan.classes if c not in trained.classes]
    if unknown:
        message = (
            f"the input's classes {', '.join(unknown[:5])} are not among the model's "
            f"({', '.join(trained.classes[:10])})"
        )
        if settings.evaluate:
            raise ConfigError(f"predict.evaluate: {message}; set predict.evaluate = false")
        return None, [f"{message}: labels left out, no metrics"]
    return tuple(trained.classes.index(c) for c in plan.classes), []


def _read_bytes(url: str, options: dict[str, Any]) -> bytes:
    with fsspec.open(url, "rb", **options) as file:
        return file.read()


def _check_output(output: str | Path, options: dict[str, Any]) -> str:
    url = checked_url("--output", str(output))
    if "://" not in url:
        url = str(Path(url).expanduser().resolve())
    fs, path = fsspec.core.url_to_fs(url, **options)
    if fs.exists(path):
        raise ConfigError(
            f"--output: {url} exists; choose a new path (predictions are never overwritten)"
        )
    return url
