"""Bugs planted in the workers' own strategy code, on the shared cluster: the equivalence check
fails on each, and the buggy run is the reference with the same bug planted in it.

Every equivalence test holds its result against references with bugs planted in them
(tests/reference.py: PLANTED_BUGS), which costs a one-process run, not a distributed one. This
module shows, for the bug that matters most to data parallelism, that a reference planted so is
what a strategy with that bug computes: DDP and FSDP summing their ranks' gradients instead of
averaging them, planted in the worker processes (``Client.run``) and taken out after.
"""

import pytest
import torch

from tests.reference import (
    GRADIENTS_SUMMED,
    SGD_FEW_STEPS,
    Reference,
    assert_matches_one_process,
    equivalence_problems,
    train_in_one_process,
)
from workflows.runs.driver import train

STEPS = 5
BASE = SGD_FEW_STEPS | {"batch_size": 32, "epochs": 1, "seed": 3, "max_steps": STEPS}


def _plant_summing_ddp() -> None:
    """DDP's ranks all-reduce their gradients without dividing by the world size."""
    import torch.distributed as dist

    from workers.strategies.ddp import replicas

    class SummingDDP(replicas.DistributedDataParallel):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)

            def summing(state, bucket):
                future = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
                return future.then(lambda done: done.value()[0])

            self.register_comm_hook(None, summing)

    replicas.unplanted = replicas.DistributedDataParallel
    replicas.DistributedDataParallel = SummingDDP


def _plant_summing_fsdp() -> None:
    """FSDP's ranks end each step with the sum of their gradients: what the reduce-scatter
    averaged, times the world size (exact, a power of 2; gloo has no premultiplied sum for
    FSDP's own divide factor of 1)."""
    from workers.strategies.fsdp import sharding

    averaging = sharding.FSDP.forward_backward

    def summing(self, *args, **kwargs):
        loss = averaging(self, *args, **kwargs)
        for parameter in self.wrapped.parameters():
            if parameter.grad is not None:
                parameter.grad.mul_(self.layout.dp)
        return loss

    sharding.FSDP.forward_backward = summing


def _take_out() -> None:
    from workers.strategies.ddp import replicas
    from workers.strategies.fsdp import sharding

    if hasattr(replicas, "unplanted"):
        replicas.DistributedDataParallel = replicas.__dict__.pop("unplanted")
    if "forward_backward" in vars(sharding.FSDP):
        del sharding.FSDP.forward_backward  # the inherited one again


PLANTS = {"ddp": _plant_summing_ddp, "fsdp": _plant_summing_fsdp}


@pytest.fixture(params=list(PLANTS))
def planted(request, cluster):
    """The strategy named by the parameter, with its gradients summed on every worker."""
    try:
        cluster.client.run(PLANTS[request.param])
        yield request.param
    finally:
        cluster.client.run(_take_out)


@pytest.mark.equivalence
def test_gradients_summed_in_the_workers_fail_the_check_as_the_planted_reference_does(
    cluster, make_config, planted
):
    config = make_config({"name": f"planted-{planted}"}, strategy=planted, **BASE)
    result = train(config, cluster=cluster, on_event=None)
    assert result.world_size == 2
    with pytest.raises(AssertionError, match=r"^not the one-process parameters"):
        assert_matches_one_process(result.state_dict, config, world_size=2, steps=STEPS, bugs=())
    # And the buggy run is what the reference computes with the same bug planted: planting in
    # the reference, as every equivalence test does, stands for planting in the strategy.
    reference = Reference.of(
        lambda dtype: train_in_one_process(
            config, world_size=2, steps=STEPS, dtype=dtype, bug=GRADIENTS_SUMMED
        ),
        steps=STEPS,
    )
    assert not equivalence_problems(result.state_dict, reference)
    # Taken out again, the same run passes.
    cluster.client.run(_take_out)
    again = train(config, cluster=cluster, on_event=None)
    assert_matches_one_process(again.state_dict, config, world_size=2, steps=STEPS, bugs=())
    assert not torch.equal(again.state_dict["fc2.weight"], result.state_dict["fc2.weight"])
