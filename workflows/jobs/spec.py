"""A job's identity, minted once on the client: its id, and every name made from it.

The event and heartbeat topics, the process-group plugin and the rank tasks are all named after
the job's id; they are read from here, never spelled again elsewhere.
"""

import uuid
from dataclasses import dataclass

from workers.process_group import plugin_name
from workflows.observe.monitoring import EVENT_PREFIX, HEARTBEAT_PREFIX


@dataclass(frozen=True)
class JobSpec:
    """Who a job is: ``name`` as the user gave it, ``job_id`` = ``<prefix><name>-<8 hex>``.

    Attributes:
        name: The job's name (``launch(name=...)``, ``[run] name``).
        job_id: Its label on ``/metrics``, the Training page and the scheduler's queue.
    """

    name: str
    job_id: str

    @classmethod
    def mint(cls, name: str, *, prefix: str = "", token: str | None = None) -> "JobSpec":
        """A new job named ``name``: its id ends in 8 hex digits of ``token`` (random by
        default); ``prefix`` tells kinds of jobs apart (``"predict-"``)."""
        if not name:
            raise ValueError("a job needs a name")
        token = (token or uuid.uuid4().hex)[:8]
        return cls(name=name, job_id=f"{prefix}{name}-{token}")

    @property
    def event_topic(self) -> str:
        """The Dask event topic of the job's records (reports, epochs, resizes)."""
        return EVENT_PREFIX + self.job_id

    @property
    def heartbeat_topic(self) -> str:
        """The Dask event topic of its ranks' heartbeats."""
        return HEARTBEAT_PREFIX + self.job_id

    @property
    def plugin_name(self) -> str:
        """The name its process-group plugin is registered under on the workers."""
        return plugin_name(self.job_id)
