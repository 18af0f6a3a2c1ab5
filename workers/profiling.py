"""Per-layer cost of a model on this worker's device: what the stage planner balances.

Each layer is timed forward and backward on one micro-batch (all layers in turns, repeatedly),
and its parameter and saved-activation bytes are counted, on the device a stage would run on.
A layer is the piece of the model between two of its cut points
(``workers.stage_cuts.cut_points``): an ``nn.Sequential``'s top-level child, a block of a model
that names its blocks (the first with what comes before it, the last with what comes after),
or a piece of any other model traced as a pipeline stage.
"""

import itertools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import fx, nn

from workers.models import ModelConfig, build_model, largest_unit_bytes
from workers.stage_cuts import cut_into_stages, cut_points, is_traced, trace_stages


@dataclass(frozen=True)
class LayerProfile:
    name: str
    seconds: float  # forward + backward of one micro-batch, median of several runs
    param_bytes: int
    activation_bytes: int  # kept for backward per micro-batch in flight
    output_bytes: int  # what crosses to the next stage when the model is cut after this layer


@dataclass(frozen=True)
class DeviceProfile:
    device: str
    memory_bytes: int  # what one stage may use on this device
    micro_batch: int
    layers: tuple[LayerProfile, ...]
    # The largest unit FSDP gathers whole (workers/models.py: largest_unit_bytes); 0: not
    # measured, the largest layer stands in.
    largest_unit_bytes: int = 0


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch as the store gives it: ``rows`` samples of ``sample_shape``, token ids
    for a language model (``tokens``), values otherwise."""

    rows: int
    sample_shape: tuple[int, ...]
    tokens: bool = False

    def drawn(self, num_classes: int) -> torch.Tensor:
        """Random inputs of this shape (token ids below ``num_classes``)."""
        if self.tokens:
            return torch.randint(num_classes, (self.rows, *self.sample_shape))
        return torch.randn(self.rows, *self.sample_shape)


def profile_model(
    model: str | ModelConfig,
    batch: MicroBatch,
    *,
    num_classes: int,
    repeats: int = 7,
    build: Callable[[], nn.Module] | None = None,
) -> DeviceProfile:
    """Profile a model (a name or the ``[model]`` section, with its kwargs), or the one
    ``build`` returns, on ``batch`` on this process's device (a Dask task on a rank worker)."""
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else (torch.device("cpu"))
    )
    if build is None:
        model = build_model(model, num_classes=num_classes, seed=0, input_shape=batch.sample_shape)
    else:
        model = build()
    sample = batch.drawn(num_classes)
    layers = profile_module(model.to(device), sample=sample.to(device), repeats=repeats)
    return DeviceProfile(
        device=str(device),
        memory_bytes=_device_memory(device),
        micro_batch=batch.rows,
        layers=tuple(layers),
        largest_unit_bytes=largest_unit_bytes(model),
    )


def profile_module(
    model: nn.Module, *, sample: torch.Tensor, repeats: int = 7
) -> list[LayerProfile]:
    """Time and measure each layer of ``model`` (see the module's docstring) on ``sample``'s
    device; a layer is named by the module path where it begins, a possible split point."""
    if not is_traced(model):
        return profile_layers(model, sample=sample, repeats=repeats)
    return profile_segments(model, sample=sample, repeats=repeats)


def profile_layers(
    model: nn.Module, *, sample: torch.Tensor, repeats: int = 7
) -> list[LayerProfile]:
    """Time and measure each piece of a model cut without tracing (an ``nn.Sequential``, or a
    model that names its blocks) on ``sample``'s device, each on what the ones before give."""
    points = cut_points(model, sample)
    layers, x = [], sample
    with torch.no_grad():
        for name, piece in zip(points, cut_into_stages(model, points[1:]), strict=True):
            layers.append((name, piece, (x,)))
            x = piece(x)
    return _profile(layers, repeats=repeats)


