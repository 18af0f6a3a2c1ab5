"""When a failed attempt is worth another: the retry decision, in one small object.

A lost, killed or hung worker, a group that did not form, a collective that timed out or lost
its peer: another attempt from the last checkpoint will likely succeed. An exception raised by
the training code itself (a ``ValueError``, an assertion, a shape error that torch raises as
``RuntimeError``) would only fail again, so it reaches the caller at once.
"""

import enum
import re
from dataclasses import dataclass

# What torch's backends and stores say when a peer is gone or a collective waited too long;
# they raise plain RuntimeErrors (gloo: "Connection closed by peer").
_COMMUNICATION = re.compile(
    r"connection (closed|reset|refused)|broken pipe|peer|timed? ?out|socket|"
    r"gloo/transport|nccl|process ?group|TCPStore|DistBackendError|DistNetworkError|"
    r"DistStoreError|watchdog|abort",
    re.IGNORECASE,
)
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


def is_infrastructure_error(error: BaseException) -> bool:
    """Whether ``error``, raised inside a rank, came from the cluster or the process group
    rather than from the training code."""
    names = {cls.__name__ for cls in type(error).__mro__}
    if names & _INFRASTRUCTURE_TYPES:
        return True
    if type(error) is RuntimeError:  # subclasses (NotImplementedError...) are code errors
        return bool(_COMMUNICATION.search(str(error)))
    return False


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
