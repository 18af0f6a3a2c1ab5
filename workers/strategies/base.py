"""The one interface every strategy implements, and the registry its runtimes join.

The training loop (``workers/train.py``) only talks to a :class:`Strategy`: it prepares the
model, runs one step's forward and backward, clips, evaluates, and names the modules a
checkpoint holds. A strategy family's runtime module registers its classes with
:func:`register`; ``workers.strategies.get_strategy`` imports the module that the strategy's
plan names (``StrategyPlan.runtime``) on first use.
"""

from abc import ABC, abstractmethod
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.distributed as dist
from pydantic import BaseModel
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from workers.data import StoreSplit, eval_batches
from workers.device_policy import policy_for
from workers.losses import CROSS_ENTROPY, TERMS, Criterion
from workers.model_pieces import Piece, own_pieces
from workers.precision import Precision
from workers.spec.layout import Layout
from workers.spec.names import STRATEGIES


class EpochSums:
    """The loss sum, the task's metric sums (``workers.losses.TERMS``) and the samples of the
    epoch so far on this rank.

    The sums stay on the device: adding to them needs no host sync inside the step.
    """

    def __init__(
        self,
        sums: list[float] | None = None,
        *,
        device: torch.device,
        criterion: Criterion = CROSS_ENTROPY,
    ) -> None:
        self.criterion = criterion
        sums = sums or [0.0] * (len(TERMS[criterion.task]) + 2)
        self.values = torch.tensor(sums[:-1], dtype=torch.float64, device=device)
        self.count = int(sums[-1])

    def add(self, loss: torch.Tensor, logits: torch.Tensor, y: torch.Tensor) -> None:
        """``loss`` is the mean over the rows of ``y``."""
        self.values[0] += loss.detach().double() * len(y)
        self.values[1:] += self.criterion.terms(logits, y)
        self.count += len(y)

    def tolist(self) -> list[float]:
        """This rank's sums, as a checkpoint keeps them."""
        return [*self.values.tolist(), float(self.count)]

    def all_reduced(self) -> list[float]:
        """The sums over every rank (collective). Ranks without the loss add zeros."""
        sums = torch.cat([self.values, self.values.new_tensor([float(self.count)])])
        if dist.is_initialized():
            dist.all_reduce(sums)
        return sums.tolist()


@dataclass(frozen=True, kw_only=True, eq=False)
class RankPlacement:
    """Where this rank sits in the job, and what its strategy lays its part of the model out
    with: what :meth:`Strategy.prepare` is given besides the model.

    Compared by identity (``eq=False``): ``==`` on the ``sample`` tensor gives a tensor, not a
    truth value.
    """

    layout: Layout  # how the ranks share the model and the batch
    rank: int  # this rank, in the job's world
    device: torch.device  # this rank's device
    precision: Precision  # the run's
    # What the strategy's plan gives its runtime (``StrategyPlan.settings``); None: nothing.
    settings: BaseModel | None = None
    # One micro-batch of inputs on the CPU, for strategies that trace the model.
    sample: torch.Tensor | None = None
    # Whether every rank receives its state from a live replica once laid out (a resize or a
    # recovery that continues in memory): the ranks need not agree at construction.
    state_arrives: bool = False


class Strategy(ABC):
    """How one parallelism lays the model over the ranks and runs one step on it."""

    name: ClassVar[str]
    # The loss and the task's metrics; the trainer sets it after prepare.
    criterion: Criterion = CROSS_ENTROPY

    @classmethod
    @abstractmethod
    def prepare(cls, model: nn.Module, placement: RankPlacement) -> "Strategy":
        """Wrap or cut ``model`` for the rank ``placement`` describes; every rank of the job
        calls it."""

    @classmethod
    def lays_out_meta(cls, model: nn.Module) -> bool:
        """Whether :meth:`prepare` takes ``model`` on the meta device and lays it out there,
        leaving each rank's part to be given storage and values (workers/in_place_init.py):
        a strategy that splits the model, so that no rank holds it whole. The others get it
        with its values."""
        return False

    @classmethod
    def returns_freed_memory(
        cls, settings: BaseModel | None, *, layout: Layout, device: torch.device
    ) -> bool:
        """Whether a rank hands the blocks it frees back to the kernel at once, for a peak near
        what it holds (workers/malloc.py): not by default."""
        return False

    @classmethod
    def job_memory(
        cls, settings: BaseModel | None, *, layout: Layout, device: torch.device
    ) -> AbstractContextManager:
        """What a rank's whole job (building, steps, checkpoints) runs inside, for how its
        allocator treats freed memory (:meth:`returns_freed_memory`)."""
        wanted = cls.returns_freed_memory(settings, layout=layout, device=device)
        return policy_for(device).job_memory(wanted)

    @property
    @abstractmethod
    def modules(self) -> list[nn.Module]:
        """This rank's modules: what the optimizer trains and a checkpoint saves and loads."""

    def parameters(self) -> list[nn.Parameter]:
        return [p for module in self.modules for p in module.parameters()]

    @property
    def replicated(self) -> bool:
        """Whether every rank holds the whole state, so that a live rank can hand it on."""
        return False

    def train(self, mode: bool = True) -> None:
        for module in self.modules:
            module.train(mode)

    @abstractmethod
    def forward_backward(
        self, x: torch.Tensor, y: torch.Tensor, *, precision: Precision, sums: EpochSums
    ) -> torch.Tensor | None:
        """Gradients of this rank's batch, averaged as one batch of the whole job; adds the
        batch's loss to ``sums`` and returns the loss (None on ranks that never see it)."""

    @abstractmethod
    def clip_grad_norm(self, max_norm: float) -> None:
        """Clip by the norm of the whole model's gradient."""

    @abstractmethod
    def evaluate(
        self, split: StoreSplit, *, batch_size: int, precision: Precision
    ) -> dict[str, float]:
        """Loss and the task's metrics over the whole ``split`` (collective): every rank gets
        them."""

    @abstractmethod
    def model_pieces(self) -> dict[str, Piece]:
        """This rank's pieces of the model's state under the full model's names, on the CPU,
        for the client to put together (workers/model_pieces.py): together the ranks send
        each value once, and none gathers the model whole."""


