"""Training figures reach the scheduler's Prometheus endpoint while the job runs."""

import time
import urllib.request
import uuid

from workers.records import HeartbeatRecord, parse_record
from workflows.jobs.launch import launch
from workflows.observe.monitoring import EVENT_PREFIX, HEARTBEAT_PREFIX, keep_training_metrics
from workflows.runs.driver import train


def _training_gauges(dashboard_link: str, job_label: str) -> dict[str, float]:
    """The gauges of the jobs whose label contains ``job_label`` (e.g. 'job="name-')."""
    url = dashboard_link.replace("/status", "/metrics")
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    gauges = {}
    for line in text.splitlines():
        if line.startswith("dask_train_") and job_label in line:
            name, value = line.split("{")[0], float(line.rsplit(" ", 1)[1])
            gauges[name] = value
    return gauges


def elastic_records(job: str, at: float) -> list[dict]:
    """An elastic job's records as its controller and trainer send them: its first group of 2
    ranks, a worker joined (2 -> 4), one lost (4 -> 3, 5 steps redone)."""
    return [
        {"kind": "world", "job_id": job, "world_size": 2, "at": at},
        {"kind": "start", "strategy": "ddp", "world_size": 2, "epochs": 2, "total_steps": 90},
        {
            **{"kind": "resized", "job_id": job, "from": 2, "to": 4, "step": 30},
            **{"cause": "joined", "pause_s": 0.4, "redone_steps": 0, "at": at + 10},
        },
        {
            **{"kind": "resized", "job_id": job, "from": 4, "to": 3, "step": 60},
            **{"cause": "lost", "pause_s": 1.5, "redone_steps": 5, "at": at + 20},
        },
        # The new generation's trainer, after the controller's records: not what counts.
        {"kind": "start", "strategy": "ddp", "world_size": 4, "epochs": 2, "total_steps": 90},
    ]


def send_elastic_job(client, name: str) -> str:
    """Send an elastic job's records through ``client``'s scheduler, as the controller and the
    ranks do (its event topic), and wait for its gauges; the job's id."""
    keep_training_metrics(client)
    job = f"{name}-{uuid.uuid4().hex[:8]}"
    for record in elastic_records(job, time.time() - 30):
        client.log_event(EVENT_PREFIX + job, record)
    deadline = time.monotonic() + 10
    while "dask_train_job_resizes" not in _training_gauges(client.dashboard_link, job):
        assert time.monotonic() < deadline, f"{job}'s records never reached /metrics"
        time.sleep(0.1)
    return job


def test_an_elastic_jobs_world_size_follows_its_resizes(cluster):
    job = send_elastic_job(cluster.client, "metrics-elastic")
    gauges = _training_gauges(cluster.dashboard_link, f'job="{job}"')
    assert gauges["dask_train_job_world_size"] == 3  # the last resize's "to"
    assert gauges["dask_train_world_size"] == 3  # the older gauge says the same
    assert gauges["dask_train_job_resizes"] == 2
    url = cluster.dashboard_link.replace("/status", "/metrics")
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    assert (
        "# HELP dask_train_job_world_size Ranks the job runs on now; changes as an elastic job "
        "resizes"
    ) in text


def test_a_jobs_world_size_from_its_first_group(cluster):
    # A launch(fn) job: the controller's "world" record alone, no trainer's "start".
    keep_training_metrics(cluster.client)
    job = f"metrics-world-{uuid.uuid4().hex[:8]}"
    record = {"kind": "world", "job_id": job, "world_size": 2, "at": time.time()}
    cluster.client.log_event(EVENT_PREFIX + job, record)
    deadline = time.monotonic() + 10
    while not (gauges := _training_gauges(cluster.dashboard_link, f'job="{job}"')):
        assert time.monotonic() < deadline, f"{job}'s record never reached /metrics"
        time.sleep(0.1)
    assert gauges["dask_train_job_world_size"] == 2
    assert gauges["dask_train_job_resizes"] == 0


