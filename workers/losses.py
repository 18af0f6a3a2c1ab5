"""The training loss, and the metrics of the task it serves.

``training.loss`` names a loss (``cross_entropy``, ``bce_with_logits``, ``mse``, ``l1``) or an
import path to one (a function ``f(output, target)`` or an ``nn.Module`` class, returning the
mean over the batch). The task follows from the loss unless ``training.task`` says otherwise:
classification reports accuracy, regression MSE, MAE and R².

Metrics are kept as sums over batches (:meth:`Criterion.terms`): sums add across steps and
across ranks with one all-reduce, and the epoch's figures come out of them at the end
(:meth:`Criterion.metrics`), equal to computing them over all the epoch's predictions at once.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from workers.model_sources import import_object
from workers.spec.sections import LOSSES, TrainingConfig

LossFunction = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

_FUNCTIONS: dict[str, LossFunction] = {
    "cross_entropy": F.cross_entropy,
    "bce_with_logits": F.binary_cross_entropy_with_logits,
    "mse": F.mse_loss,
    "l1": F.l1_loss,
}
assert set(_FUNCTIONS) == set(LOSSES), "workers/spec/sections.py LOSSES names the same losses"

# The sums each task keeps besides the loss's, in order.
TERMS = {
    "classification": ("correct",),
    "regression": ("squared_error", "absolute_error", "target_sum", "target_square_sum", "values"),
}


@dataclass(frozen=True)
class Criterion:
    """The loss a step minimizes, and the metrics the epoch reports."""

    name: str
    task: str  # "classification" or "regression"
    function: LossFunction

    @classmethod
    def of(cls, config: TrainingConfig) -> "Criterion":
        function = _FUNCTIONS.get(config.loss)
        if function is None:
            found = import_object(config.loss, field="training.loss")
            # A loss class (nn.MSELoss, a user's nn.Module) is built with its defaults.
            function = found() if isinstance(found, type) else found
        return cls(name=config.loss, task=config.resolved_task, function=function)

    def outputs(self, num_classes: int) -> int:
        """How many values per sample the model's last layer gives: one per class, or the
        target itself for regression (a class index read as a number)."""
        return num_classes if self.task == "classification" else 1

    def target(self, output: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y`` as the loss takes it: class indices for cross-entropy; float values shaped
        like the output otherwise (one-hot rows for BCE over several outputs)."""
        if self.name == "bce_with_logits" and _class_indices(output, y):
            return F.one_hot(y, output.shape[1]).float()
        if self.task == "regression" or self.name == "bce_with_logits":
            y = y.float()
            return y.reshape(output.shape) if y.numel() == output.numel() else y
        return y

    def __call__(self, output: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The mean loss over the batch (over every token, for a sequence's logits)."""
        if self.name == "cross_entropy" and _token_logits(output, y):
            # One row per token: the same mean as (N, C, T) logits, 2.6x faster (measured).
            return self.function(output.flatten(0, -2), y.flatten())
        return self.function(output, self.target(output, y))

    def terms(self, output: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """This batch's metric sums (float64, in the order of ``TERMS[task]``)."""
        output = output.detach()
        if self.task == "classification":
            if _token_logits(output, y):  # each sample's fraction of tokens right
                right = (output.argmax(-1) == y).double()
                return right.flatten(1).mean(1).sum().reshape(1)
            if _class_indices(output, y):
                correct = output.argmax(1) == y
            else:  # binary or multi-label: a row is right when every logit is on its side
                truth = self.target(output, y) > 0.5
                correct = ((output > 0) == truth).reshape(len(y), -1).all(1)
            return correct.sum().double().reshape(1)
        target = self.target(output, y).double()
        error = output.double() - target
        return torch.stack(
            [
                error.square().sum(),
                error.abs().sum(),
                target.sum(),
                target.square().sum(),
                target.new_tensor(float(target.numel())),
            ]
        )

    def metrics(self, sums: list[float]) -> dict[str, float]:
        """The epoch's figures from ``[loss sum, *terms, samples]`` (summed over ranks)."""
        loss_sum, *terms, count = sums
        figures = {"loss": loss_sum / max(count, 1)}
        if self.task == "classification":
            return figures | {"accuracy": terms[0] / max(count, 1)}
        squared, absolute, total, square_total, values = terms
        values = max(values, 1.0)
        spread = square_total - total * total / values  # the sum of squares about the mean
        return figures | {
            "mse": squared / values,
            "mae": absolute / values,
            "r2": 1.0 - squared / spread if spread > 0 else math.nan,
        }


def _token_logits(output: torch.Tensor, y: torch.Tensor) -> bool:
    """Whether ``output`` holds logits for each of ``y``'s token ids (a language model's)."""
    is_integer = not (y.is_floating_point() or y.is_complex())
    return is_integer and y.ndim >= 2 and output.shape[:-1] == y.shape


def _class_indices(output: torch.Tensor, y: torch.Tensor) -> bool:
    """Whether ``y`` holds one class index per row of a multi-column ``output``."""
    is_integer = not (y.is_floating_point() or y.is_complex())
    return is_integer and y.ndim == 1 and output.ndim == 2 and output.shape[1] > 1


CROSS_ENTROPY = Criterion(name="cross_entropy", task="classification", function=F.cross_entropy)

__all__ = ["CROSS_ENTROPY", "TERMS", "Criterion"]
