"""The ``[launch]`` section: how many ranks, on which workers, with which backend, and how
long each wait may last (``workflows/jobs/launcher.py`` forms the group;
``workflows/jobs/admission.py`` queues for the workers ``[launch.workers]`` selects)."""

import contextlib
import fnmatch
import ipaddress
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class WorkerSelection(BaseModel):
    """Which of an existing cluster's workers may take ranks (all of them by default): the
    ``[launch.workers]`` section."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    resources: dict[str, float] = Field(
        default_factory=dict,
        description="only workers offering at least these (dask worker --resources 'GPU=1')",
    )
    name_pattern: str | None = Field(
        default=None, description="only workers whose name matches this glob ('gpu-node-*')"
    )

    @field_validator("resources")
    @classmethod
    def _positive(cls, resources: dict[str, float]) -> dict[str, float]:
        for name, amount in resources.items():
            if amount <= 0:
                raise ValueError(
                    f"launch.workers.resources.{name}: {amount:g} selects every worker; give a "
                    "positive amount or leave the resource out"
                )
        return resources

    @field_validator("name_pattern")
    @classmethod
    def _not_empty(cls, pattern: str | None) -> str | None:
        if pattern is not None and not pattern.strip():
            raise ValueError("launch.workers.name_pattern: empty; leave it out to take every name")
        return pattern

    def matches(self, identity: dict[str, Any]) -> bool:
        """Whether a worker, as the scheduler describes it, is eligible."""
        offered = identity.get("resources") or {}
        if any(offered.get(name, 0) < amount for name, amount in self.resources.items()):
            return False
        return self.name_pattern is None or fnmatch.fnmatchcase(
            str(identity.get("name")), self.name_pattern
        )

    def describe(self) -> str:
        parts = [f"resources {self.resources}"] if self.resources else []
        if self.name_pattern is not None:
            parts.append(f"name matching {self.name_pattern!r}")
        return " and ".join(parts) or "any"


class LaunchConfig(BaseModel):
    """How many ranks, which backend, and how long each wait may last: the ``[launch]``
    section."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    world_size: int | tuple[int, int] | None = Field(
        default=None,
        description="ranks: an int, or 'min:max' for an elastic job that starts on min free "
        "workers, grows up to max as workers join or are freed and shrinks (down to min) when "
        "they leave, at a step boundary; none: every chosen worker",
    )
    elastic_batch: Literal["global", "per_rank"] = Field(
        default="global",
        description="what an elastic job keeps as its world changes (the built-in trainer): "
        "'global' keeps training.batch_size and the learning rate, each rank's share "
        "following the world; 'per_rank' keeps each rank's batch, training.batch_size / "
        "the range's min rows, so the global batch grows and shrinks with the world",
    )
    priority: int = Field(
        default=0,
        description="a queued job of higher priority is served first, and may shrink running "
        "elastic jobs of lower priority down to their minimum (never a fixed-size job)",
    )
    leave_timeout_s: float = Field(
        default=60.0,
        gt=0,
        description="an elastic job's worker that leaves gracefully (retired, scaled down, "
        "SIGTERM) keeps its rank this long for the job to reach a step boundary and hand it "
        "off; then it is stopped, and the job recovers as from a lost worker",
    )
    workers: WorkerSelection = WorkerSelection()
    master_addr: str | None = Field(
        default=None,
        description="rendezvous address of the rank-0 worker's host for hosts with several "
        "interfaces; none: its address on socket_ifname, else its Dask contact address",
    )
    socket_ifname: str | None = Field(
        default=None,
        description="network interface for gloo/nccl traffic (GLOO_SOCKET_IFNAME, "
        "NCCL_SOCKET_IFNAME) on every rank; none: the backend's own choice",
    )
    backend: Literal["auto", "gloo", "nccl"] = Field(
        default="auto", description="auto: nccl when every rank has a GPU, else gloo"
    )
    worker_wait_s: float = Field(
        default=30.0,
        gt=0,
        description="wait for the cluster to have enough eligible workers (starting, adapting), "
        "and after a lost worker for a replacement",
    )
    queue_timeout_s: float = Field(
        default=3600.0,
        gt=0,
        description="on a shared cluster, how long the job may wait in the queue for other "
        "jobs to free its workers",
    )
    lease_s: float = Field(
        default=20.0,
        gt=0,
        description="the job's hold on its workers lasts this long without news from its "
        "client: a frozen client's workers go back to the queue after it",
    )
    init_timeout_s: float = Field(default=60.0, gt=0, description="rendezvous of all ranks")
    collective_timeout_s: float = Field(
        default=600.0, gt=0, description="a collective that waits longer fails the job"
    )
    poll_interval_s: float = Field(default=0.5, gt=0, description="how often to check liveness")
    settle_s: float = Field(
        default=2.0,
        ge=0,
        description="after a communication error, how long to look for its cause (another "
        "rank's exception, a lost worker) before retrying",
    )
    hang_timeout_s: float = Field(
        default=300.0, gt=0, description="a rank silent this long after its first step hangs"
    )
    first_step_timeout_s: float = Field(
        default=900.0, gt=0, description="the bound before a rank's first step (loading, warm-up)"
    )
    max_failures: int = Field(
        default=3, ge=0, description="restarts after a failure before the run fails"
    )
    recovery: Literal["replica", "checkpoint"] = Field(
        default="replica",
        description="after a lost worker, continue from what a surviving data-parallel "
        "replica holds in memory (no steps redone; the checkpoint when no replica's state is "
        "as new), or always from the newest checkpoint",
    )
    release_timeout_s: float = Field(
        default=15.0,
        gt=0,
        description="after a failure, how long ranks may take to let go of the group before "
        "their workers are restarted; when the job is stopped for good (Ctrl-C, its stop), how "
        "long a rank writing a checkpoint may take to finish it (others get 3 s)",
    )
    paused_worker_timeout_s: float = Field(
        default=10.0,
        gt=0,
        description="how long a rank may wait to start on a worker that Dask has paused (its "
        "memory past distributed.worker.memory.pause) before the job fails naming the worker",
    )

    @field_validator("world_size", mode="before")
    @classmethod
    def _a_size_or_range(cls, value: Any) -> Any:
        return parse_world_size(value)

    @property
    def world_range(self) -> tuple[int, int] | None:
        """``(min, max)`` ranks: equal for a fixed size; None: every chosen worker."""
        if self.world_size is None:
            return None
        if isinstance(self.world_size, tuple):
            return self.world_size
        return self.world_size, self.world_size

    @property
    def elastic(self) -> bool:
        """Whether the job's world may change while it runs (``world_size = "min:max"``)."""
        return isinstance(self.world_size, tuple)

    @field_validator("master_addr")
    @classmethod
    def _a_host(cls, value: str | None) -> str | None:
        if value is None:
            return None
        host = value.strip().removeprefix("[").removesuffix("]")
        if "://" in host or not host or any(c.isspace() for c in host):
            raise ValueError(
                f"launch.master_addr: {value!r} is not a host; give an IP address or host name "
                "without scheme or port (e.g. '10.0.0.5')"
            )
        with contextlib.suppress(ValueError):
            return str(ipaddress.ip_address(host))
        if ":" in host or not re.fullmatch(r"[A-Za-z0-9.-]+", host):
            raise ValueError(
                f"launch.master_addr: {value!r} is not a host; give an IP address or host name "
                "without scheme or port (e.g. '10.0.0.5')"
            )
        return host

    @field_validator("socket_ifname")
    @classmethod
    def _an_interface(cls, value: str | None) -> str | None:
        # gloo takes a comma-separated list (one device per interface, the same count on every
        # rank); Linux names are at most 15 characters.
        if value is not None and not re.fullmatch(
            r"[A-Za-z0-9_.:@-]{1,15}(,[A-Za-z0-9_.:@-]{1,15})*", value
        ):
            raise ValueError(
                f"launch.socket_ifname: {value!r} is not a network interface name (like 'eth0' "
                "or 'ib0'; several comma-separated)"
            )
        return value


def parse_world_size(value: Any) -> int | tuple[int, int] | None:
    """``launch.world_size`` as given (an int, ``"min:max"``, ``(min, max)``) as an int or a
    ``(min, max)`` pair, min < max; a ValueError naming the field for anything else."""
    if value is None:
        return None
    pair: list[Any]
    if isinstance(value, str):
        pair = [part.strip() for part in value.split(":")]
        if len(pair) == 1:
            pair = pair * 2
    elif isinstance(value, list | tuple):
        pair = list(value)
    else:
        pair = [value, value]
    try:
        if len(pair) != 2 or any(isinstance(p, bool | float) for p in pair):
            raise ValueError
        low, high = (int(p) for p in pair)
    except (TypeError, ValueError):
        raise ValueError(
            f"launch.world_size: {value!r} is neither a number of ranks nor a range "
            "'min:max' (e.g. 4, or '2:8' for an elastic job)"
        ) from None
    if low < 1:
        raise ValueError(f"launch.world_size: {value!r}; a job needs at least 1 rank")
    if low > high:
        raise ValueError(
            f"launch.world_size: {value!r}; min ({low}) is above max ({high}), write 'min:max'"
        )
    return low if low == high else (low, high)