REGISTERED: dict[str, type[Strategy]] = {}


def register(cls: type[Strategy]) -> type[Strategy]:
    """Class decorator: make ``cls`` the strategy called ``cls.name``."""
    if cls.name not in STRATEGIES:
        raise ValueError(
            f"strategy {cls.name!r}: add its name to STRATEGIES in workers/spec/names.py"
        )
    REGISTERED[cls.name] = cls
    return cls


class WholeModel(Strategy):
    """The base of strategies whose every rank holds the whole model and a share of the batch.

    ``wrapped`` is what the strategy made of the model (a DDP module, a DataParallel module,
    the model itself); gradients of micro-batches accumulate locally until the last one.
    """

    def __init__(
        self, wrapped: nn.Module, *, layout: Layout, rank: int, device: torch.device
    ) -> None:
        self.wrapped, self.layout, self.rank, self.device = wrapped, layout, rank, device

    @property
    def modules(self) -> list[nn.Module]:
        return [self.wrapped]

    @property
    def replicated(self) -> bool:
        """Whether every rank holds the whole state (DDP): a live rank can hand it on."""
        return isinstance(self.wrapped, DistributedDataParallel)

    @property
    def plain(self) -> nn.Module:
        """The model without its wrapper."""
        return self.wrapped.module if hasattr(self.wrapped, "module") else self.wrapped

    def forward_backward(
        self, x: torch.Tensor, y: torch.Tensor, *, precision: Precision, sums: EpochSums
    ) -> torch.Tensor:
        size = self.layout.micro_batch
        if self.layout.elastic:  # this replica's share may be a row more than per_rank_batch
            size = -(-len(x) // self.layout.n_microbatches)
        micro_batches = list(zip(x.split(size), y.split(size), strict=True))
        for i, (mx, my) in enumerate(micro_batches):
            # Only the last micro-batch all-reduces; the others accumulate locally.
            with self._gradient_sync(last=i == len(micro_batches) - 1):
                with self._autocast(precision):
                    logits = self.wrapped(mx)
                    loss = self.criterion(logits, my)
                precision.scale(loss * self._weight(len(my), len(y))).backward()
            sums.add(loss, logits, my)
        return loss

    def _weight(self, rows: int, rank_rows: int) -> float:
        """A micro-batch's share of what this rank contributes, so that the replicas' average
        is the batch's mean loss: of the rank's batch (accumulation equals one batch), or,
        where an elastic job's replicas hold shares that differ by a row, of the global batch
        times the replicas (a larger share weighs more)."""
        if self.layout.elastic:
            return rows * self.layout.dp / self.layout.batch_size
        return rows / rank_rows

    def _gradient_sync(self, last: bool) -> AbstractContextManager:
        """Around one micro-batch's forward and backward: reduce gradients on the last only."""
        return nullcontext() if last else getattr(self.wrapped, "no_sync", nullcontext)()

    def _autocast(self, precision: Precision) -> AbstractContextManager:
        return precision.autocast()

    def clip_grad_norm(self, max_norm: float) -> None:
        nn.utils.clip_grad_norm_(self.wrapped.parameters(), max_norm)

    @torch.no_grad()
    def evaluate(
        self, split: StoreSplit, *, batch_size: int, precision: Precision
    ) -> dict[str, float]:
        self.wrapped.eval()
        # The plain module: DDP's forward would try to sync buffers in the middle of uneven
        # shards.
        module = self.plain
        batches = eval_batches(
            split, rank=self.rank, world_size=self.layout.world_size, batch_size=batch_size
        )
        sums = EpochSums(device=self.device, criterion=self.criterion)
        for x, y in batches:
            x, y = x.to(self.device), y.to(self.device)
            with precision.autocast():
                logits = module(x)
            logits = logits.float()
            sums.add(self.criterion(logits, y), logits, y)
        return self.criterion.metrics(sums.all_reduced())

    def model_pieces(self) -> dict[str, Piece]:
        # Every rank holds the whole model: the first sends it.
        return own_pieces(self.plain.state_dict(), sends_plain=self.rank == 0)
