"""Where a model can be cut into pipeline stages, and the cut itself: what the client checks
and plans with (:func:`checked_cut`, which the pipeline's plan is given, and
``workflows/runs/planner.py``) and what the pipeline strategy
(``workers/strategies/pipeline/schedule.py``) runs.

Three kinds of cut, each keeping the full model's parameter names in every stage:

- an ``nn.Sequential`` is cut at named top-level children into consecutive stages;
- a model that names its blocks in ``pipeline_blocks`` (an ``nn.ModuleDict`` child whose
  blocks its ``forward`` runs in order, skipping each other child that is None: torchtitan's
  convention, followed by the built-in ``GPT``) is cut between blocks (``"layers.2"``): each
  stage is a copy of the model keeping its own blocks, the first also the children registered
  before them (embeddings), the last those after (the head). Its stages stay plain modules,
  which a tensor-parallel plan can split;
- any other model is traced by ``torch.distributed.pipelining.pipeline()`` (``torch.export``
  underneath) and cut at module paths (``"layer3"``, ``"layer4.1"``): a stage begins where
  that module's forward begins.

``torch.distributed.pipelining`` is imported only to trace: checking a cut without tracing, and
the client's checks, do without it (~0.8 s).
"""

import copy
import itertools
import logging
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from workers.data import zero_samples
from workers.models import build_model
from workers.spec.plans.base import StrategySections
from workers.spec.plans.pipeline import PipelinePlan, given_stage_replicas

if TYPE_CHECKING:
    from torch.distributed.pipelining import Pipe

logger = logging.getLogger(__name__)

# A traced cut and activation checkpointing: refused on the client (checked_cut) and by a rank.
TRACED_AND_CHECKPOINTED = (
    "training.activation_checkpointing: {model} is cut into stages by tracing, which "
    "checkpointed blocks do not survive; give the model pipeline_blocks "
    "(docs/guides/parallelism.md) or set it to 'none'"
)


