"""Batch inference on a real cluster equals scoring the same data in one process."""

import json
import os
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr
from PIL import Image
from sklearn import metrics as sk

from tests.datasets import write_image_folder, write_tiny_cifar10
from tests.reference import assert_equivalent
from tests.test_launch import ddp_loop, one_process_reference
from tests.test_shared_cluster import wait_for_holder
from workers.data import DataConfig, open_store
from workers.inference import CheckpointError, worker_report
from workers.models import build_model
from workers.sources import SourceError, list_records
from workflows import launch
from workflows.cluster.training_cluster import live_workers
from workflows.data.preprocess import prepare_store
from workflows.prediction.batch_predict import (
    PredictResult,
    ScoringWorkersLost,
    predict,
    prepare,
)
from workflows.runs.config import ConfigError
from workflows.runs.driver import train
from workflows.runs.run_directory import RunDirectory

# Probabilities scored under bf16 autocast, against the same model and autocast in this process
# (another thread count may round differently); bf16 against fp32 differs by ~1e-3 here.
BF16_ATOL = 1e-2


@pytest.fixture(scope="module")
def trained_run(cluster, make_config, tmp_path_factory) -> Path:
    """A real run directory: a few DDP steps on digits, written as `dask-train run` does."""
    config = make_config({"name": "digits-predict"}, epochs=1, max_steps=12, batch_size=64)
    directory = RunDirectory.create(config, tmp_path_factory.mktemp("runs") / "run")
    with directory:
        directory.finish(train(config, cluster=cluster, on_event=None))
    return directory.path


@pytest.fixture(scope="module")
def scored(cluster, trained_run, tmp_path_factory) -> PredictResult:
    """The validation split of the run's own store, scored in 8 partitions on 2 workers."""
    return predict(
        model=trained_run,
        input=_store_of(trained_run),
        output=tmp_path_factory.mktemp("predict") / "val",
        settings={"partition_size": 45, "batch_size": 16},
        cluster=cluster,
    )


def _store_of(run: Path) -> str:
    return json.loads((run / "config.json").read_text())["data"]["store"]


def _one_process_probabilities(run: Path, images: np.ndarray, *, bf16: bool = False) -> np.ndarray:
    """The reference: the run's model in this process, plain torch, one batch (with ``bf16``,
    under bf16 autocast, the softmax of the logits in fp32)."""
    config = json.loads((run / "config.json").read_text())
    summary = json.loads((run / "summary.json").read_text())
    model = build_model(
        config["model"]["name"],
        num_classes=len(summary["store"]["classes"]),
        seed=1,
        image_size=config["data"]["image_size"],
    )
    model.load_state_dict(torch.load(run / "model.pt", weights_only=True))
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16)
    with torch.no_grad(), autocast:
        logits = model.eval()(torch.from_numpy(images))
    return torch.softmax(logits.float(), dim=1).numpy()


def _decoded_as_in_training(run: Path, files: list[Path]) -> np.ndarray:
    """Image files as the run's model takes them, in plain PIL and numpy: RGB, resized
    bilinearly to the run's image size, normalized with its store's statistics."""
    store = json.loads((run / "summary.json").read_text())["store"]
    size = store["image_size"]
    pixels = []
    for path in files:
        with Image.open(path) as image:
            pixels.append(
                np.asarray(image.convert("RGB").resize((size, size), Image.Resampling.BILINEAR))
            )
    scaled = np.stack(pixels).transpose(0, 3, 1, 2).astype(np.float32) / np.float32(255)
    mean = np.asarray(store["mean"], np.float32)[:, None, None]
    std = np.asarray(store["std"], np.float32)[:, None, None]
    return (scaled - mean) / std


def test_every_sample_is_predicted_once_and_equals_one_process_scoring(scored, trained_run):
    frame = scored.read()
    val = open_store(_store_of(trained_run)).val
    n = len(val)
    assert scored.count == n and scored.partitions == 8 and scored.workers == 2
    assert frame["index"].tolist() == list(range(n))  # each sample exactly once, in order
    assert frame["sample_id"].tolist() == [f"val/{i}" for i in range(n)]
    assert frame["label"].tolist() == val.labels.tolist()

    want = _one_process_probabilities(trained_run, np.asarray(val.images[:]))
    got = frame[[f"prob_{c}" for c in range(10)]].to_numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert frame["prediction"].tolist() == want.argmax(1).tolist()
    np.testing.assert_allclose(frame["confidence"], want.max(1), rtol=1e-5)
    # The files: one per partition, numbered, and nothing else.
    files = sorted(p.name for p in Path(scored.predictions).iterdir())
    assert files == [f"part.{i:06d}.parquet" for i in range(8)]


