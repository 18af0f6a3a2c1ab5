"""Training figures reach the scheduler's Prometheus endpoint while the job runs."""

import urllib.request

from workflows.driver import train


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


def test_metrics_endpoint_shows_the_running_job(cluster, make_config):
    # Other tests' jobs stay on this scheduler's /metrics: this name is no prefix of theirs.
    config = make_config({"name": "metrics-running"}, epochs=3, batch_size=64)
    during = []

    def on_event(record):
        if record["kind"] == "epoch" and record["epoch"] == 1:
            during.append(_training_gauges(cluster.dashboard_link, 'job="metrics-running-'))

    result = train(config, cluster=cluster, on_event=on_event)
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
