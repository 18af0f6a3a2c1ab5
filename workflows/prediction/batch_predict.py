"""Batch inference from a client: a trained model scores a dataset as Dask tasks.

>>> from workflows import predict
>>> result = predict(model="runs/digits-ddp-…", input="data/stores/digits", output="preds/val")
>>> result.metrics["accuracy"], result.images_per_s

Everything that can be wrong with the request (the checkpoint, the input, the output path) is
checked on the client before a cluster starts or a task runs (``prepare``, in
``workflows/prediction/prediction_request.py``; its names are importable from here too). Then the
model goes to every worker once, in a worker plugin; the input's partitions are scored as
``predict-…`` tasks; the predictions are written as Parquet through dask.dataframe (or into a
zarr group), and with labels, the confusion matrix is a Dask reduction over the same
partitions.

PATH/
  predictions.parquet/   part.000000.parquet, … (or predictions.zarr)
  metrics.json           accuracy, per-class precision and recall, the confusion matrix
  confusion_matrix.png
  summary.json           model, input, counts, images/s, the settings used
"""

import contextlib
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import dask
import dask.dataframe as dd
import fsspec
import numpy as np
import pandas as pd
import zarr
from distributed import Client

from workers.inference import (
    CheckpointError,
    ModelPlugin,
    ScoreJob,
    empty_frame,
    model_plugin_name,
    score_partition,
    write_zarr_partition,
    zarr_columns,
)
from workers.sources import InputPlan, SourceError
from workers.spec.errors import ConfigError
from workers.spec.launch import LaunchConfig, WorkerSelection
from workers.spec.names import model_source
from workers.spec.predict import PredictConfig
from workers.spec.run import RunConfig
from workflows.cluster.training_cluster import (
    TrainingCluster,
    WorkersGone,
    live_workers,
    start_cluster,
    wait_on_workers,
)
from workflows.jobs.admission import Admission, Request, Waits
from workflows.jobs.code_shipping import ship_modules
from workflows.jobs.spec import JobSpec
from workflows.observe.tracking import kept_mlflow_run_id, track_prediction
from workflows.prediction.confusion import confusion_metrics, plot_confusion_matrix
from workflows.prediction.prediction_request import (
    PreparedPrediction,
    TrainedModel,
    load_predict_config,
    naming_keywords,
    prepare,
    resolve_model,
)

logger = logging.getLogger(__name__)

PREDICTIONS = {"parquet": "predictions.parquet", "zarr": "predictions.zarr"}


@dataclass
class PredictResult:
    """What a finished `predict` hands back to the client.

    Attributes:
        output: The output folder.
        predictions: The Parquet folder or the zarr group inside it.
        format: ``"parquet"`` or ``"zarr"``.
        count: Samples scored.
        partitions: ``predict-…`` tasks run.
        workers: Workers that scored.
        classes: The model's class names, by index.
        seconds: From the first task submitted to the last file written.
        images_per_s: ``count / seconds``.
        metrics: Accuracy, per-class precision, recall and support, the confusion matrix;
            ``None`` without labels.
        token: The job's id on the workers.
        notes: What the client adapted (e.g. re-normalized input), one line each.
    """

    output: str
    predictions: str  # the Parquet folder or the zarr group
    format: str
    count: int
    partitions: int
    workers: int
    classes: list[str]
    seconds: float  # from the first task submitted to the last file written
    images_per_s: float
    metrics: dict[str, Any] | None
    token: str = ""  # the job's id on the workers (workers.inference.worker_report)
    notes: list[str] = field(default_factory=list)

    def read(self) -> pd.DataFrame:
        """The predictions, one row per input sample, in input order.

        Returns:
            A pandas DataFrame: ``index``, ``sample_id``, ``label``, ``prediction``,
            ``confidence`` and the outputs' columns.
        """
        if self.format == "parquet":
            frame = pd.read_parquet(self.predictions)
            return frame.sort_values("index", ignore_index=True)
        group = zarr.open_group(self.predictions, mode="r")
        columns: dict[str, Any] = {
            name: np.asarray(group[name][:])
            for name in ("index", "sample_id", "label", "prediction", "confidence")
        }
        for name in ("probabilities", "top_classes", "top_probabilities"):
            if name in group:
                values = np.asarray(group[name][:])
                for j in range(values.shape[1]):
                    columns[f"{name}_{j}"] = values[:, j]
        return pd.DataFrame(columns)