def test_the_model_is_loaded_once_per_worker_not_per_task(scored, cluster):
    reports = cluster.client.run(worker_report, token=scored.token)
    assert len(reports) == 2
    assert [r["loads"] for r in reports.values()] == [1, 1]
    assert sum(r["scored"] for r in reports.values()) == scored.partitions == 8
    # After the job the workers no longer hold the model.
    assert not any(r["holds_model"] for r in reports.values())


def test_a_training_job_and_predict_share_the_cluster_on_their_own_workers(
    cluster, trained_run, tmp_path
):
    # A training loop holds one worker (and waits after its second step); predict gets the other.
    flag = tmp_path / "predicted"
    training: dict = {}

    def train_alongside() -> None:
        training["result"] = launch(
            ddp_loop, 4, 0.1, 0, 0, str(flag), cluster=cluster, world_size=1, name="alongside"
        )

    thread = threading.Thread(target=train_alongside, daemon=True)
    thread.start()
    try:
        wait_for_holder(cluster.client, "alongside")
        result = predict(
            model=trained_run,
            input=_store_of(trained_run),
            output=tmp_path / "val",
            settings={"partition_size": 45, "batch_size": 16},
            cluster=cluster,
        )
    finally:
        flag.touch()
        thread.join(timeout=120)
    assert result.workers == 1
    val = open_store(_store_of(trained_run)).val
    got = result.read()[[f"prob_{c}" for c in range(10)]].to_numpy()
    want = _one_process_probabilities(trained_run, np.asarray(val.images[:]))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    (parameters,) = training["result"].results
    assert_equivalent(parameters, one_process_reference(4, 0.1))


def test_evaluation_metrics_equal_a_sequential_computation(scored):
    frame = scored.read()
    truth, guess = frame["label"], frame["prediction"]
    labels = list(range(10))
    stored = json.loads((Path(scored.output) / "metrics.json").read_text())
    assert stored == scored.metrics
    assert stored["samples"] == len(frame)
    assert stored["accuracy"] == pytest.approx(sk.accuracy_score(truth, guess), abs=1e-12)
    assert stored["confusion_matrix"] == sk.confusion_matrix(truth, guess, labels=labels).tolist()
    precision = sk.precision_score(truth, guess, labels=labels, average=None, zero_division=0)
    recall = sk.recall_score(truth, guess, labels=labels, average=None, zero_division=0)
    np.testing.assert_allclose(list(stored["precision"].values()), precision, atol=1e-12)
    np.testing.assert_allclose(list(stored["recall"].values()), recall, atol=1e-12)
    png = (Path(scored.output) / "confusion_matrix.png").read_bytes()
    assert png.startswith(b"\x89PNG")
    summary = json.loads((Path(scored.output) / "summary.json").read_text())
    assert summary["count"] == len(frame) and summary["accuracy"] == stored["accuracy"]


def _predict_in_a_thread(
    cluster, run: Path, tmp_path: Path, *, partitions_of: int
) -> tuple[threading.Thread, dict]:
    """predict() of ``run``'s training split, started in a thread: small batches and
    partitions, many tasks, each long enough to be caught. Its result, or its error, lands in
    the dict."""
    outcome: dict = {}

    def scored() -> None:
        try:
            outcome["result"] = predict(
                model=run,
                input=_store_of(run),
                output=tmp_path / "train",
                settings={"split": "train", "partition_size": partitions_of, "batch_size": 4},
                cluster=cluster,
            )
        except BaseException as error:  # handed to the test's thread
            outcome["error"] = error

    thread = threading.Thread(target=scored, daemon=True)
    thread.start()
    return thread, outcome


