"""Batch inference inside the workers: the plugin that holds the model, and the partition task.

The client registers :class:`ModelPlugin` under the stable name ``dask-train-model`` once per
job. Each worker loads the model in the plugin's ``setup``, once; a worker that joins later (or
a restarted one) receives the plugin from the scheduler and loads it then. Every ``predict-…``
task takes the model from its worker's plugin: the parameters travel once per worker, never
with a task, and are never reloaded per batch.
"""

import asyncio
import contextlib
import io
import os
import pickle
from collections import OrderedDict
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import pandas as pd
import torch
import zarr
from distributed import Worker, WorkerPlugin, get_worker
from torch import nn

from workers.compat.distributed_private import executing_task_keys
from workers.data import checked_array
from workers.models import ModelConfig, build_model
from workers.preprocessing import normalize_images
from workers.sources import Decoding, Partition, get_source

PLUGIN_PREFIX = "dask-train-model"
Precision = Literal["fp32", "bf16", "fp16"]
Outputs = Literal["class", "probabilities", "top_k"]


class CheckpointError(ValueError):
    """The checkpoint does not fit the model it should hold; the message names the file."""


@dataclass(frozen=True)
class ModelSpec:
    """What a worker needs to rebuild the trained model; travels once per worker."""

    name: str  # model.name: built in, torchvision:, timm: or an import path
    num_classes: int
    image_size: int
    checkpoint: bytes = field(repr=False)  # a torch.save'd state_dict
    kwargs: dict[str, Any] = field(default_factory=dict)  # model.kwargs of the run
    source: str = "checkpoint"  # where it came from, for messages
    precision: Precision = "fp32"
    threads: int | None = None  # torch intra-op threads while scoring; None: torch's default
    token: str = ""  # one registration of the plugin, checked by every task

    def build(self, device: torch.device) -> nn.Module:
        model = build_model(
            ModelConfig(name=self.name, kwargs=self.kwargs),
            num_classes=self.num_classes,
            seed=0,
            image_size=self.image_size,
        )
        try:
            state = torch.load(io.BytesIO(self.checkpoint), map_location="cpu", weights_only=True)
        except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as error:
            raise CheckpointError(
                f"--model: {self.source} is not a torch checkpoint readable with "
                f"weights_only=True ({type(error).__name__})"
            ) from error
        load_checked(model, state, self)
        return model.eval().to(device)


def load_checked(model: nn.Module, state: Any, spec: ModelSpec) -> None:
    """Load ``state`` into ``model``, or raise a CheckpointError naming the file and the tensor."""
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(f"--model: {spec.source} does not hold a state_dict of tensors")
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        found = []
        if missing:
            found.append(f"lacks {', '.join(missing[:4])}")
        if unexpected:
            found.append(f"has unknown {', '.join(unexpected[:4])}")
        raise CheckpointError(
            f"--model: {spec.source} is not a {spec.name} checkpoint: it {' and '.join(found)} "
            "(model.name)"
        )
    for key, tensor in expected.items():
        got = tuple(state[key].shape)
        if got == tuple(tensor.shape):
            continue
        hint = ""
        if (
            tensor.ndim
            and got
            and tensor.shape[0] == spec.num_classes
            and got[0] != tensor.shape[0]
        ):
            hint = (
                f"; the checkpoint scores {got[0]} classes, the model's dataset has "
                f"{spec.num_classes}"
            )
        raise CheckpointError(
            f"--model: {spec.source}: {key} has shape {got}, but {spec.name} for "
            f"{spec.num_classes} classes and {spec.image_size}x{spec.image_size} images needs "
            f"{tuple(tensor.shape)}{hint}"
        )
    model.load_state_dict(state)


def input_shape(model: nn.Module, image_size: int) -> tuple[int, int, int]:
    """(channels, height, width) the model takes: channels from its first convolution."""
    first = next((m for m in model.modules() if isinstance(m, nn.Conv2d)), None)
    return (first.in_channels if first else 3, image_size, image_size)


