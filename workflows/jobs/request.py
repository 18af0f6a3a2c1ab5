"""What one job asks for, made once on the client: the function every rank runs, the launch's
settings, and where its checkpoints go.

``launch``, ``train`` and ``dask-train launch`` each make one `JobRequest`; ``launch_on`` and
the job's controller read it, and each generation's `workers.rank_context.RankJob` is made from
it. The job's identity (its id and topics) is `workflows.jobs.spec.JobSpec`, minted when the job
takes its place in the queue.
"""

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from workers.collection_shard import CollectionPlan
from workers.rank_context import RankJob
from workers.spec.launch import LaunchConfig
from workflows.jobs.spec import JobSpec


@dataclass(frozen=True)
class JobRequest:
    """One job's request.

    Attributes:
        fn: The rank function, called as ``fn(ctx, *args, **kwargs)``.
        settings: The launch's settings (``[launch]``), its world size resolved or a range.
        name: The job's name (task keys, the Training page).
        checkpoint_dir: Where ``ctx.save`` writes: an absolute folder or a URL (a relative
            folder given is made absolute here: the workers may run elsewhere).
        keep_checkpoints: The newest checkpoints kept.
        storage_options: ``checkpoint_dir``'s fsspec options.
        run_id: Whose checkpoints in ``checkpoint_dir`` the job resumes from, writes and
            deletes (its manifests name it); default the job's ``name``.
        signing_key_file: The key checkpoints are signed and checked with.
        task_prefix: The rank tasks are ``<task_prefix>-<name>-<rank>-<generation>``.
        retry_code_errors: Whether an exception of ``fn`` itself is retried (a script's,
            under torchrun's contract) or raised at once.
        step_boundaries: Whether ``fn`` passes step boundaries (``ctx.step_done``), where an
            elastic job resizes; scripts have none and restart instead, as under torchrun.
        final_records: Picks, from the ranks' return values, records that ``on_event`` must
            receive even if their events were still in flight (the built-in trainer's epochs).
        called_at: When the job was asked for (epoch seconds): its ``wall_s`` counts from here.
    """

    fn: Callable[..., Any]
    settings: LaunchConfig
    name: str
    args: tuple[Any, ...] = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    checkpoint_dir: str | Path | None = None
    keep_checkpoints: int = 3
    storage_options: Mapping[str, Any] = field(default_factory=dict)
    run_id: str | None = None
    signing_key_file: str | None = None
    task_prefix: str = "launch"
    retry_code_errors: bool = False
    step_boundaries: bool = True
    final_records: Callable[[list[Any]], list[dict[str, Any]]] | None = None
    called_at: float = field(default_factory=time.time)

    def __post_init__(self) -> None:
        if not callable(self.fn):
            raise TypeError(f"launch: fn must be callable, got {type(self.fn).__name__}")
        if self.keep_checkpoints < 1:
            raise ValueError(f"keep_checkpoints: {self.keep_checkpoints}; keep at least 1")
        # Workers may run elsewhere: they get the checkpoint folder as an absolute path (a URL
        # as it is: storage_options are its filesystem's).
        directory = None if self.checkpoint_dir is None else str(self.checkpoint_dir)
        if directory is not None and "://" not in directory:
            directory = str(Path(directory).absolute())
        object.__setattr__(self, "checkpoint_dir", directory)
        object.__setattr__(self, "run_id", self.run_id or self.name)
        object.__setattr__(self, "storage_options", dict(self.storage_options or {}))

    def rank_job(self, spec: JobSpec, data: CollectionPlan | None) -> RankJob:
        """What every rank of the job ``spec`` receives; the controller fills in each
        generation's fields. ``data``: the job's Dask collections, placed on its workers."""
        return RankJob(
            fn=self.fn,
            args=self.args,
            kwargs=dict(self.kwargs),
            name=self.name,
            generation="",  # each generation's, filled in by the controller
            attempt=0,
            max_failures=self.settings.max_failures,
            event_topic=spec.event_topic,
            heartbeat_topic=spec.heartbeat_topic,
            checkpoint_dir=self.checkpoint_dir,  # a str: made one on init
            run_id=self.run_id or self.name,
            keep_checkpoints=self.keep_checkpoints,
            signing_key_file=self.signing_key_file,
            storage_options=dict(self.storage_options),
            data=data,
            job_id=spec.job_id,
            release_timeout_s=self.settings.release_timeout_s,
        )


__all__ = ["JobRequest"]