@pytest.mark.slow
def test_a_worker_killed_mid_run_leaves_every_sample_exactly_once(
    own_cluster, trained_run, tmp_path
):
    client = own_cluster.client
    target = sorted(live_workers(client))[0]
    pid = client.run(os.getpid, workers=[target])[target]
    scheduler_port = int(client.scheduler.address.rsplit(":", 1)[1])
    thread, outcome = _predict_in_a_thread(own_cluster, trained_run, tmp_path, partitions_of=32)
    # Kill the worker only with predict tasks in flight on it, after it scored some already.
    # A partition takes milliseconds, less than a round trip on a busy machine; so the worker
    # is first frozen (SIGSTOP), which holds the scheduler's view of it still, and killed only
    # when the scheduler shows predict tasks processing there; otherwise it is thawed again.
    deadline = time.monotonic() + 120
    while True:
        assert time.monotonic() < deadline, "the worker never held a predict task in flight"
        assert thread.is_alive(), outcome
        report = client.run(worker_report, workers=[target]).get(target, {})
        if report.get("executing") and report["scored"] >= 2:
            os.kill(pid, signal.SIGSTOP)
            try:
                # What it sent before the stop (a task finished) reaches the scheduler first.
                _wait_until_read_by_the_scheduler(pid, scheduler_port, timeout_s=60)
                in_flight = client.processing(workers=[target]).get(target, [])
            except BaseException:
                os.kill(pid, signal.SIGCONT)
                raise
            if any("predict-" in str(key) for key in in_flight):
                os.kill(pid, signal.SIGKILL)
                break
            os.kill(pid, signal.SIGCONT)
        time.sleep(0.005)
    thread.join(timeout=240)
    assert not thread.is_alive(), "predict did not finish within 240 s of the kill"
    assert "error" not in outcome, outcome.get("error")
    result = outcome["result"]

    frame = result.read()
    train_split = open_store(_store_of(trained_run)).train
    n = len(train_split)
    assert len(frame) == n and frame["index"].tolist() == list(range(n))
    assert frame["sample_id"].is_unique
    want = _one_process_probabilities(trained_run, np.asarray(train_split.images[:]))
    got = frame[[f"prob_{c}" for c in range(10)]].to_numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # The scheduler saw predict tasks in flight on the worker when it died, and ran them again.
    assert client.run_on_scheduler(_predict_tasks_lost_with_a_worker) >= 1
    live = client.run(worker_report, token=result.token)
    assert all(r["pid"] != pid for r in live.values())
    # Once per worker process, the restarted one included (if it joined before the end).
    assert all(r["loads"] <= 1 for r in live.values())
    assert sum(r["loads"] for r in live.values()) >= 1


@pytest.mark.slow
def test_a_prediction_whose_workers_all_die_says_so_at_once(own_cluster, trained_run, tmp_path):
    # Its tasks are bound to the workers it holds, and their nannies bring them back at other
    # addresses, which it does not hold: before, it waited out predict.timeout_s (an hour).
    client = own_cluster.client
    pids = client.run(os.getpid)
    thread, outcome = _predict_in_a_thread(own_cluster, trained_run, tmp_path, partitions_of=16)
    deadline = time.monotonic() + 120
    # Both workers are frozen (SIGSTOP) once a predict task is in flight: of ~90 partitions,
    # the rest can then finish nowhere, whatever the machine's speed.
    while not any("predict-" in str(key) for keys in client.processing().values() for key in keys):
        assert time.monotonic() < deadline, "no predict task ever ran"
        assert thread.is_alive(), outcome
        time.sleep(0.005)
    for pid in pids.values():
        os.kill(pid, signal.SIGSTOP)
    try:
        unfinished = client.run_on_scheduler(_unfinished_predict_tasks)
    finally:
        for pid in pids.values():
            os.kill(pid, signal.SIGKILL)
    assert unfinished > 0
    thread.join(timeout=60)
    assert not thread.is_alive(), "predict still waits a minute after its workers died"
    error = outcome.get("error")
    assert isinstance(error, ScoringWorkersLost), outcome
    assert "every worker scoring the prediction left the cluster" in str(error)
    assert all(address in str(error) for address in pids)


def _unfinished_predict_tasks(dask_scheduler) -> int:
    return sum(
        1
        for key, task in dask_scheduler.tasks.items()
        if "predict-" in str(key) and task.state not in ("memory", "erred", "forgotten")
    )


