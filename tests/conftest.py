import pytest
import torch

from workflows.cluster import start_cluster


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


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
