"""Optuna's private APIs that sweeps rely on, all of them, checked at import.

Run with Optuna 4.2.0 and 5.0.0 (the ``[sweep]`` extra's range). Where one is missing,
importing this module fails with one line: ``ImportError: dask-train needs <name> (optuna
4.2.0 and 5.0.0 have it; this is optuna X.Y.Z)``. These are attributes an object gets in its
constructor: what is checked is that the constructor still sets them.

- A trial's id in its storage (``Trial._trial_id``, ``FrozenTrial._trial_id``): the owner
  marks of ``workflows/sweeps/sweep_owners.py`` are written by it, and ``Trial(study, trial_id)``
  takes over a trial; only ``number`` is public, which is the trial's place in its study.
- ``Study._storage``: the storage the study wraps (a cache in front of an RDB storage), where
  those marks are written and read back.
- ``Study._thread_local.in_optimize_loop``: ``Study.stop()``, which a sampler calls from
  ``after_trial`` (``GridSampler``), raises outside ``optimize``; the sweep tells its trials
  outside it.
"""

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import optuna
from optuna.study import Study
from optuna.study.study import _ThreadLocalStudyAttribute
from optuna.trial import FrozenTrial, Trial

from workers.compat import constructor_sets

if TYPE_CHECKING:
    from optuna.storages import BaseStorage

RUN_WITH = "optuna 4.2.0 and 5.0.0 have it"


def _missing(name: str) -> ImportError:
    return ImportError(f"dask-train needs {name} ({RUN_WITH}; this is optuna {optuna.__version__})")


def _sets(function: Callable[..., Any], attribute: str, name: str) -> None:
    if not constructor_sets(function, attribute):
        raise _missing(name)


_sets(Trial.__init__, "_trial_id", "Trial._trial_id")
_sets(FrozenTrial.__init__, "_trial_id", "FrozenTrial._trial_id")
_sets(Study.__init__, "_storage", "Study._storage")
_sets(Study.__init__, "_thread_local", "Study._thread_local")
if not hasattr(_ThreadLocalStudyAttribute, "in_optimize_loop"):
    raise _missing("Study._thread_local.in_optimize_loop")


def trial_id(trial: Trial | FrozenTrial) -> int:
    """The trial's id in its storage."""
    return trial._trial_id


def study_storage(study: Study) -> "BaseStorage":
    """The storage ``study`` reads and writes through."""
    return study._storage


def thread_local(study: Study) -> Any:
    """``study``'s per-thread state: ``in_optimize_loop`` lets ``study.stop()`` through."""
    return study._thread_local