def local_device() -> torch.device:
    # dask-cuda rotates CUDA_VISIBLE_DEVICES so that each worker's own GPU is its cuda:0.
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


# Per job token, in this worker process: model loads and partitions scored. Kept after the
# plugin is torn down, so the client can still read them (worker_report); bounded.
_HISTORY: OrderedDict[str, dict[str, int]] = OrderedDict()


def _count(token: str, what: str) -> None:
    record = _HISTORY.setdefault(token, {"loads": 0, "scored": 0})
    record[what] += 1
    while len(_HISTORY) > 64:
        _HISTORY.popitem(last=False)


def model_plugin_name(token: str) -> str:
    """The name one prediction job's model plugin is registered under."""
    return f"{PLUGIN_PREFIX}-{token}"


class ModelPlugin(WorkerPlugin):
    """Holds one prediction job's model on each of its workers: loaded in ``setup``, freed in
    ``teardown``. Its name is the job's, so jobs sharing a cluster never replace each other's
    models; ``workers``, the job's share of the cluster, are the only ones that load it."""

    def __init__(self, spec: ModelSpec, workers: Collection[str] = ()) -> None:
        # On the client, before anything is sent: a checkpoint that does not fit fails here,
        # naming the file, instead of on every worker.
        spec.build(torch.device("cpu"))
        if spec.threads is not None and spec.threads < 1:
            raise ValueError(f"predict.threads_per_worker: must be at least 1, got {spec.threads}")
        self.spec = spec
        self.name = model_plugin_name(spec.token)
        self.workers = frozenset(workers)
        self.model: nn.Module | None = None
        self.device: torch.device | None = None

    async def setup(self, worker: Worker) -> None:
        if self.workers and worker.address not in self.workers:
            return  # another job holds this worker (and its GPU)
        # Unpickling a large checkpoint takes a while; in a thread, the worker's event loop
        # keeps answering heartbeats meanwhile.
        await asyncio.to_thread(self._load)

    def _load(self) -> None:
        device = local_device()
        self.model = self.spec.build(device)
        self.device = device
        _count(self.spec.token, "loads")

    async def teardown(self, worker: Worker) -> None:
        device, self.model = self.device, None
        if device is not None and device.type == "cuda":
            torch.cuda.empty_cache()


@dataclass(frozen=True)
class ScoreJob:
    """What every ``predict-…`` task of one job shares (small: no parameters in here)."""

    token: str
    batch_size: int
    outputs: Outputs
    top_k: int
    classes: tuple[str, ...]  # the model's
    image_size: int
    mean: tuple[float, ...]  # the model's normalization statistics
    std: tuple[float, ...]
    # A store normalized with other statistics is re-normalized with the model's.
    input_mean: tuple[float, ...] | None = None
    input_std: tuple[float, ...] | None = None
    # Input label → model class; None: no labels to report (written as -1).
    label_map: tuple[int, ...] | None = None
    storage_options: dict[str, Any] = field(default_factory=dict)


def score_partition(partition: Partition, job: ScoreJob) -> pd.DataFrame:
    """The Dask task: score one partition with the model this worker's plugin holds."""
    worker = get_worker()
    plugin = worker.plugins.get(model_plugin_name(job.token))
    if not isinstance(plugin, ModelPlugin) or plugin.model is None or plugin.device is None:
        raise RuntimeError(
            f"worker {worker.address} holds no model for prediction job {job.token}: the job "
            "was not given this worker, or its plugin was removed while it ran"
        )
    with _threads(plugin.spec.threads):
        frame = score(
            plugin.model, partition, job, device=plugin.device, precision=plugin.spec.precision
        )
    _count(job.token, "scored")
    return frame