def checked_cut(sections: StrategySections, plan: PipelinePlan) -> list[str]:
    """The cut points of a model whose layers are not written out in ``MODEL_LAYERS``: it is
    built (and, unless it names its blocks, traced) here, so that a model that does not
    trace, or a split point where no stage can begin, is a config error before anything
    launches. ``plan``: the staged strategy's, which says the micro-batches."""
    p, data, training = sections.pipeline, sections.data, sections.training
    replicas = given_stage_replicas(p, sections.parallel) or 1  # whatever the world
    micro_batch = max(1, training.batch_size // replicas // plan.micro_batches(p))
    # The class count only sizes the last layer; before preprocessing, assume CIFAR-10's.
    model = build_model(
        sections.model, num_classes=10, seed=training.seed, input_shape=data.sample_shape
    )
    if sections.parallel.tp > 1:
        check_tensor_parallel_stages(model)
    if training.activation_checkpointing != "none" and is_traced(model):
        raise ValueError(TRACED_AND_CHECKPOINTED.format(model=type(model).__name__))
    if training.compile and is_traced(model):
        raise ValueError(
            f"training.compile: {type(model).__name__} is cut into stages by tracing, "
            "which compiles nothing; give the model pipeline_blocks "
            "(docs/guides/parallelism.md) or set it to false"
        )
    sample = zero_samples(micro_batch, data.sample_shape, tokens=data.tokens)
    return check_cut(model, sample, p.split_points)


def cut_into_stages(model: nn.Module, split_points: Sequence[str]) -> list[nn.Module]:
    """Consecutive stages of a model that is not traced (:func:`is_traced`); stage ``i+1``
    starts at ``split_points[i]``. The stages share ``model``'s parameters, under its names, so
    a stage's ``state_dict`` keys are the full model's."""
    if blocks_of(model) is not None:
        return _cut_between_blocks(model, split_points)
    names = [name for name, _ in model.named_children()]
    if not isinstance(model, nn.Sequential):
        raise ValueError(
            f"model: {type(model).__name__} is not an nn.Sequential of named layers, so it "
            "cannot be cut into pipeline stages"
        )
    bounds = _bounds(split_points, names, what="top-level module")
    children = dict(model.named_children())
    return [
        nn.Sequential(OrderedDict((n, children[n]) for n in names[start:end]))
        for start, end in itertools.pairwise(bounds)
    ]


def blocks_of(model: nn.Module) -> str | None:
    """The name of the ``nn.ModuleDict`` child whose blocks a model is cut between (its
    ``pipeline_blocks``); None for a model that does not declare one."""
    name = getattr(model, "pipeline_blocks", None)
    if name is None:
        return None
    if not isinstance(getattr(model, name, None), nn.ModuleDict):
        raise ValueError(
            f"model: {type(model).__name__}.pipeline_blocks names {name!r}, which is not an "
            "nn.ModuleDict child of it"
        )
    return name


def _bounds(split_points: Sequence[str], names: Sequence[str], *, what: str) -> list[int]:
    """Where each stage begins and the last ends, as indices into ``names``."""
    positions = []
    for point in split_points:
        if point not in names:
            raise ValueError(
                f"pipeline.split_points: {point!r} names no {what}; the model's are {list(names)}"
            )
        positions.append(names.index(point))
    if positions != sorted(set(positions)) or 0 in positions:
        raise ValueError(
            f"pipeline.split_points: {list(split_points)} must follow the model's order "
            f"{list(names)} and leave the first stage at least one of them"
        )
    return [0, *positions, len(names)]


def _cut_between_blocks(model: nn.Module, split_points: Sequence[str]) -> list[nn.Module]:
    blocks_name = blocks_of(model)
    blocks = getattr(model, blocks_name)
    points = [f"{blocks_name}.{key}" for key in blocks]
    bounds = _bounds(split_points, points, what=f"block of {type(model).__name__}")
    children = [name for name, _ in model.named_children()]
    at = children.index(blocks_name)
    before, after = children[:at], children[at + 1 :]
    keys = list(blocks)
    stages = []
    for index, (start, end) in enumerate(itertools.pairwise(bounds)):
        stage = _shallow_copy(model)
        dropped = [*(before if index > 0 else []), *(after if end < len(keys) else [])]
        for name in dropped:
            setattr(stage, name, None)
        setattr(stage, blocks_name, nn.ModuleDict({key: blocks[key] for key in keys[start:end]}))
        stages.append(stage)
    return stages


def _shallow_copy(model: nn.Module) -> nn.Module:
    """A new module object of ``model``'s class that shares its children, parameters and
    buffers, with tables of its own: a child set to None, or a hook a wrapper registers, on
    the copy leaves ``model`` as it is."""
    twin = copy.copy(model)
    for name, value in vars(model).items():
        if isinstance(value, dict | set):
            twin.__dict__[name] = copy.copy(value)
    return twin


def even_split(names: Sequence[str], n_stages: int) -> list[str]:
    """Split points that give every stage the same number of layers (the first ones get more)."""
    if n_stages > len(names):
        raise ValueError(
            f"pipeline: {n_stages} stages need at least {n_stages} layers; the model has "
            f"{len(names)} ({list(names)})"
        )
    base, extra = divmod(len(names), n_stages)
    points, at = [], 0
    for stage in range(n_stages - 1):
        at += base + (stage < extra)
        points.append(names[at])
    return points


def is_traced(model: nn.Module) -> bool:
    """Whether ``model`` is cut by tracing: anything but an ``nn.Sequential`` or a model that
    names its blocks."""
    return not isinstance(model, nn.Sequential) and blocks_of(model) is None


@dataclass(frozen=True)
class _Calls:
    """The modules one forward of a model calls: where a traced cut may begin."""

    order: tuple[str, ...]  # module paths, in the order of their first call
    counts: dict[str, int]  # path -> calls in one forward
    places: dict[str, int]  # path -> where its first call begins; a container and its first
    # child begin at the same place, and a cut before either is the same cut


def _module_calls(model: nn.Module, sample: torch.Tensor) -> _Calls:
    events: list[str] = []

    def recorder(path: str) -> Callable[..., None]:
        def record(module: nn.Module, args: tuple) -> None:
            events.append(path)

        return record

    handles = [
        module.register_forward_pre_hook(recorder(path))
        for path, module in model.named_modules()
        if path
    ]
    modes = {module: module.training for module in model.modules()}
    try:
        # Eval mode: the call order is the same, and no batch statistics move.
        model.eval()
        with torch.no_grad():
            model(sample)
    finally:
        for handle in handles:
            handle.remove()
        for module, mode in modes.items():
            module.training = mode
    order: list[str] = []
    counts: dict[str, int] = {}
    places: dict[str, int] = {}
    place, previous = -1, None
    for path in events:
        # A call right after its parent's begins where the parent does: nothing ran between.
        if previous is None or not path.startswith(previous + "."):
            place += 1
        previous = path
        counts[path] = counts.get(path, 0) + 1
        if path not in places:
            places[path] = place
            order.append(path)
    return _Calls(order=tuple(order), counts=counts, places=places)


def check_tensor_parallel_stages(model: nn.Module) -> None:
    """Refuse, naming ``parallel.tp``, a model whose stages a tensor-parallel plan cannot
    split: a traced stage's layers are nodes of a graph, not the modules a plan names."""
    if is_traced(model):
        raise ValueError(
            f"parallel.tp: {type(model).__name__}'s pipeline stages are traced, and a traced "
            "stage's layers are graph nodes that a tensor-parallel plan cannot split; set "
            "parallel.tp = 1, or make the model an nn.Sequential or name its blocks "
            "(pipeline_blocks, as workers.model_sources.builtin.GPT does)"
        )


def cut_points(model: nn.Module, sample: torch.Tensor, *, depth: int = 2) -> list[str]:
    """Where a stage of ``model`` may begin, in the order its forward runs; the first entry
    names where the model itself begins (no cut goes there). What the planner profiles.

    An ``nn.Sequential``: its top-level children. A model that names its blocks: each block
    (``layers.0``, ``layers.1``, …). Any other model: the module paths up to
    ``depth`` levels deep (resnet: ``layer1`` … ``layer4`` and ``layer1.1`` …) that run once per
    forward, one per place (``layer1`` and ``layer1.0`` begin at the same place: ``layer1``),
    except in-place activations.
    """
    blocks_name = blocks_of(model)
    if blocks_name is not None:
        return [f"{blocks_name}.{key}" for key in getattr(model, blocks_name)]
    if not is_traced(model):
        return [name for name, _ in model.named_children()]
    return _candidates(model, _module_calls(model, sample), depth=depth)


def _candidates(model: nn.Module, calls: _Calls, *, depth: int = 2) -> list[str]:
    if not calls.order:
        return []
    points, taken = [calls.order[0]], {0}
    for path in calls.order:
        place = calls.places[path]
        if calls.counts[path] != 1 or path.count(".") >= depth or place in taken:
            continue
        if getattr(model.get_submodule(path), "inplace", False):
            continue  # nn.ReLU(inplace=True) would change a received activation in place
        taken.add(place)
        points.append(path)
    return points


def check_cut(
    model: nn.Module, sample: torch.Tensor, split_points: Sequence[str] | None
) -> list[str]:
    """``model``'s cut points (:func:`cut_points`), once ``split_points`` (None: to be planned)
    are known to cut it: a ValueError naming the field otherwise. A traced model is traced here
    as the ranks will trace it, so a model that does not trace fails here, with the reason."""
    if not is_traced(model):
        if split_points is not None:
            cut_into_stages(model, split_points)
        return cut_points(model, sample)
    trace_stages(model, sample, split_points or ())
    return cut_points(model, sample)


def check_split_points(model: nn.Module, sample: torch.Tensor, split_points: Sequence[str]) -> None:
    """Refuse, naming ``pipeline.split_points``, points where a traced cut of ``model`` cannot
    begin a stage: not a module path, a module that runs other than once per forward, the
    model's own beginning, or points out of the forward's order."""
    name = type(model).__name__
    modules = dict(model.named_modules())
    calls = _module_calls(model, sample)
    candidates = _candidates(model, calls)[1:]
    unknown = [point for point in split_points if not point or point not in modules]
    if unknown:
        raise ValueError(
            f"pipeline.split_points: {unknown} name no module of {name}; a stage can begin at "
            f"{candidates} (or a deeper module path)"
        )
    for point in split_points:
        runs = calls.counts.get(point, 0)
        if runs != 1:
            raise ValueError(
                f"pipeline.split_points: {point!r} runs {runs} times in one forward of {name}; "
                f"a stage can only begin at a module that runs once, such as {candidates}"
            )
        if calls.places[point] == 0:
            raise ValueError(
                f"pipeline.split_points: {point!r} is where {name} begins, which leaves the "
                "first stage empty"
            )
    places = [calls.places[point] for point in split_points]
    if any(b <= a for a, b in itertools.pairwise(places)):
        in_order = sorted(split_points, key=calls.places.__getitem__)
        raise ValueError(
            f"pipeline.split_points: {list(split_points)} must begin at different places, in "
            f"the order {name}'s forward runs them ({in_order})"
        )


def trace_stages(model: nn.Module, sample: torch.Tensor, split_points: Sequence[str]) -> "Pipe":
    """``model`` traced by ``torch.distributed.pipelining.pipeline()`` and cut before each of
    ``split_points``: ``len(split_points) + 1`` stage modules that share ``model``'s parameters
    under its own names. ``sample`` is one micro-batch: the stages keep its shape.

    A ValueError that names the field: a point that is no place to cut, or a model that the
    tracer refuses (with the tracer's reason).
    """
    from torch.distributed.pipelining import SplitPoint, pipeline

    check_split_points(model, sample, split_points)
    name = type(model).__name__
    try:
        with _split_annotations_removed(model, split_points):
            pipe = pipeline(
                model,
                mb_args=(sample,),
                split_spec=dict.fromkeys(split_points, SplitPoint.BEGINNING),
            )
    # torch.export raises many types (UserError, data-dependent guards, unsupported ops); each
    # is the same fact for the user: this model does not trace.
    except Exception as error:
        raise ValueError(
            f"model: {name} does not trace into pipeline stages (torch.export): "
            f"{_tracer_reason(error)}"
        ) from error
    if pipe.num_stages != len(split_points) + 1:
        raise ValueError(
            f"pipeline.split_points: tracing {name} cut at {list(split_points)} gave "
            f"{pipe.num_stages} stages, not {len(split_points) + 1}"
        )
    _check_stages_run(pipe, sample, name=name, split_points=split_points)
    return pipe


def _check_stages_run(
    pipe: "Pipe", sample: torch.Tensor, *, name: str, split_points: Sequence[str]
) -> None:
    """Run the stages once as a pipeline would: each on inputs that are leaves requiring grad.
    A stage that begins by changing its input in place fails there, not mid-training."""
    buffers = [(buffer, buffer.clone()) for buffer in pipe.split_gm.buffers()]
    try:
        pipe(sample)
    # Whatever a stage raises there, the cut is the cause.
    except Exception as error:
        raise ValueError(
            f"pipeline.split_points: {name} cut at {list(split_points)} does not run as "
            f"stages: {_tracer_reason(error)}; a stage cannot begin by changing its input in "
            "place (nn.ReLU(inplace=True)): cut before or after that module"
        ) from error
    finally:
        # The run moved no parameter, but batch statistics would have.
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)