def predict(
    *,
    model: str | Path,
    input: str | Path,
    output: str | Path,
    config: RunConfig | str | Path | dict[str, Any] | None = None,
    settings: PredictConfig | dict[str, Any] | None = None,
    cluster: TrainingCluster | Client | None = None,
    trust_config: bool = False,
) -> PredictResult:
    """Score ``input`` with the trained ``model`` on ``cluster`` (or on a local cluster
    started and closed here) and write the predictions to ``output``.

    The model travels once to each worker (a worker plugin); one ``predict-…`` task per
    partition scores and writes its rows. Everything is checked on the client first.

    Args:
        model: A run directory (`dask-train run`'s, or its ``model.pt``), or a checkpoint
            that ``config`` describes.
        input: A dataset store, an image folder (with or without class folders) or CIFAR-10's
            test batch.
        output: A path that must not exist: ``predictions.parquet`` (or ``.zarr``),
            ``metrics.json``, ``confusion_matrix.png`` and ``summary.json`` go there.
        config: For a bare checkpoint: the run config (a `RunConfig`, TOML path or dict)
            naming the model and the store whose statistics it was trained with.
        settings: A `PredictConfig` or a dict of its fields (the ``[predict]`` keys).
        cluster: A `TrainingCluster` or a Dask ``Client``; ``None`` starts a local cluster
            and closes it afterwards.
        trust_config: Build a model that the run's config.json names by import path
            (``package.module:factory``): its code runs here and on the workers. Without it
            such a run is refused unless ``config`` names the same model, or the run's
            config.json is signed with ``config``'s ``checkpoint.signing_key_file``.

    Returns:
        The counts, timings and metrics; ``read()`` loads the predictions.

    Raises:
        ConfigError: A model, input, output or setting that cannot work, before a cluster
            starts (when ``cluster`` is None) or any task runs; one line naming the argument
            (``predict(output=...): ... exists``) or the setting (``predict.batch_size``).
        CheckpointError: A checkpoint that does not fit the model (a `ValueError`), likewise.
        ScoringWorkersLost: Every worker scoring it left the cluster (a `RuntimeError`), said
            once that is seen (asked every second), not at ``predict.timeout_s``.
    """
    try:
        prepared = prepare(
            model=model,
            input=input,
            output=output,
            config=config,
            settings=settings,
            trust_config=trust_config,
        )
    except (ConfigError, CheckpointError, SourceError) as error:
        raise naming_keywords(error) from None
    owned = cluster is None
    if cluster is None:
        cluster = start_cluster(prepared.cluster)
    client = cluster.client if isinstance(cluster, TrainingCluster) else cluster
    try:
        return run_prepared(client, prepared)
    finally:
        if owned:
            cluster.close()


def run_prepared(client: Client, prepared: PreparedPrediction) -> PredictResult:
    """Score a checked request on ``client``'s cluster and write everything out."""
    started = time.perf_counter()
    # A model named by import path: its module goes to the workers that cannot import it.
    if model_source(prepared.spec.name)[0] == "import_path":
        ship_modules(client, {prepared.spec.name.partition(":")[0].split(".")[0]})
    # The job scores on the workers no other job holds (at least one: it waits for one), each
    # of them loading the model once, here.
    request = Request(
        job_id=JobSpec.mint(prepared.name, prefix="predict-", token=prepared.job.token).job_id,
        name=f"predict-{prepared.name}",
        client=client.id,
        minimum=1,
        maximum=max(1, len(live_workers(client))),
        selection=WorkerSelection(),
        plugins=(model_plugin_name(prepared.job.token),),
    )
    with Admission(
        client,
        request,
        Waits(
            queue_timeout_s=prepared.settings.queue_timeout_s,
            worker_wait_s=LaunchConfig().worker_wait_s,
            queue_field="predict.queue_timeout_s",
        ),
    ) as admission:
        return _score(client, prepared, admission.hold(), started=started)