def _established_tcp(pid: int) -> dict[tuple[str, str], tuple[int, int, int]]:
    """The established TCP connections in ``pid``'s network namespace: (local, remote) address,
    as /proc writes them, → (bytes sent but not acknowledged, bytes received but not read,
    the socket's inode)."""
    table = {}
    for name in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{name}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "01":  # TCP_ESTABLISHED
                unacknowledged, unread = (int(v, 16) for v in fields[4].split(":"))
                table[fields[1], fields[2]] = (unacknowledged, unread, int(fields[9]))
    return table


def _wait_until_read_by_the_scheduler(pid: int, port: int, timeout_s: float) -> None:
    """Wait until everything process ``pid`` (stopped) wrote to the scheduler listening on
    ``port`` has been acknowledged and read there: nothing it sent is still on its way."""
    sockets = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except FileNotFoundError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            sockets.add(int(target.removeprefix("socket:[").removesuffix("]")))
    deadline = time.monotonic() + timeout_s
    while True:
        table = _established_tcp(pid)
        to_scheduler = [
            (local, remote, unacknowledged)
            for (local, remote), (unacknowledged, _, inode) in table.items()
            if inode in sockets and int(remote.rsplit(":", 1)[1], 16) == port
        ]
        assert to_scheduler, f"process {pid} has no connection to the scheduler's port {port}"
        # The scheduler's end of each connection is the same pair of addresses, swapped.
        pending = [
            (local, remote)
            for local, remote, unacknowledged in to_scheduler
            if unacknowledged or table.get((remote, local), (0, 1, 0))[1]
        ]
        if not pending:
            return
        assert time.monotonic() < deadline, f"still unread by the scheduler: {pending}"
        time.sleep(0.001)


def _predict_tasks_lost_with_a_worker(dask_scheduler) -> int:
    # Runs in the scheduler (in this process): tasks processing on a worker when it died count
    # as suspicious on their task prefix, which outlives the tasks.
    return sum(
        prefix.suspicious
        for name, prefix in dask_scheduler.task_prefixes.items()
        if name.startswith("predict-")
    )


def _bare_checkpoint(path: Path, *, num_classes: int, seed: int = 3) -> Path:
    model = build_model("cifar_cnn", num_classes=num_classes, seed=seed)
    torch.save(model.state_dict(), path)
    return path


def test_image_folder_and_cifar10_are_preprocessed_as_in_training(cluster, tmp_path):
    """Raw images scored through the training decoder and the store's statistics give the same
    predictions as the preprocessed store itself."""
    write_image_folder(tmp_path / "images", per_class=6)
    data = DataConfig(
        dataset="imagefolder",
        root=str(tmp_path / "images"),
        store=str(tmp_path / "images-store"),
        val_fraction=0.5,
        chunk_size=4,
    )
    prepare_store(cluster.client, data, seed=0)
    config = {"data": data.model_dump(), "cluster": {"dashboard_port": 0}}
    checkpoint = _bare_checkpoint(tmp_path / "three.pt", num_classes=3)
    common = {"model": checkpoint, "config": config, "cluster": cluster}
    from_images = predict(
        input=tmp_path / "images", output=tmp_path / "p1", settings={"partition_size": 5}, **common
    ).read()
    from_store = predict(input=data.store, output=tmp_path / "p2", **common).read()
    listing = list_records(data, seed=0)
    val_files = [url.rsplit("/images/", 1)[1] for url, _ in listing.val]
    assert len(from_images) == 18 and from_images["sample_id"].is_unique
    by_file = from_images.set_index("sample_id").loc[val_files]
    probabilities = ["prob_0", "prob_1", "prob_2"]
    np.testing.assert_allclose(
        by_file[probabilities].to_numpy(), from_store[probabilities].to_numpy(), atol=1e-5
    )
    assert by_file["label"].tolist() == from_store["label"].tolist()

    # CIFAR-10's test batch, top-k into zarr, against the store's val split (the same batch).
    write_tiny_cifar10(tmp_path / "cifar", per_batch=7)
    cifar = DataConfig(
        dataset="cifar10", root=str(tmp_path / "cifar"), store=str(tmp_path / "cifar-store")
    )
    prepare_store(cluster.client, cifar, seed=0)
    ten = _bare_checkpoint(tmp_path / "ten.pt", num_classes=10)
    settings = {"format": "zarr", "outputs": "top_k", "top_k": 2, "partition_size": 3}
    common = {"model": ten, "config": {"data": cifar.model_dump()}, "cluster": cluster}
    raw = predict(input=tmp_path / "cifar", output=tmp_path / "c1", settings=settings, **common)
    stored = predict(input=cifar.store, output=tmp_path / "c2", settings=settings, **common)
    assert raw.count == 7 and raw.partitions == 3 and raw.metrics is not None
    a, b = raw.read(), stored.read()
    assert a["sample_id"].tolist() == [f"test_batch/{i}" for i in range(7)]
    for column in ("label", "prediction", "top_classes_0", "top_classes_1"):
        assert a[column].tolist() == b[column].tolist()
    np.testing.assert_allclose(a["top_probabilities_0"], b["top_probabilities_0"], atol=1e-5)
    assert zarr.open_group(raw.predictions, mode="r")["top_classes"].shape == (7, 2)