def profile_segments(
    model: nn.Module, *, sample: torch.Tensor, repeats: int = 7
) -> list[LayerProfile]:
    """Trace ``model`` cut at every one of its cut points and time and measure each piece on
    the inputs the pieces before it give it."""
    points = cut_points(model, sample)
    pipe = trace_stages(model, sample, points[1:])
    segments = [pipe.get_stage_module(index) for index in range(pipe.num_stages)]
    inputs = _segment_inputs(pipe.split_gm, sample)
    return _profile(
        [(name, segment, inputs[segment]) for name, segment in zip(points, segments, strict=True)],
        repeats=repeats,
    )


def _segment_inputs(split: fx.GraphModule, sample: torch.Tensor) -> dict[nn.Module, tuple]:
    """What each stage module of a traced pipe receives when the pipe runs on ``sample``."""
    received: dict[nn.Module, tuple] = {}

    class Recorder(fx.Interpreter):
        def call_module(self, target: str, args: tuple, kwargs: dict) -> object:
            received[self.fetch_attr(target)] = args
            return super().call_module(target, args, kwargs)

    with torch.no_grad():
        Recorder(split).run(sample)
    return received


def _profile(layers: list[tuple[str, nn.Module, tuple]], *, repeats: int) -> list[LayerProfile]:
    """Each ``(name, layer, inputs)``'s forward and backward, timed in turns: every round runs
    each layer once, so a machine that is busy for a while slows every layer alike rather than
    the ones measured meanwhile."""
    inputs = [
        tuple(
            x.detach().requires_grad_(x.is_floating_point()) if isinstance(x, torch.Tensor) else x
            for x in args
        )
        for _, _, args in layers
    ]
    device = next(x.device for x in inputs[0] if isinstance(x, torch.Tensor))
    times: list[list[float]] = [[] for _ in layers]
    saved_bytes, output_bytes = [0] * len(layers), [0] * len(layers)
    for attempt in range(repeats + 2):  # two warm-up rounds: allocator and kernel choice
        for index, (_, layer, _) in enumerate(layers):
            layer.zero_grad(set_to_none=True)
            _synchronize(device)
            started = time.perf_counter()
            with _SavedBytes(held=layer) as saved:
                outputs = _tensors(layer(*inputs[index]))
            differentiable = [o for o in outputs if o.requires_grad]
            torch.autograd.backward(differentiable, [torch.ones_like(o) for o in differentiable])
            _synchronize(device)
            if attempt >= 2:
                times[index].append(time.perf_counter() - started)
            for x in inputs[index]:
                if isinstance(x, torch.Tensor):
                    x.grad = None
            saved_bytes[index] = saved.bytes
            output_bytes[index] = sum(o.numel() * o.element_size() for o in outputs)
    for _, layer, _ in layers:
        layer.zero_grad(set_to_none=True)
    return [
        LayerProfile(
            name=name,
            seconds=statistics.median(times[index]),
            param_bytes=sum(p.numel() * p.element_size() for p in layer.parameters()),
            activation_bytes=saved_bytes[index],
            output_bytes=output_bytes[index],
        )
        for index, (name, layer, _) in enumerate(layers)
    ]


def _tensors(value: object) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in _tensors(item)]
    return []


class _SavedBytes(torch.autograd.graph.saved_tensors_hooks):
    """Counts the bytes autograd keeps for backward (each storage once), less what ``held``
    holds anyway: a linear layer saves its weight, which is a parameter, not an activation."""

    def __init__(self, held: nn.Module) -> None:
        self.bytes = 0
        tensors = itertools.chain(held.parameters(), held.buffers())
        seen: set[int] = {tensor.untyped_storage().data_ptr() for tensor in tensors}

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                self.bytes += storage.nbytes()
            return tensor

        super().__init__(pack, lambda tensor: tensor)

    def __enter__(self) -> "_SavedBytes":
        super().__enter__()
        return self


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _device_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    try:
        from distributed import get_worker

        limit = get_worker().memory_manager.memory_limit
    except ValueError:  # not inside a Dask worker
        limit = None
    if limit:
        return int(limit)
    import psutil

    return psutil.virtual_memory().total
