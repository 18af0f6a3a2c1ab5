"""When a failed attempt is worth another: the retry decision, in one small object.

A lost, killed or hung worker, a group that did not form, a collective that timed out or lost
its peer: another attempt from the last checkpoint will likely succeed. An exception raised by
the training code itself (a ``ValueError``, an assertion, a shape error that torch raises as
``RuntimeError``) would only fail again, so it reaches the caller at once.

Errors are told apart by type, never by their message. One type says nothing alone: gloo
raises a plain ``RuntimeError`` when a peer's process is gone ("Connection closed by peer"),
and so does torch for a shape the code got wrong; a launched script that exits non-zero may
have raised either. Such an error is :data:`Cause.UNSURE`, and
the launcher decides it by evidence, not by words: whether every worker of the job still
answers (``workflows/jobs/launcher.py``, ``RankLauncher._root_cause``).
"""

import enum
from dataclasses import dataclass

# Exception types (matched by name: the client need not import what raised them) that only
# ever mean the infrastructure failed.
_INFRASTRUCTURE_TYPES = frozenset(
    {
        "KilledWorker",
        "CommClosedError",
        "MembershipLost",
        "RankStopped",
        "RendezvousTimeout",
        "DistError",
        "DistBackendError",
        "DistNetworkError",
        "DistStoreError",
        "TimeoutError",
        "ConnectionError",
        "ConnectionResetError",
        "ConnectionRefusedError",
        "BrokenPipeError",
        "CancelledError",
    }
)


# Exception types that say nothing of their cause alone, besides a plain RuntimeError: a
# script's non-zero exit (``dask-train launch``) is its own error or its peer's loss (gloo's
# error inside it); seen in CI, the survivor's script exited before the scheduler saw the lost
# worker, and the elastic job failed instead of going on without it.
_UNSURE_TYPES = frozenset({"ScriptFailed"})


class Cause(enum.Enum):
    """Who is to blame for an exception a rank raised, as far as its type tells."""

    INFRASTRUCTURE = "infrastructure"  # the cluster or the process group, whatever the code
    CODE = "code"  # the training code: another attempt would fail the same way
    UNSURE = "unsure"  # a lost peer (gloo) or the code (torch's checks, a script's exit)


def cause_of(error: BaseException | None) -> Cause:
    """What ``error``, raised inside a rank, says of its cause by its type alone (None: the
    rank's task ended without one, which only the infrastructure does)."""
    if error is None:
        return Cause.INFRASTRUCTURE
    names = {cls.__name__ for cls in type(error).__mro__}
    if names & _INFRASTRUCTURE_TYPES:
        return Cause.INFRASTRUCTURE
    # RuntimeError's other subclasses (NotImplementedError...) are the code's.
    if type(error) is RuntimeError or names & _UNSURE_TYPES:
        return Cause.UNSURE
    return Cause.CODE


class Decision(enum.Enum):
    RETRY = "retry"
    RAISE = "raise"


@dataclass(frozen=True)
class FailurePolicy:
    """Retry infrastructure failures up to ``max_failures`` times; code errors only with
    ``retry_code_errors`` (torchrun's contract for scripts: any failure restarts them)."""

    max_failures: int
    retry_code_errors: bool = False

    def decide(self, *, infrastructure: bool, failures_so_far: int) -> Decision:
        if not infrastructure and not self.retry_code_errors:
            return Decision.RAISE
        return Decision.RETRY if failures_so_far < self.max_failures else Decision.RAISE