# -- bad input: clear errors before anything runs ---------------------------------------------


def test_a_checkpoint_with_another_number_of_classes_is_refused_naming_the_file(
    trained_run, tmp_path
):
    bad = _bare_checkpoint(tmp_path / "model.pt", num_classes=3)
    with pytest.raises(CheckpointError, match=r"model\.pt: fc2\.weight has shape \(3, 64\)"):
        prepare(
            model=bad,
            input=_store_of(trained_run),
            output=tmp_path / "out",
            config=_config(trained_run),
        )
    with pytest.raises(CheckpointError, match="scores 3 classes, the model's dataset has 10"):
        prepare(
            model=bad,
            input=_store_of(trained_run),
            output=tmp_path / "out",
            config=_config(trained_run),
        )


def test_a_checkpoint_of_another_model_is_refused(trained_run, tmp_path):
    other = tmp_path / "linear.pt"
    torch.save(torch.nn.Linear(4, 2).state_dict(), other)
    with pytest.raises(CheckpointError, match=r"linear\.pt is not a cifar_cnn checkpoint"):
        prepare(
            model=other,
            input=_store_of(trained_run),
            output=tmp_path / "o",
            config=_config(trained_run),
        )


def _config(run: Path) -> dict:
    return json.loads((run / "config.json").read_text())


def test_input_of_another_shape_or_channel_count_is_refused(trained_run, tmp_path):
    store = _store_of(trained_run)
    for name, shape in (("gray", (4, 1, 32, 32)), ("small", (4, 3, 16, 16))):
        copy = tmp_path / name
        group = zarr.open_group(copy, mode="w")
        group.attrs.update(dict(zarr.open_group(store, mode="r").attrs))
        zarr.create_array(copy, name="val/images", data=np.zeros(shape, np.float32))
        zarr.create_array(copy, name="val/labels", data=np.zeros(4, np.int64))
    with pytest.raises(ConfigError, match=r"--input: .*gray holds images .* 1 channels"):
        prepare(model=trained_run, input=tmp_path / "gray", output=tmp_path / "o")
    with pytest.raises(ConfigError, match=r"--input: .*small holds 16x16 images.*data\.image_size"):
        prepare(model=trained_run, input=tmp_path / "small", output=tmp_path / "o")


def test_an_input_is_listed_as_its_kind_or_refused_naming_it(tmp_path):
    from workers.sources import InputRequest
    from workflows.prediction.prediction_input import plan_input

    request = InputRequest(image_size=32, channels=3, split="val", partition_size=4)
    write_tiny_cifar10(tmp_path / "cifar", per_batch=6)
    for found in (tmp_path / "cifar", tmp_path / "cifar" / "cifar-10-batches-py" / "test_batch"):
        plan = plan_input(found, request)
        assert (plan.kind, plan.count, len(plan.partitions)) == ("cifar10", 6, 2)
    write_image_folder(tmp_path / "tree", per_class=2)
    plan = plan_input(tmp_path / "tree", request)
    assert (plan.kind, plan.count, plan.classes) == ("imagefolder", 6, ["cat", "dog", "eel"])

    # What each kind cannot read reaches the caller as a ConfigError naming the path.
    broken = tmp_path / "broken" / "test_batch"
    broken.parent.mkdir()
    broken.write_bytes(b"not a pickle")
    with pytest.raises(ConfigError, match=r"--input: .*broken/test_batch: not a readable CIFAR"):
        plan_input(broken, request)
    (tmp_path / "tree" / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"--input: class folder .*tree/empty holds no images"):
        plan_input(tmp_path / "tree", request)
    (tmp_path / "nothing").mkdir()
    with pytest.raises(ConfigError, match=r"--input: .*nothing holds no images \(.png"):
        plan_input(tmp_path / "nothing", request)
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ConfigError, match=r"notes\.txt is neither a dataset store, a CIFAR-10"):
        plan_input(tmp_path / "notes.txt", request)
    with pytest.raises(ConfigError, match=r"--input: .*absent does not exist"):
        plan_input(tmp_path / "absent", request)


