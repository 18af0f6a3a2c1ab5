import pytest
import torch

from workflows.cluster import start_cluster
from workflows.config import RunConfig, load_config


@pytest.fixture(scope="session")
def cluster():
    """A real 2-worker cluster shared by the tests that leave it as they found it."""
    with start_cluster(n_workers=2, dashboard_port=0) as training_cluster:
        yield training_cluster


@pytest.fixture
def own_cluster():
    """A fresh 2-worker cluster for tests that restart, add or kill workers."""
    with start_cluster(n_workers=2, dashboard_port=0) as training_cluster:
        yield training_cluster


@pytest.fixture(scope="session")
def store_dir(tmp_path_factory):
    """Where this session's dataset stores live (shared, so each is built once)."""
    return tmp_path_factory.mktemp("stores")


@pytest.fixture(scope="session")
def make_config(store_dir):
    """Build a validated RunConfig from a dict, with the dataset store in the session folder."""

    def make(raw: dict | None = None, **training) -> RunConfig:
        raw = {k: dict(v) if isinstance(v, dict) else v for k, v in (raw or {}).items()}
        data = raw.setdefault("data", {})
        data.setdefault("store", str(store_dir / data.get("dataset", "digits")))
        raw["training"] = raw.get("training", {}) | training
        return load_config(raw)

    return make


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
