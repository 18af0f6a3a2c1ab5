"""Initialise a model after a strategy has laid it out, so that no rank ever holds it whole.

torchtitan's way: build the model on the meta device (shapes, no storage), let the strategy
shard, split or cut it there, give each rank's part empty storage (``to_empty``), then draw
the initial values in place. Here the values are each module's own ``reset_parameters()``,
called in the order the model registers its modules under the run's seed, so they are the
numbers a whole-model build draws where the model's constructor initialises only through
``reset_parameters`` (torch's layers, the built-in models): the same seed gives the same
weights on every strategy, whole or split.

Each module is drawn whole into temporary storage, one module at a time, and each rank keeps
its own part of it (a DTensor's local piece, found without any communication). A rank draws
the modules it does not hold too (a pipeline's other stages), to keep the random stream where
the whole model's is, then drops them: the peak is one module whole, not the model. Where a
weights file gives a module's tensors (``model.weights``, workers/weight_files.py), they take
the place of its draw: the file is mapped, and each rank copies out only its own part.
"""

from collections.abc import Iterable

import torch
from torch import nn

from workers.checkpoint import StorageOptions, load_model_tensors, local_path
from workers.model_sources import ModelError
from workers.weight_files import WeightsError, checkpoint_tensors, open_weights


class InPlaceInitError(ModelError):
    """A model whose initial values cannot be drawn in place (names the module)."""