def test_metrics_endpoint_shows_the_running_job(cluster, make_config):
    # Other tests' jobs stay on this scheduler's /metrics: this name is no prefix of theirs.
    config = make_config({"name": "metrics-running"}, epochs=3, batch_size=64, log_every_steps=5)
    during, records = [], []

    def on_event(record):
        records.append(record)
        if record["kind"] == "epoch" and record["epoch"] == 1:
            during.append(_training_gauges(cluster.dashboard_link, 'job="metrics-running-'))

    result = train(config, cluster=cluster, on_event=on_event)
    # What the real emitters sent, the trainer's on its rank and the controller's on the
    # client, on_event's and the scheduler's heartbeats alike, parses into its model.
    heartbeats = [beat for _, beat in cluster.client.get_events(HEARTBEAT_PREFIX + result.job_id)]
    typed = [parse_record(record) for record in records + heartbeats]
    kinds = {record.kind for record in typed}
    assert {"world", "start", "step", "epoch", "heartbeat"} <= kinds, kinds
    assert all(r.worker for r in typed if isinstance(r, HeartbeatRecord))  # Dask adds it
    (first,) = during
    assert first["dask_train_world_size"] == 2
    assert first["dask_train_epoch"] >= 1
    assert 0 < first["dask_train_loss"] < 10
    assert 0 <= first["dask_train_accuracy"] <= 1
    assert first["dask_train_samples_per_second"] > 0

    url = cluster.dashboard_link.replace("/status", "/metrics")
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    # Every rank's own throughput, from its heartbeats; heartbeats are no job of their own.
    # The scheduler keeps earlier jobs' last figures too: this job is the one with its own id.
    assert result.job_id.startswith("metrics-running-")
    params_bytes = sum(t.numel() * t.element_size() for t in result.state_dict.values())
    # And each rank's peak memory since it started, from the same heartbeats.
    for metric in ("dask_train_rank_samples_per_second", "dask_train_rank_peak_memory_bytes"):
        for rank in (0, 1):
            (line,) = [
                line
                for line in text.splitlines()
                if line.startswith(f"{metric}{{")
                and f'job="{result.job_id}"' in line
                and f'rank="{rank}"' in line
            ]
            value = float(line.rsplit(" ", 1)[1])
            assert value > 0, line
            if metric == "dask_train_rank_peak_memory_bytes":
                # The peak at the rank's last heartbeat: at least a DDP rank's parameters, their
                # gradients and momentum (3 P); at most the peak the rank reported at its end
                # (rounded to 0.1 MiB).
                reported = (result.peak_memory_mib[rank] + 0.05) * 2**20
                assert 3 * params_bytes <= value <= reported, line
    assert "heartbeat-" not in text and "-heartbeat" not in text

    after = _training_gauges(cluster.dashboard_link, f'job="{result.job_id}"')
    assert after["dask_train_epoch"] == 3
    assert after["dask_train_step"] == result.final["step"]
    assert abs(after["dask_train_val_accuracy"] - result.final["val_accuracy"]) < 1e-9


def test_a_second_cluster_in_the_same_process_exports_its_jobs_too(
    cluster, own_cluster, make_config
):
    # prometheus_client's registry is process-wide: the second scheduler's plugin must join
    # the exporter rather than fail to register (it once raised DuplicateTimeseries).
    train(make_config({"name": "metrics-first"}, epochs=1), cluster=cluster, on_event=None)
    train(make_config({"name": "metrics-second"}, epochs=1), cluster=own_cluster, on_event=None)
    url = own_cluster.dashboard_link.replace("/status", "/metrics")
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    assert 'dask_train_epoch{job="metrics-first-' in text
    assert 'dask_train_epoch{job="metrics-second-' in text


def test_a_jobs_name_never_carries_its_records_into_another_kind_of_topic(cluster):
    # Job names that begin as the other kinds of topic do: each job's records stay its own.
    from workflows.jobs.spec import JobSpec
    from workflows.observe.monitoring import PLUGIN_NAME

    keep_training_metrics(cluster.client)
    specs = [JobSpec.mint(name) for name in ("sweep-topics", "heartbeat-topics")]
    for spec in specs:
        record = {"kind": "world", "job_id": spec.job_id, "world_size": 2, "at": time.time()}
        cluster.client.log_event(spec.event_topic, {"kind": "not-a-record", "number": 7})
        cluster.client.log_event(spec.event_topic, record)  # the refused one changed nothing
    deadline = time.monotonic() + 10
    for spec in specs:
        while not (gauges := _training_gauges(cluster.dashboard_link, f'job="{spec.job_id}"')):
            assert time.monotonic() < deadline, f"{spec.job_id}'s record never reached /metrics"
            time.sleep(0.1)
        assert gauges["dask_train_job_world_size"] == 2

    def studies(dask_scheduler) -> list[str]:
        return list(dask_scheduler.plugins[PLUGIN_NAME].sweeps)

    assert not [s for s in cluster.client.run_on_scheduler(studies) if s.endswith("topics")]


def reports_named_like_the_jobs_own_series(ctx) -> None:
    ctx.report(step=1, loss=0.5, world=ctx.world_size, ranks=2, history=3, memory=4)


def test_a_rank_metric_named_like_a_jobs_series_leaves_metrics_readable(cluster):
    result = launch(reports_named_like_the_jobs_own_series, cluster=cluster, world_size=2)
    # /metrics answers (a 500 for every job on the scheduler when "world" replaced the job's
    # world-size series), with the job's own figures.
    gauges = _training_gauges(cluster.dashboard_link, f'job="{result.job_id}"')
    assert gauges["dask_train_loss"] == 0.5 and gauges["dask_train_world_size"] == 2