def score(
    model: nn.Module,
    partition: Partition,
    job: ScoreJob,
    *,
    device: torch.device,
    precision: Precision,
) -> pd.DataFrame:
    """Read, normalize and score one partition with ``model``; no Dask needed (the one-process
    baseline of the benchmark calls this directly)."""
    images, labels = read_partition(partition, job)
    probabilities = _probabilities(model, images, job.batch_size, device, precision)
    return prediction_frame(partition, job, probabilities, labels)


def read_partition(partition: Partition, job: ScoreJob) -> tuple[np.ndarray, np.ndarray]:
    """The partition's images normalized as the model was trained, and its labels as model
    classes (-1 where unknown)."""
    options = job.storage_options or None
    if partition.kind == "store":
        assert partition.rows is not None
        group = zarr.open_group(partition.url, mode="r", storage_options=options)
        lo, hi = partition.rows
        store = f"--input: {partition.url}"
        images = checked_array(group, f"{partition.split}/images", store=store)[lo:hi]
        labels = checked_array(group, f"{partition.split}/labels", store=store)[lo:hi]
        images, labels = np.asarray(images, np.float32), np.asarray(labels, np.int64)
        if job.input_mean is not None and job.input_std is not None:
            images = _renormalize(images, job)
    else:
        how = Decoding(job.image_size, storage_options=job.storage_options)
        raw, labels = get_source(partition.kind).prediction_images(partition, how)
        images = normalize_images(raw, job.mean, job.std)
    if job.label_map is None:
        return images, np.full(len(images), -1, dtype=np.int64)
    mapping = np.asarray(job.label_map, dtype=np.int64)
    return images, np.where(labels >= 0, mapping[np.clip(labels, 0, None)], -1)


def _renormalize(images: np.ndarray, job: ScoreJob) -> np.ndarray:
    # The store holds (x - m_store) / s_store; the model wants (x - m_model) / s_model.
    to_model = np.float32(1.0) / np.asarray(job.std, dtype=np.float32)[:, None, None]
    s_in = np.asarray(job.input_std, dtype=np.float32)[:, None, None]
    m_in = np.asarray(job.input_mean, dtype=np.float32)[:, None, None]
    m_model = np.asarray(job.mean, dtype=np.float32)[:, None, None]
    return ((images * s_in + m_in) - m_model) * to_model