def _score(
    client: Client, prepared: PreparedPrediction, held: list[str], *, started: float
) -> PredictResult:
    """Score every partition on the ``held`` workers, write the predictions once each, and
    the metrics and summary beside them."""
    plan, settings, job = prepared.plan, prepared.settings, prepared.job
    fs, root = fsspec.core.url_to_fs(prepared.output, **prepared.storage_options)
    predictions = f"{prepared.output.rstrip('/')}/{PREDICTIONS[settings.format]}"
    plugin = ModelPlugin(prepared.spec, held)
    client.register_plugin(plugin, name=plugin.name)
    futures: list[Any] = []
    try:
        fs.makedirs(root, exist_ok=True)
        futures = client.compute(
            _scoring_graph(prepared, predictions), workers=held, allow_other_workers=False
        )
        _wait_scored(client, futures, held, timeout_s=settings.timeout_s, samples=plan.count)
        results = client.gather(futures)
    except BaseException:
        # A failed, timed-out or interrupted job leaves no tasks queued behind it.
        if futures:
            client.cancel(futures)
        raise
    finally:
        # The workers free the model now rather than hold it until the next job.
        with contextlib.suppress(Exception):
            client.unregister_worker_plugin(plugin.name)
    seconds = time.perf_counter() - started
    # What is on disk must be every input sample, once.
    count = _parquet_rows(fs, predictions) if settings.format == "parquet" else int(results[0])
    if count != plan.count:
        raise RuntimeError(f"wrote {count} predictions, but the input has {plan.count} samples")
    metrics = None
    if job.label_map is not None:
        metrics = _write_confusion(fs, root, results[1], classes=list(job.classes))
    result = PredictResult(
        output=prepared.output,
        predictions=predictions,
        format=settings.format,
        count=count,
        partitions=len(plan.partitions),
        workers=len(held),
        classes=list(job.classes),
        seconds=seconds,
        images_per_s=count / seconds,
        metrics=metrics,
        token=job.token,
        notes=list(prepared.notes),
    )
    _write_json(fs, f"{root}/summary.json", _summary(prepared, result))
    logger.info("scored %d samples in %.1f s on %d workers", count, seconds, len(held))
    _track(prepared, fs, root)
    return result


def _scoring_graph(prepared: PreparedPrediction, predictions: str) -> list[Any]:
    """The Dask collections that score and write every partition, and with labels count the
    confusion matrix in the same pass: the writes' (a row count for zarr), then the counts."""
    plan, settings, job = prepared.plan, prepared.settings, prepared.job
    # One task per partition, ("predict-<name>-<job>-…", i) on the dashboard. Sample ids
    # are str already: dask's string conversion would only add a task per partition.
    with dask.config.set({"dataframe.convert-string": False}):
        frame = dd.from_map(
            score_partition,
            plan.partitions,
            job=job,
            meta=empty_frame(job),
            label=f"predict-{prepared.name}-{job.token[:8]}",
            enforce_metadata=False,
        )
    if settings.format == "parquet":
        # Each partition goes to its own numbered file: a partition rescored after its
        # worker died rewrites the same file, so every sample is written exactly once.
        write = frame.to_parquet(
            predictions,
            write_index=False,
            compute=False,
            name_function=_part_name,
            storage_options=prepared.storage_options or None,
        )
    else:
        _create_zarr(predictions, job, plan, prepared.storage_options)
        write = frame.map_partitions(
            write_zarr_partition,
            predictions,
            prepared.storage_options,
            meta=pd.Series(dtype=np.int64),
        ).sum()
    if job.label_map is None:
        return [write]
    # One output partition: a few dozen counts need no shuffle, and a P2P shuffle cannot
    # move its outputs off a lost worker onto one outside the job's share.
    return [write, frame.groupby(["label", "prediction"]).size(split_out=1)]


def _write_confusion(fs: Any, root: str, counts: Any, *, classes: list[str]) -> dict[str, Any]:
    """The confusion matrix of ``counts`` (by (label, prediction)), its metrics and its plot
    written beside the predictions; the metrics returned."""
    matrix = np.zeros((len(classes),) * 2, dtype=np.int64)
    for (truth, guess), n in counts.items():
        matrix[int(truth), int(guess)] += int(n)
    metrics = confusion_metrics(matrix, classes)
    _write_json(fs, f"{root}/metrics.json", metrics)
    with fs.open(f"{root}/confusion_matrix.png", "wb") as f:
        plot_confusion_matrix(matrix, classes).savefig(f, format="png", dpi=100)
    return metrics