def _owned(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The parameters and buffers ``module`` holds itself (not its children's)."""
    return [
        *module.named_parameters(recurse=False),
        *module.named_buffers(recurse=False),
    ]


def is_meta(module: nn.Module) -> bool:
    """Whether ``module`` holds any tensor without storage (built on the meta device)."""
    tensors = [*module.parameters(), *module.buffers()]
    return any(t.is_meta for t in tensors)


def to_device(module: nn.Module, device: torch.device) -> nn.Module:
    """``module`` on ``device``: moved, or, if it is on the meta device, given empty storage
    there (its values come from :meth:`InPlaceInit.materialize`)."""
    if is_meta(module):
        return module.to_empty(device=device)
    return module.to(device)


class InPlaceInit:
    """The modules of a model that hold tensors, in the model's order, and the seed they are
    drawn from. Made from the whole model (on the meta device) before any strategy touches
    it: the strategy may cut, shard or drop modules, and these are still the whole model's."""

    def __init__(
        self,
        model: nn.Module,
        *,
        seed: int,
        weights: str | None = None,
        storage_options: StorageOptions = None,
    ) -> None:
        self.seed = seed
        self.owners = [(name, m) for name, m in model.named_modules() if _owned(m)]
        # The file's tensors (mapped, not read): they take the place of drawn values. A DCP
        # checkpoint's (a folder, or a URL) are shapes only: each rank loads its part after
        # the draws.
        self.storage_options = storage_options
        self.weights = open_weights(weights, storage_options) if weights is not None else {}
        self.checkpoint = (
            weights if weights is not None and _is_checkpoint(weights, storage_options) else None
        )
        if weights is not None:
            self._check_weights(model, weights)
        for name, module in self.owners:
            if self._drawn(name, module) and not callable(
                getattr(module, "reset_parameters", None)
            ):
                raise InPlaceInitError(
                    f"model.init: {type(module).__name__} at {name or 'the root'!r} holds "
                    f"{', '.join(n for n, _ in _owned(module))} but has no reset_parameters(), "
                    "so its values cannot be drawn in place; set model.init = 'factory' "
                    "(every rank builds the whole model first), or give model.weights"
                )

    def _drawn(self, owner: str, module: nn.Module) -> list[str]:
        """The tensors of ``module`` (at ``owner``) that no weights file gives."""
        return [n for n, _ in _owned(module) if _path(owner, n) not in self.weights]

    def _check_weights(self, model: nn.Module, path: str) -> None:
        """The file holds the model's state dict: every key, in its shape, and nothing else."""
        expected = model.state_dict()
        for key, tensor in expected.items():
            if key not in self.weights:
                raise WeightsError(f"model.weights: {path} has no {key}")
            if tuple(self.weights[key].shape) != tuple(tensor.shape):
                raise WeightsError(
                    f"model.weights: {path}: {key} is {tuple(self.weights[key].shape)}, the "
                    f"model's is {tuple(tensor.shape)}"
                )
        extra = sorted(set(self.weights) - set(expected))
        if extra:
            raise WeightsError(
                f"model.weights: {path} holds {extra[0]}, which the model has not "
                f"({len(extra)} such keys)"
            )

    @torch.no_grad()
    def materialize(self, roots: Iterable[nn.Module], *, device: torch.device) -> None:
        """Give ``roots`` (this rank's modules, as laid out) storage on ``device`` where they
        have none, and draw every value in place. Every rank of the job draws the same
        numbers; no communication."""
        for root in roots:
            if is_meta(root):
                root.to_empty(device=device)
        roots = list(roots)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            for owner, module in self.owners:
                self._draw(owner, module)
        # The file's pages this rank read count in its resident set while it is mapped.
        self.weights = {}
        if self.checkpoint is not None:
            _, prefix = checkpoint_tensors(self.checkpoint, self.storage_options)
            load_model_tensors(
                self.checkpoint, roots, prefix=prefix, storage_options=self.storage_options
            )

    def _draw(self, owner: str, module: nn.Module) -> None:
        """``module.reset_parameters()`` on whole temporary tensors, or the weights file's
        tensors where it has them all; then each of its tensors that this rank holds takes
        its part."""
        held = _owned(module)
        if not self._drawn(owner, module):
            # No draw, so no random numbers taken: every rank skips the same modules.
            if self.checkpoint is None:  # a checkpoint's come after the draws
                given = {name: self.weights[_path(owner, name)] for name, _ in held}
                _keep_parts(held, given)
            return
        whole = {
            name: torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")
            for name, tensor in held
        }
        parameters = dict(module.named_parameters(recurse=False))
        try:
            for name, tensor in held:
                if name in parameters:
                    replacement = nn.Parameter(whole[name], requires_grad=tensor.requires_grad)
                    setattr(module, name, replacement)
                else:
                    setattr(module, name, whole[name])  # a buffer stays a buffer of its kind
            module.reset_parameters()  # type: ignore[operator]
            # What reset_parameters assigned (some layers replace rather than fill).
            drawn = {name: getattr(module, name) for name, _ in held}
        finally:
            for name, tensor in held:
                setattr(module, name, tensor)
        # A module some of whose tensors the file gives: those are the file's (a checkpoint's
        # load after the draws overwrites them).
        if self.checkpoint is None:
            drawn |= {
                n: self.weights[_path(owner, n)] for n, _ in held if _path(owner, n) in self.weights
            }
        _keep_parts(held, drawn)


def _is_checkpoint(weights: str, storage_options: StorageOptions) -> bool:
    """Whether ``model.weights`` is a DCP checkpoint (a folder, or a URL, where only a
    checkpoint is taken) rather than a file to map."""
    local = local_path(weights, storage_options)
    return local is None or local.is_dir()


def _path(owner: str, name: str) -> str:
    return f"{owner}.{name}" if owner else name


def _keep_parts(held: list[tuple[str, torch.Tensor]], values: dict[str, torch.Tensor]) -> None:
    """Each tensor of ``held`` that this rank holds takes its part of the whole value of the
    same name: a DTensor its local piece, a plain tensor all of it."""
    # Here, on a rank: the client imports this module with the trainer (~1 s of imports it
    # never uses: DTensor, and the check of torch's private APIs, DCP's and dynamo's).
    from torch.distributed.tensor import DTensor

    from workers.compat.torch_private import local_offsets

    for name, tensor in held:
        if tensor.is_meta:
            continue  # another rank's (a pipeline's other stage): drawn, not kept
        value = values[name].detach()
        if isinstance(tensor, DTensor):
            # This rank's piece, where the placements put it in the whole: a view of the whole
            # value, so that only its bytes are read (of a mapped file, only its pages).
            local = tensor.to_local()
            at = zip(local_offsets(tensor), local.shape, strict=True)
            local.copy_(value[tuple(slice(start, start + size) for start, size in at)])
        else:
            tensor.copy_(value)