def _probabilities(
    model: nn.Module,
    images: np.ndarray,
    batch_size: int,
    device: torch.device,
    precision: Precision,
) -> np.ndarray:
    n = len(images)
    out = np.empty((n, 0), dtype=np.float32)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    autocast = (
        torch.autocast(device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext()
    )
    with torch.inference_mode(), autocast:
        for begin in range(0, n, batch_size):
            x = torch.from_numpy(images[begin : begin + batch_size]).to(device, non_blocking=True)
            # Softmax in fp32 whatever the precision: half-precision logits lose small
            # probabilities.
            probabilities = torch.softmax(model(x).float(), dim=1).cpu().numpy()
            if not out.shape[1]:
                out = np.empty((n, probabilities.shape[1]), dtype=np.float32)
            out[begin : begin + len(probabilities)] = probabilities
    return out


def prediction_frame(
    partition: Partition, job: ScoreJob, probabilities: np.ndarray, labels: np.ndarray
) -> pd.DataFrame:
    """The partition's rows: position, sample id, label, prediction, and what ``outputs`` asks."""
    n = len(labels)
    probabilities = probabilities.reshape(n, len(job.classes))  # (0, 0) for an empty partition
    prediction = probabilities.argmax(axis=1).astype(np.int64)
    columns: dict[str, Any] = {
        "index": np.arange(partition.start, partition.start + n, dtype=np.int64),
        "sample_id": pd.array(sample_ids(partition)[:n], dtype="str"),
        "label": labels.astype(np.int64),
        "prediction": prediction,
        "confidence": probabilities[np.arange(n), prediction].astype(np.float32),
    }
    if job.outputs == "probabilities":
        for c in range(len(job.classes)):
            columns[f"prob_{c}"] = probabilities[:, c]
    elif job.outputs == "top_k":
        # Stable order of -p: ties go to the lower class, as argmax does.
        order = np.argsort(-probabilities, axis=1, kind="stable")[:, : job.top_k]
        for j in range(job.top_k):
            columns[f"top{j + 1}"] = order[:, j].astype(np.int64)
            columns[f"top{j + 1}_prob"] = probabilities[np.arange(n), order[:, j]]
    return pd.DataFrame(columns)


def sample_ids(partition: Partition) -> list[str]:
    """Stable ids: ``<split>/<row>`` of rows (a store's split, CIFAR-10's ``test_batch``), the
    file's path below the input folder for files read one by one."""
    if partition.rows is None:
        return list(partition.ids)
    return [f"{partition.split}/{row}" for row in range(*partition.rows)]


def empty_frame(job: ScoreJob) -> pd.DataFrame:
    """The columns and dtypes every partition's frame has (dask.dataframe's ``meta``)."""
    empty = Partition(index=0, start=0, stop=0, kind="imagefolder", url="")
    return prediction_frame(
        empty,
        job,
        np.zeros((0, len(job.classes)), np.float32),
        np.zeros(0, np.int64),
    )


def write_zarr_partition(
    frame: pd.DataFrame, url: str, storage_options: dict[str, Any] | None = None
) -> pd.Series:
    """Write one partition's rows into their own region of the zarr group's arrays.

    Partitions are one chunk each and rows sit at their input position, so a rescored partition
    (after a worker died) overwrites exactly its own region: every sample is stored once."""
    if not len(frame):
        return pd.Series([0], dtype=np.int64)
    group = zarr.open_group(url, mode="r+", storage_options=storage_options or None)
    start = int(frame["index"].iloc[0])
    stop = start + len(frame)
    for name, array in zarr_columns(frame).items():
        group[name][start:stop] = array
    return pd.Series([len(frame)], dtype=np.int64)


def zarr_columns(frame: pd.DataFrame) -> dict[str, np.ndarray]:
    """Prediction frame → the zarr group's arrays (per-class and top-k columns stacked)."""
    columns = {
        "index": frame["index"].to_numpy(np.int64),
        "sample_id": frame["sample_id"].to_numpy(dtype=str),
        "label": frame["label"].to_numpy(np.int64),
        "prediction": frame["prediction"].to_numpy(np.int64),
        "confidence": frame["confidence"].to_numpy(np.float32),
    }
    probs = [c for c in frame.columns if c.startswith("prob_")]
    if probs:
        columns["probabilities"] = frame[probs].to_numpy(np.float32)
    tops = [c for c in frame.columns if c.startswith("top") and not c.endswith("_prob")]
    if tops:
        columns["top_classes"] = frame[tops].to_numpy(np.int64)
        columns["top_probabilities"] = frame[[f"{c}_prob" for c in tops]].to_numpy(np.float32)
    return columns


@contextlib.contextmanager
def _threads(threads: int | None) -> Iterator[None]:
    # Set in the task's own thread: torch's OpenMP pool size is per calling thread.
    if threads is None or threads == torch.get_num_threads():
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def worker_report(dask_worker: Worker, token: str | None = None) -> dict[str, Any]:
    """This worker's pid, its model loads and partitions scored for job ``token`` (default:
    the job whose plugin it holds), and the predict tasks it is running now (run with
    ``Client.run``, which passes the worker in)."""
    models = [p for p in dask_worker.plugins.values() if isinstance(p, ModelPlugin)]
    if token is None:
        token = models[0].spec.token if models else None
    plugin = dask_worker.plugins.get(model_plugin_name(token or ""))
    counts = _HISTORY.get(token or "", {"loads": 0, "scored": 0})
    return {
        "pid": os.getpid(),
        "token": token,
        "loads": counts["loads"],
        "scored": counts["scored"],
        "holds_model": getattr(plugin, "model", None) is not None,
        "executing": sorted(
            str(key) for key in executing_task_keys(dask_worker) if "predict-" in str(key)
        ),
    }
