"""Restarting the workers of a local cluster after training jobs: every worker comes back.

``Client.restart`` and the launcher's release of a failed job's ranks share the nanny's
restart path; a worker that does not come back turns recovery after a lost rank into a run that
waits for a worker that never arrives.
"""

import time
from pathlib import Path

import dask
import pytest
from distributed.core import Status

from workflows.cluster.training_cluster import live_workers, start_cluster
from workflows.runs.driver import train

PRELOAD = str(Path(__file__).with_name("slow_start_preload.py"))
# Dask's own bound (outside our cluster's settings), made short here: a local cluster closes
# for good the nanny of a worker gone this long. start_cluster replaces it with its own grace;
# the first restart below starts its workers this much later than the bound.
LOST_AFTER_S = 1.0
SLOW_START_S = LOST_AFTER_S + 2
STAGED = {"model_parallel": {"split_points": ["flatten"]}, "pipeline": {"n_microbatches": 4}}


def _pid() -> int:
    import os

    return os.getpid()


@pytest.mark.slow
def test_workers_come_back_after_a_restart_after_each_strategys_job(make_config, tmp_path):
    marker = tmp_path / "slow-start"
    slept = tmp_path / "slow-start.slept"  # the preload's record of each slow start
    settings = {
        "distributed.deploy.lost-worker-timeout": f"{LOST_AFTER_S}s",
        # A user's preload, kept by start_cluster; the nanny hands the variable to the worker
        # (one forked from a fork server started earlier would not see this process's environ).
        "distributed.worker.preload": [PRELOAD],
        "distributed.nanny.environ.DASK_TRAIN_TEST_SLOW_START": str(marker),
    }
    with dask.config.set(settings), start_cluster(n_workers=2, dashboard_port=0) as cluster:
        client = cluster.client
        for strategy in ("ddp", "model_parallel", "pipeline"):
            config = make_config(
                {"name": f"restart-{strategy}", "pipeline": STAGED.get(strategy, {})},
                strategy=strategy,
                max_steps=2,
                batch_size=32,
                epochs=1,
            )
            result = train(config, cluster=cluster, on_event=None)
            assert result.history[-1]["step"] == 2
            before = set(client.run(_pid).values())
            if strategy == "ddp":
                marker.write_text(str(SLOW_START_S))
            started = time.monotonic()
            client.restart(timeout=SLOW_START_S + 180)
            restart_s = time.monotonic() - started
            marker.unlink(missing_ok=True)
            assert len(live_workers(client)) == 2, strategy
            after = set(client.run(_pid).values())
            assert len(after) == 2 and not after & before, strategy  # new processes
            if strategy == "ddp":
                # Both new workers started slowly: the restart outlasted Dask's bound.
                assert slept.exists(), "the slow-start preload did not run"
                assert {int(pid) for pid in slept.read_text().split()} == after
                assert restart_s > SLOW_START_S
            # The cluster kept both nannies: a later restart or scale has them to work with.
            assert [n.status for n in cluster.cluster.workers.values()] == [Status.running] * 2