@contextmanager
def _split_annotations_removed(model: nn.Module, split_points: Sequence[str]) -> Iterator[None]:
    """``pipeline()`` marks each split module by replacing its ``forward`` (and keeping the
    original under a name of its own); put them back, so the model runs as before (and a
    second trace does not split twice). What it added to a module's instance attributes goes,
    whatever torch calls it."""
    marked = [model.get_submodule(point) for point in split_points]
    own = [module.__dict__.get("forward") for module in marked]
    before = [set(module.__dict__) for module in marked]
    try:
        yield
    finally:
        for module, forward, names in zip(marked, own, before, strict=True):
            for added in set(module.__dict__) - names - {"forward"}:
                del module.__dict__[added]
            if forward is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = forward


def move_traced_ops(stage: torch.fx.GraphModule, device: torch.device) -> None:
    """Make the ops of a traced stage that create tensors (``torch.zeros(..., device=...)``)
    create them on ``device``: the tracer burns the trace's device into their arguments.
    ``Pipe.build_stage`` does the same to the module it builds on, with a helper of its own that
    torch keeps private; this is it, with torch.fx's public API."""
    from torch.export.unflatten import InterpreterModule

    modified = False
    for node in stage.graph.nodes:
        if node.op == "call_function":
            if "device" in node.kwargs and node.kwargs["device"] != device:
                node.update_kwarg("device", device)
                modified = True
        elif node.op == "call_module":
            submodule = stage.get_submodule(node.target)
            if isinstance(submodule, torch.fx.GraphModule):
                move_traced_ops(submodule, device)
            elif isinstance(submodule, InterpreterModule):
                move_traced_ops(submodule.graph_module, device)
            else:
                logger.warning(
                    "not moving the ops of %s to %s: it is a %s, not a graph",
                    node.target,
                    device,
                    type(submodule).__name__,
                )
    if modified:
        stage.recompile()


def _tracer_reason(error: BaseException) -> str:
    """The root cause of a failed trace on one line, with the user's line it points at."""
    # pipelining wraps export's error in a generic RuntimeError; the reason is underneath.
    while error.__cause__ is not None:
        error = error.__cause__
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    reason = f"{type(error).__name__}: {lines[0] if lines else 'no message'}"
    marker = "The following call raised this error:"
    if marker in lines and lines.index(marker) + 2 < len(lines):
        at = lines.index(marker)
        reason += f" ({lines[at + 1]}: {lines[at + 2]})"
    return reason
