"""The strategy registry and the layout every rank receives (no cluster needed)."""

import ast
import importlib
import pkgutil

import pytest

import workers.strategies
from tests.commands import run_python
from tests.conftest import REPO
from workers.spec.layout import Layout
from workers.spec.names import STRATEGIES
from workers.spec.plans import get_plan, registered_plans
from workers.spec.run import RunConfig
from workers.strategies import get_strategy, registered
from workers.strategies.pipeline.schedule import PipelineStrategy
from workflows.runs.config import load_config


def test_the_registry_and_the_torch_free_names_agree():
    # Every module of every family, so that whatever registers anything is counted.
    for family in pkgutil.iter_modules(workers.strategies.__path__):
        package = importlib.import_module(f"workers.strategies.{family.name}")
        for module in pkgutil.iter_modules(getattr(package, "__path__", [])):
            importlib.import_module(f"{package.__name__}.{module.name}")
    # Every name has a plan and a runtime, and nothing else registers either.
    assert sorted(registered_plans()) == sorted(registered()) == sorted(STRATEGIES)
    for name in STRATEGIES:
        plan, runtime = get_plan(name), get_strategy(name)
        assert plan.name == runtime.name == name
        assert runtime.__module__ == plan.runtime
        assert plan.staged == issubclass(runtime, PipelineStrategy)
    with pytest.raises(ValueError, match="unknown strategy 'zero3'"):
        get_plan("zero3")
    with pytest.raises(ValueError, match="unknown strategy 'zero3'"):
        get_strategy("zero3")


# Modules that only compose the plans: naming a strategy there is knowledge its plan should own.
_PLAN_USERS = (
    "workers/spec/layout.py",
    "workflows/runs/config.py",
    "workflows/runs/driver.py",
    "workflows/jobs/collections.py",
)


@pytest.mark.parametrize("path", _PLAN_USERS)
def test_only_a_strategy_s_plan_names_it(path):
    tree = ast.parse((REPO / path).read_text())
    # A string that is exactly a name: a comparison, a table key, an argument. Messages and
    # docstrings mention strategies inside longer text, which is fine; "pipeline" is also a
    # section's name, which these modules do use.
    names = set(STRATEGIES) - set(RunConfig.model_fields)
    named = {
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names
    }
    assert named == set(), f"{path} names {sorted(named)}: ask the strategy's plan instead"
    imported = {
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module == "workers.spec.plans"
        for alias in node.names
    }
    assert imported <= {"StrategyPlan", "StrategySections", "get_plan"}


def test_the_whole_spec_imports_without_torch():
    code = (
        "import importlib, pkgutil, sys, workers.spec\n"
        "for m in pkgutil.walk_packages(workers.spec.__path__, 'workers.spec.'):\n"
        "    importlib.import_module(m.name)\n"
        "from workers.spec.names import STRATEGIES\nfrom workers.spec.plans import get_plan\n"
        "[get_plan(name) for name in STRATEGIES]\n"
        "print(len(sys.modules['workers.spec.plans.base'].PLANS), 'torch' in sys.modules)"
    )
    done = run_python(code, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(len(STRATEGIES)), "False"]


def _layout(world_size: int, **raw) -> Layout:
    return load_config(raw).layout(world_size)


def test_ddp_ranks_are_all_replicas():
    layout = _layout(2, training={"batch_size": 32, "grad_accum_steps": 2})
    assert (layout.pp, layout.dp, layout.n_microbatches) == (1, 2, 2)
    assert (layout.per_rank_batch, layout.micro_batch, layout.reporting_rank) == (16, 8, 0)
    assert [layout.dp_rank(rank) for rank in range(2)] == [0, 1]


def test_a_pipeline_times_data_parallel_is_a_pp_by_dp_mesh():
    layout = _layout(
        4,
        training={"strategy": "pipeline", "batch_size": 32},
        pipeline={"dp": 2, "n_microbatches": 4},
    )
    assert (layout.pp, layout.dp, layout.n_stages) == (2, 2, 2)
    # Each replica's pipeline takes half the batch, in micro-batches of 4.
    assert (layout.per_rank_batch, layout.micro_batch) == (16, 4)
    # Ranks 2 and 3 hold the last stage; the first of them reports.
    assert layout.reporting_rank == 2
    assert [layout.dp_rank(rank) for rank in range(4)] == [0, 1, 0, 1]


def test_a_pipeline_takes_every_other_degree_on_one_mesh():
    # PP x HSDP x TP: 2 stages, each held by 2 copies of 2 shards, each shard split over 2.
    layout = _layout(
        16,
        data={"dataset": "text", "root": "python:json", "sequence_length": 8},
        model={"name": "gpt", "kwargs": {"dim": 16, "n_heads": 2}},
        training={"strategy": "pipeline", "batch_size": 32},
        parallel={"pp": 2, "dp_replicate": 2, "dp_shard": 2, "tp": 2},
        pipeline={"n_microbatches": 2},
    )
    degrees = (layout.pp, layout.dp_replicate, layout.dp_shard, layout.tp)
    assert degrees == (2, 2, 2, 2)
    # Rank (pp, copy, shard, tp) = ((pp * 2 + copy) * 2 + shard) * 2 + tp: the 4 replicas read
    # 8 rows each, the tp ranks of one the same rows; the first of the last stage reports.
    assert [layout.dp_rank(rank) for rank in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert (layout.per_rank_batch, layout.micro_batch, layout.reporting_rank) == (8, 4, 8)


def test_model_parallel_is_a_pipeline_of_one_micro_batch():
    layout = _layout(2, training={"strategy": "model_parallel", "batch_size": 32})
    assert (layout.pp, layout.dp, layout.n_microbatches, layout.micro_batch) == (2, 1, 1, 32)
    assert layout.reporting_rank == 1


def test_a_layout_checks_itself():
    with pytest.raises(ValueError, match=r"pp x dp x tp = 2 x 2 x 1 must equal the world size 2"):
        Layout(world_size=2, pp=2, dp=2, batch_size=32)
    with pytest.raises(ValueError, match="does not split into 2 replicas x 4 micro-batches"):
        Layout(world_size=2, pp=1, dp=2, batch_size=12, n_microbatches=4)
