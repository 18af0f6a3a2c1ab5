"""Every private API of a library that dask-train relies on, one module per library.

A user installs dask-train into the environment their cluster already runs, with whatever
torch, distributed and Python it has; a private name may be gone there. Each module here names
what it needs of one library and checks at import that it is there: where it is not, the
import fails with one line naming the library, the thing missing and the version found, not
with an ``AttributeError`` deep in a job. No other module of ``workers/`` or ``workflows/``
touches these libraries' private names (``tests/test_compat.py`` holds both to it).

- :mod:`workers.compat.torch_private`: torch (DTensor's caches, DCP's pickled classes, ...)
- :mod:`workers.compat.distributed_private`: distributed (the worker's running tasks, the
  scheduler's adaptive target, ...); client-side uses too, since ``workflows/`` may import
  ``workers/`` but never the reverse
- :mod:`workers.compat.cpython_private`: the standard library (the fork server, the
  pure-Python unpickler)

Optuna, used by sweeps on the client only, has its own in ``workflows/compat/``.
"""

from collections.abc import Callable
from typing import Any


def constructor_sets(function: Callable[..., Any], attribute: str) -> bool:
    """Whether ``function``'s code names ``attribute``: how an attribute that an object gets in
    its constructor is checked before any object exists."""
    return attribute in getattr(getattr(function, "__code__", None), "co_names", ())
