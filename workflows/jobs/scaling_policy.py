"""Whether a job's world changes while it runs, and why: the job's controller asks its scaling
policy, given to it by the job's caller (as Ray Train v2's controller is given its own).

A fixed job (``launch.world_size = N``, or every worker) keeps the workers it formed on: a lost
one is a failure, and the next attempt waits for a replacement. An elastic job
(``launch.world_size = "min:max"``) resizes between its bounds: it grows into workers that join
or are freed, gives workers back to a queued job or to a graceful close, and goes on without a
lost worker (`workflows.jobs.controller`).
"""

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, ClassVar

from workflows.jobs.admission import Request


@dataclass(frozen=True)
class FixedScalingPolicy:
    """A fixed world: never resized while it runs."""

    elastic: ClassVar[bool] = False

    def resize_cause(
        self, status: dict[str, Any], workers: Collection[str], newcomers: Collection[str]
    ) -> str | None:
        """Why the queue's view of the job (``status``, as `workflows.jobs.admission.WorkerQueue`
        reports it) calls for a resize of its world of ``workers`` now, if it does;
        ``newcomers``: workers granted to the job and not in its world yet."""
        return None


@dataclass(frozen=True)
class ElasticScalingPolicy(FixedScalingPolicy):
    """A world between the job's bounds, resized at step boundaries: up to ``maximum``
    workers."""

    maximum: int
    elastic: ClassVar[bool] = True

    def resize_cause(
        self, status: dict[str, Any], workers: Collection[str], newcomers: Collection[str]
    ) -> str | None:
        """``retired`` (a worker of the job closes gracefully), ``yielded`` (a queued job needs
        some back), ``joined`` (workers joined or were freed, and the job has room), or None."""
        mine = set(workers)
        if mine & (set(status["retired"]) | set(status["retiring"])):
            return "retired"
        if mine & set(status["yielding"]):
            return "yielded"
        if newcomers and len(mine) < self.maximum:
            return "joined"
        return None


ScalingPolicy = FixedScalingPolicy | ElasticScalingPolicy


def scaling_policy(request: Request) -> ScalingPolicy:
    """The policy of a job whose request to the queue is ``request``: its bounds are the
    world size as the request decided it."""
    if request.elastic:
        return ElasticScalingPolicy(maximum=request.maximum)
    return FixedScalingPolicy()


__all__ = ["ElasticScalingPolicy", "FixedScalingPolicy", "ScalingPolicy", "scaling_policy"]