def _summary(prepared: PreparedPrediction, result: PredictResult) -> dict[str, Any]:
    """``summary.json``: what was scored, with which model and settings, and how fast."""
    return {
        "model": prepared.trained.checkpoint,
        "model_name": prepared.spec.name,
        "input": prepared.plan.url,
        "input_kind": prepared.plan.kind,
        "predictions": result.predictions,
        "format": result.format,
        "count": result.count,
        "partitions": result.partitions,
        "workers": result.workers,
        "seconds": result.seconds,
        "images_per_s": result.images_per_s,
        "accuracy": result.metrics["accuracy"] if result.metrics else None,
        "classes": result.classes,
        "mean": prepared.trained.mean,
        "std": prepared.trained.std,
        "settings": prepared.settings.model_dump(),
        "notes": result.notes,
    }


def _track(prepared: PreparedPrediction, fs: Any, root: str) -> None:
    """The prediction as an MLflow run, when tracking names a store (local output only: MLflow
    logs artifacts from local files)."""
    if not prepared.tracking.mlflow_uri:
        return
    if "file" not in fs.protocol:
        logger.warning("prediction not tracked in MLflow: %s is not a local path", prepared.output)
        return
    folder = Path(root)
    track_prediction(
        prepared.tracking,
        {"name": prepared.name, "predict": prepared.settings.model_dump(mode="json")},
        json.loads((folder / "summary.json").read_text()),
        [folder / name for name in ("metrics.json", "confusion_matrix.png", "summary.json")],
        name=prepared.name,
        training_run_id=kept_mlflow_run_id(Path(prepared.trained.checkpoint).parent),
    )


class ScoringWorkersLost(RuntimeError):
    """Every worker the prediction held left the cluster: its tasks can run nowhere else."""


def _wait_scored(
    client: Client, futures: list[Any], held: list[str], *, timeout_s: float, samples: int
) -> None:
    """Wait for the scoring tasks, at most ``timeout_s``; they are bound to the ``held``
    workers, so one that none of them is left to run is said at once (`wait_on_workers`)."""
    try:
        wait_on_workers(client, futures, held, timeout_s=timeout_s)
    except TimeoutError:
        raise TimeoutError(
            f"predict.timeout_s: scoring {samples} samples took longer than {timeout_s:g} s"
        ) from None
    except WorkersGone:
        done = sum(future.done() for future in futures)
        raise ScoringWorkersLost(
            f"every worker scoring the prediction left the cluster ({', '.join(held)}); "
            f"{done} of {len(futures)} partitions were scored; predict again into a new output"
        ) from None


def _parquet_rows(fs: Any, path: str) -> int:
    """Rows in the Parquet file set, from the files' footers (no data read)."""
    import pyarrow.parquet as pq

    total = 0
    for file in fs.glob(f"{fs._strip_protocol(path)}/part.*.parquet"):
        with fs.open(file, "rb") as f:
            total += pq.ParquetFile(f).metadata.num_rows
    return total


def _part_name(index: int) -> str:
    return f"part.{index:06d}.parquet"


def _create_zarr(url: str, job: ScoreJob, plan: InputPlan, options: dict[str, Any]) -> None:
    """Empty arrays, one chunk per partition, which the partitions' tasks fill."""
    size = max(len(p) for p in plan.partitions)
    sample = zarr_columns(empty_frame(job))
    zarr.open_group(url, mode="w-", storage_options=options or None)
    for name, column in sample.items():
        shape = (plan.count, *column.shape[1:])
        dtype = str if name == "sample_id" else column.dtype
        zarr.create_array(
            url,
            name=name,
            shape=shape,
            dtype=dtype,
            chunks=(size, *column.shape[1:]),
            storage_options=options or None,
        )
    group = zarr.open_group(url, mode="r+", storage_options=options or None)
    group.attrs.update({"classes": list(job.classes), "input": plan.url})


def _write_json(fs: Any, path: str, content: dict[str, Any]) -> None:
    with fs.open(path, "w") as f:
        f.write(json.dumps(content, indent=2) + "\n")


__all__ = [
    "CheckpointError",
    "PredictConfig",
    "PredictResult",
    "PreparedPrediction",
    "ScoringWorkersLost",
    "TrainedModel",
    "confusion_metrics",
    "load_predict_config",
    "predict",
    "prepare",
    "resolve_model",
    "run_prepared",
]
