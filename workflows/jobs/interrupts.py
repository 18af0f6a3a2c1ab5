"""A Ctrl-C that Python dropped is delivered again.

Python raises KeyboardInterrupt at whatever the main thread executes when SIGINT arrives. Inside
a finalizer (a ``__del__``, a coroutine that the garbage collector closes: Dask and tornado leave
many) it reports the exception as "Exception ignored" through ``sys.unraisablehook`` and drops
it, and a run would go on as if nothing happened. While a :class:`DroppedInterrupts` is
installed, such an interrupt is raised again in the main thread once it has left the
finalizer. The CLI installs one for the whole run; ``launch`` and ``train`` hold one while they
wait for their ranks, so that Ctrl-C in a script or a notebook is never lost either.
"""

import _thread
import signal
import sys
import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any

# Long enough for the main thread to leave the finalizer and the hook, both of which drop what
# is raised in them; should it land in another finalizer, the hook sees it again.
REDELIVERY_DELAY_S = 0.1


class DroppedInterrupts:
    """Installs a ``sys.unraisablehook`` that raises a dropped KeyboardInterrupt again in the
    main thread (when ``only_if()`` holds); every other unraisable goes to the hook before."""

    def __init__(self, *, only_if: Callable[[], bool] = lambda: True) -> None:
        self.only_if = only_if
        self._previous: Callable[[Any], object] | None = None

    def install(self) -> None:
        self._previous = sys.unraisablehook
        sys.unraisablehook = self._hook

    def uninstall(self) -> None:
        if self._previous is not None and sys.unraisablehook == self._hook:
            sys.unraisablehook = self._previous
        self._previous = None

    def __enter__(self) -> "DroppedInterrupts":
        # interrupt_main reaches the main thread only: elsewhere there is nothing to redeliver.
        if threading.current_thread() is threading.main_thread():
            self.install()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.uninstall()

    def _hook(self, unraisable: Any) -> None:
        if issubclass(unraisable.exc_type, KeyboardInterrupt) and self.only_if():
            threading.Thread(target=_redeliver, name="dask-train-interrupt", daemon=True).start()
            return
        assert self._previous is not None
        self._previous(unraisable)


def _redeliver() -> None:
    time.sleep(REDELIVERY_DELAY_S)
    _thread.interrupt_main(signal.SIGINT)
