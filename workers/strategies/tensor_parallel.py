"""Tensor parallelism: the ranks of a ``tp`` mesh each hold a slice of the layers the model's
plan names, and run every batch together (``torch.distributed.tensor.parallel``).

Not a strategy of its own: ``fsdp``, ``hsdp`` and the staged strategies (``pipeline``,
``model_parallel``, on each stage) apply it first, on the ``tp`` dimension of their mesh, when
``parallel.tp > 1``. The plan is the model's to give (``model.tp_plan``): which
layers are split by columns, which by rows, is a fact of the architecture.
"""

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

from workers.model_sources import ModelError, import_object


def apply_tensor_parallel(
    model: nn.Module, *, mesh: DeviceMesh, plan_path: str | None
) -> nn.Module:
    """Split ``model``'s layers over ``mesh`` as the plan at ``plan_path`` says:
    ``plan(model, mesh)`` returns ``{module name: ParallelStyle}`` for ``parallelize_module``."""
    plan = tensor_parallel_plan(model, mesh=mesh, plan_path=plan_path)
    return parallelize_module(model, mesh, plan)


def tensor_parallel_plan(
    model: nn.Module, *, mesh: DeviceMesh, plan_path: str | None
) -> dict[str, ParallelStyle]:
    """The plan at ``plan_path`` for the whole ``model``, checked: every name one of its
    modules, every value a ``ParallelStyle``. A pipeline's stage applies the part of it that
    names its own modules (:func:`apply_plan_part`)."""
    if plan_path is None:  # the config refuses it first; a strategy prepared by hand here
        raise ModelError("model.tp_plan: parallel.tp > 1 needs the model's plan")
    plan = import_object(plan_path, field="model.tp_plan")(model, mesh)
    if not isinstance(plan, dict) or not plan:
        raise ModelError(
            f"model.tp_plan: {plan_path} returned {type(plan).__name__}, not a dict of module "
            "names to ParallelStyle (ColwiseParallel, RowwiseParallel, ...)"
        )
    named = dict(model.named_modules())
    for name, style in plan.items():
        if name not in named:
            raise ModelError(f"model.tp_plan: {plan_path} names {name!r}, which the model lacks")
        if not isinstance(style, ParallelStyle):
            raise ModelError(
                f"model.tp_plan: {plan_path} gives {name!r} a {type(style).__name__}, not a "
                "ParallelStyle"
            )
    return plan


def apply_plan_part(
    stage: nn.Module, *, mesh: DeviceMesh, plan: dict[str, ParallelStyle]
) -> nn.Module:
    """Split a pipeline stage's layers by the whole model's ``plan``: the stage keeps the
    model's module names, and the entries naming other stages' modules are theirs."""
    named = dict(stage.named_modules())
    return parallelize_module(stage, mesh, {k: v for k, v in plan.items() if k in named})
