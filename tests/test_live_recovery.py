"""Live recovery's pieces in one process: what a rank keeps, which survivor the launcher picks,
and what the next attempt receives. (A real SIGKILL through the whole path:
``test_launch.py::test_a_sigkill_costs_no_redone_steps_and_the_same_parameters`` and
``test_fault_tolerance.py::test_sigkill_of_a_worker_mid_epoch_is_survived_with_the_same_parameters``.)
"""

import socket
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from workers import live_recovery
from workers.live_recovery import LiveSource, choose_source


def _held(step: int, *, clean: bool = True) -> dict:
    return {"step": step, "clean": clean, "done_at": 100.0 + step}


def test_the_newest_clean_replica_is_the_source_if_no_checkpoint_is_newer():
    assert choose_source([_held(7), None, _held(9), _held(9)], checkpoint_step=5) == LiveSource(
        rank=2, step=9, done_at=109.0
    )
    # A rank whose optimizer stepped after its last step_done holds no known step.
    assert choose_source([_held(7), _held(9, clean=False)], checkpoint_step=None).rank == 0
    assert choose_source([_held(4), None], checkpoint_step=5) is None
    assert choose_source([_held(5), None], checkpoint_step=5).step == 5  # memory over disk
    assert choose_source([None, None], checkpoint_step=None) is None


@pytest.fixture
def one_rank_group():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    store = dist.TCPStore("127.0.0.1", port, world_size=1, is_master=True)
    dist.init_process_group(
        "gloo", store=store, rank=0, world_size=1, timeout=timedelta(seconds=30)
    )
    yield
    dist.destroy_process_group()
    live_recovery.forget()


def _state(seed: int) -> dict:
    torch.manual_seed(seed)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    return {"model": model, "optimizer": optimizer, "schedule": schedule, "next": 0}


def _step(state: dict, x: torch.Tensor) -> None:
    state["optimizer"].zero_grad()
    state["model"](x).square().mean().backward()
    state["optimizer"].step()
    state["schedule"].step()


def test_the_next_attempt_receives_the_state_as_of_the_last_step_done(one_rank_group):
    x = torch.randn(8, 3)
    kept = _state(0)
    live_recovery.keep("job", kept, step=0)
    for step in range(3):
        _step(kept, x)
        kept["next"] = step + 1
        live_recovery.step_done("job", step + 1)
    expected = {k: v.clone() for k, v in kept["model"].module.state_dict().items()}
    momentum = [
        kept["optimizer"].state[p]["momentum_buffer"].clone() for p in kept["model"].parameters()
    ]
    # The failed step's forward ran (BatchNorm's running statistics moved) and a value
    # changed; the optimizer never stepped.
    kept["model"](x + 1)
    kept["next"] = 99
    assert live_recovery.held("job") | {"done_at": 0} == {
        "step": 3,
        "clean": True,
        "done_at": 0,
    }

    fresh = _state(1)
    got = live_recovery.receive(
        "job",
        fresh,
        choose_source([live_recovery.held("job")], checkpoint_step=None),
        device=torch.device("cpu"),
        backend="gloo",
    )
    assert got.step == 3 and fresh["next"] == 3
    received = fresh["model"].module.state_dict()
    for name, value in expected.items():
        assert torch.equal(received[name], value), name
    for p, m in zip(fresh["model"].parameters(), momentum, strict=True):
        assert torch.equal(fresh["optimizer"].state[p]["momentum_buffer"], m)
    assert fresh["schedule"].last_epoch == 3 and fresh["optimizer"].param_groups[0]["lr"] == 0.05


def test_an_optimizer_step_after_the_last_step_done_makes_the_state_unusable(one_rank_group):
    x = torch.randn(8, 3)
    state = _state(0)
    live_recovery.keep("job", state, step=0)
    _step(state, x)
    live_recovery.step_done("job", 1)
    _step(state, x)  # a failure before step_done(2): parameters are a step ahead of step 1
    assert live_recovery.held("job")["clean"] is False
    live_recovery.step_done("job", 2)
    assert live_recovery.held("job")["clean"] is True


def test_only_ddp_modules_count_as_replicas_unless_the_rank_says_so(one_rank_group):
    # Shards and stages are not replicas: no other rank holds a lost rank's part, so nothing
    # is kept (and nothing is copied at each step).
    plain = nn.Linear(3, 1)
    live_recovery.keep("job", {"model": plain}, step=0)
    assert live_recovery.held("job") is None
    live_recovery.keep("job", {"model": plain}, step=0, replicated=True)
    assert live_recovery.held("job")["step"] == 0
    live_recovery.keep("other", {"model": DistributedDataParallel(plain)}, step=4)
    # One job at a time on a worker: keeping another job's state drops the earlier one's.
    assert live_recovery.held("job") is None and live_recovery.held("other")["step"] == 4
    live_recovery.forget("other")
    assert live_recovery.held("other") is None
