"""The ``[cluster]`` section: which cluster to run on, or how to start one
(``workflows/cluster/training_cluster.py`` starts or joins it)."""

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from workers.spec.security import SecurityConfig


class ClusterConfig(BaseModel):
    """Which cluster to run on, or how to start one: the ``[cluster]`` section.

    Attributes:
        dashboard_host: the address a local cluster's dashboard listens on (loopback: reach
            it through an ssh tunnel)
        connect_timeout_s: how long to try to reach an existing scheduler, in seconds
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    scheduler: str | None = Field(
        default=None, description="address of an existing scheduler; none starts a local cluster"
    )
    scheduler_file: str | None = Field(
        default=None,
        description="an existing scheduler's file (dask scheduler --scheduler-file), read at start",
    )
    kind: Literal["auto", "cuda", "cpu"] = Field(
        default="auto", description="auto: one worker per GPU when NVML sees GPUs, else CPU"
    )
    n_workers: int | None = Field(
        default=None, ge=1, description="local workers (default: one per GPU, or 2 on CPU)"
    )
    memory_limit: str | float | int = Field(default="auto", description="per local worker")
    dashboard_host: str = "127.0.0.1"
    dashboard_port: int = Field(default=8787, ge=0, le=65535, description="0: any free port")
    connect_timeout_s: float = Field(default=30.0, gt=0)
    fork_workers: bool = Field(
        default=True,
        description="start local workers from a fork server that has imported torch: a lost "
        "worker is back in about 0.15 s instead of 4-5 s",
    )
    start_timeout_s: float = Field(
        default=60.0, gt=0, description="a local cluster's start, its workers included"
    )
    tune_malloc: bool = Field(
        default=True, description="keep freed memory in local workers for reuse (faster on CPU)"
    )
    security: SecurityConfig = SecurityConfig()

    @model_validator(mode="after")
    def _local_or_remote(self) -> "ClusterConfig":
        if self.scheduler is not None and self.scheduler_file is not None:
            raise ValueError(
                "cluster.scheduler_file: give the scheduler's address or its file, not both"
            )
        existing = self.scheduler is not None or self.scheduler_file is not None
        if existing and self.n_workers is not None:
            raise ValueError(
                "cluster.n_workers: cannot size an existing cluster; drop n_workers or scheduler"
            )
        if existing and self.security.temporary:
            raise ValueError(
                "cluster.security.temporary: a temporary certificate set exists only in this "
                "process, so an existing cluster cannot share it; give tls_ca_file, tls_cert "
                "and tls_key"
            )
        plain = (self.scheduler or "").startswith("tcp://")
        if plain and self.security.enabled and self.security.require_encryption:
            raise ValueError(
                f"cluster.scheduler: {self.scheduler} is plain tcp://, but cluster.security "
                "requires TLS; use the scheduler's tls:// address"
            )
        return self

    @property
    def existing(self) -> bool:
        """Connect to a cluster started elsewhere rather than start one here."""
        return self.scheduler is not None or self.scheduler_file is not None