def test_an_existing_output_path_is_refused(trained_run, tmp_path):
    (tmp_path / "taken").mkdir()
    with pytest.raises(ConfigError, match=r"--output: .*taken exists"):
        prepare(model=trained_run, input=_store_of(trained_run), output=tmp_path / "taken")
    with pytest.raises(ConfigError, match=r"predict\.top_k: 11 is more than the model's 10"):
        prepare(
            model=trained_run,
            input=_store_of(trained_run),
            output=tmp_path / "new",
            settings={"outputs": "top_k", "top_k": 11},
        )
    assert not (tmp_path / "new").exists()


def test_unlabeled_images_are_scored_in_bf16_without_metrics(cluster, trained_run, tmp_path):
    write_image_folder(tmp_path / "flat-tree", per_class=2)
    flat = tmp_path / "flat"
    flat.mkdir()
    for i, path in enumerate(sorted((tmp_path / "flat-tree").rglob("*.*"))):
        path.rename(flat / f"{i:02d}{path.suffix}")
    result = predict(
        model=trained_run,
        input=flat,
        output=tmp_path / "out",
        settings={"precision": "bf16", "outputs": "class"},
        cluster=cluster,
    )
    frame = result.read()
    assert list(frame.columns) == ["index", "sample_id", "label", "prediction", "confidence"]
    assert result.metrics is None and "no labels" in result.notes[0]
    assert frame["label"].eq(-1).all() and len(frame) == 6
    assert frame["sample_id"].tolist() == sorted(p.name for p in flat.iterdir())
    assert not (tmp_path / "out" / "metrics.json").exists()
    # read() is the Parquet folder the job wrote into --output, one file per partition.
    assert result.format == "parquet" and Path(result.predictions).parent == tmp_path / "out"
    assert sorted(p.suffix for p in Path(result.predictions).iterdir()) == [".parquet"]

    # The same files through the run's model in this process, under the same autocast.
    images = _decoded_as_in_training(trained_run, [flat / name for name in frame["sample_id"]])
    want = _one_process_probabilities(trained_run, images, bf16=True)
    np.testing.assert_allclose(frame["confidence"], want.max(1), atol=BF16_ATOL)
    # And bf16 did apply: scoring in fp32 gives other confidences (by ~1e-3 here).
    fp32 = _one_process_probabilities(trained_run, images).max(1)
    assert not np.allclose(frame["confidence"], fp32, rtol=0, atol=1e-6), fp32
    # The class each row names is the reference's top class wherever bf16 cannot swap the top
    # two (and at least one row is that clear).
    top_two = np.sort(want, axis=1)[:, -2:]
    clear = top_two[:, 1] - top_two[:, 0] > 2 * BF16_ATOL
    assert clear.any(), want
    assert frame["prediction"][clear].tolist() == want.argmax(1)[clear].tolist()


def test_a_corrupt_image_fails_the_job_naming_the_file_and_frees_the_model(
    cluster, trained_run, tmp_path
):
    write_image_folder(tmp_path / "images", per_class=2)
    broken = tmp_path / "images" / "dog" / "001.png"
    broken.write_bytes(b"not a png")
    with pytest.raises(SourceError, match=r"dog/001\.png: not a readable image"):
        predict(
            model=trained_run,
            input=tmp_path / "images",
            output=tmp_path / "out",
            settings={"partition_size": 2},
            cluster=cluster,
        )
    reports = cluster.client.run(worker_report)
    assert not any(r["holds_model"] or r["token"] for r in reports.values())
