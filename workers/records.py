"""The records a job sends as Dask events: one pydantic model per kind, told apart by ``kind``.

The ranks and the client both build and read them, so this module imports only the standard
library and pydantic. A record travels as plain data (Dask events are msgpack'd): the model's
``to_event()``, a dict that begins with ``"kind"``. It is read back with :func:`parse_record`,
which refuses, with :class:`MalformedRecord`, a dict that matches no model.

| kind                | sent by                                                   | topic     |
| ------------------- | --------------------------------------------------------- | --------- |
| `start`             | a rank: the built-in trainer (`workers/train.py`)         | job       |
| `step`              | a rank: the built-in trainer, every `log_every_steps`     | job       |
| `epoch`             | a rank: the built-in trainer, at each epoch's end         | job       |
| `checkpoint_failed` | rank 0: `workers/checkpoint.py`                           | job       |
| `report`            | any rank: `ctx.report` (`workers/rank_context.py`)        | job       |
| `output`            | every rank: a script's lines (`workers/script_runner.py`) | job       |
| `heartbeat`         | every rank: `workers/rank_context.py`                     | heartbeat |
| `queued`            | the client: `workflows/jobs/launch.py`                    | job       |
| `admitted`          | the client: `workflows/jobs/controller.py`                | job       |
| `world`             | the client: `workflows/jobs/controller.py`                | job       |
| `resized`           | the client: `workflows/jobs/controller.py`                | job       |
| `resumed`           | the client: `workflows/jobs/controller.py`                | job       |
| `recovery`          | the client: `workflows/jobs/controller.py`                | job       |
| `trial`             | the client: `workflows/sweeps/sweep.py`                   | sweep     |

The built-in trainer's records come from one rank, the job's reporting rank. The topic is each
model's ``TOPIC``: the kind of Dask event topic it travels on (the job's records, its ranks'
heartbeats, a sweep's trials; ``workflows/observe/monitoring.py`` names them). The job's records
reach ``on_event`` as the dicts that travelled.

A new kind of record is one model here, added to ``Record``; its emitter sends
``TheModel(...).to_event()`` and its consumers match on the model's class.
"""

from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

Topic = Literal["job", "heartbeat", "sweep"]


class MalformedRecord(ValueError):
    """A Dask event that is no record of any kind here (or one whose fields are wrong)."""


class BaseRecord(BaseModel):
    """What every record is: frozen, and nothing beyond its kind's fields (a misspelt field
    is refused where the record is made, not lost where it is read)."""

    # populate_by_name: "from" is a Python keyword; the model says ``before``, the wire "from".
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)
    TOPIC: ClassVar[Topic] = "job"
    kind: str

    def to_event(self) -> dict[str, Any]:
        """The record as it travels: plain data, ``kind`` first, and only the fields its
        sender set (an epoch of a regression carries no ``accuracy``, not ``None``)."""
        fields = self.model_dump(by_alias=True, exclude_unset=True)
        return {"kind": self.kind} | fields


# -- sent by a rank -------------------------------------------------------------------------------


class RankRecord(BaseRecord):
    """A record a rank sends: Dask adds the address of the worker that sent it on the way."""

    worker: str | None = None


class StartRecord(RankRecord):
    """The built-in trainer's start: what the job trains, on how many ranks, for how long."""

    kind: Literal["start"] = "start"
    strategy: str
    world_size: int
    epochs: int
    total_steps: int


class StepRecord(RankRecord):
    """The built-in trainer's loss every ``training.log_every_steps`` steps."""

    kind: Literal["step"] = "step"
    epoch: int  # counted from 1, as the epoch records count
    step: int
    loss: float  # the reporting rank's, of its share of the step's batch
    # Set where the reporting rank's record was lost with its worker and a surviving rank's
    # record of the step, its own loss, was sent in its place (workers/train.py RecentSteps).
    reported_by_rank: int | None = None


class EpochRecord(RankRecord):
    """One epoch's figures (the built-in trainer's; also each entry of
    ``TrainResult.history``): the task's training figures (``workers/losses.py``: accuracy for
    classification, mse, mae and r2 for regression), the same on the validation split, the
    job's samples/s and the learning rate."""

    kind: Literal["epoch"] = "epoch"
    epoch: int
    epochs: int
    step: int
    loss: float
    accuracy: float | None = None
    mse: float | None = None
    mae: float | None = None
    r2: float | None = None
    val_loss: float | None = None
    val_accuracy: float | None = None
    val_mse: float | None = None
    val_mae: float | None = None
    val_r2: float | None = None
    samples_per_s: float
    lr: float


class CheckpointFailedRecord(RankRecord):
    """A checkpoint not written (the previous one stays the newest), from rank 0."""

    kind: Literal["checkpoint_failed"] = "checkpoint_failed"
    step: int
    error: str


class NumberedRecord(RankRecord):
    """A record every rank numbers on its own (``seq``), per attempt: the client tells a
    record that arrived twice (as an event and in the rank's result) by these."""

    rank: int
    attempt: int
    seq: int


class ReportRecord(NumberedRecord):
    """``ctx.report(**metrics)``: whatever the rank function measured, by the names it chose,
    beside where and when it was sent."""

    # The metrics' names are the user's: they travel as fields of their own, as documented.
    model_config = ConfigDict(extra="allow")
    kind: Literal["report"] = "report"
    time: float  # wall clock on the rank

    @property
    def metrics(self) -> dict[str, Any]:
        """What the rank reported (a ``step`` among them too), without the bookkeeping."""
        return dict(self.model_extra or {})


# The fields of a report that say where it came from, not what was measured.
REPORT_BOOKKEEPING = frozenset(ReportRecord.model_fields)


class OutputRecord(NumberedRecord):
    """Lines a script (``dask-train launch script.py``) printed, batched per rank."""

    kind: Literal["output"] = "output"
    lines: list[str]


class HeartbeatRecord(RankRecord):
    """A rank makes progress: its count of beats, samples/s and peak memory so far; the first
    one after its generation's first step also says when that step ended."""

    TOPIC: ClassVar[Topic] = "heartbeat"
    kind: Literal["heartbeat"] = "heartbeat"
    rank: int
    step: int  # the rank's beats so far, not an optimizer step
    samples_per_s: float | None = None
    peak_memory_bytes: int | None = None
    first_step_at: float | None = None


# -- sent by the client -------------------------------------------------------------------------


class QueueHolder(BaseModel):
    """A job holding workers that a queued job waits for."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    job_id: str
    name: str
    workers: int
    since: float | None  # when it was granted them (epoch seconds)


class QueuedRecord(BaseRecord):
    """The job waits in the scheduler's queue for workers (sent once, when it first waits)."""

    kind: Literal["queued"] = "queued"
    job_id: str
    position: int  # waiting jobs ahead of it
    eligible: int  # workers it may run on
    holders: list[QueueHolder]


class AdmittedRecord(BaseRecord):
    """A job that waited got its workers."""

    kind: Literal["admitted"] = "admitted"
    job_id: str
    waited_s: float


class WorldRecord(BaseRecord):
    """The job's first process group formed, on this many ranks."""

    kind: Literal["world"] = "world"
    job_id: str
    world_size: int
    at: float | None = None  # when (epoch seconds); its arrival's time if not given


class ResizedRecord(BaseRecord):
    """An elastic job's world changed (docs/guides/elastic.md#records)."""

    kind: Literal["resized"] = "resized"
    job_id: str | None = None  # on the event; LaunchResult.resizes' entries go without
    before: int = Field(alias="from")
    after: int = Field(alias="to")
    step: int  # the step the new world continues from
    cause: str  # joined, yielded, retired or lost
    pause_s: float | None  # from the last step before to the first step after
    redone_steps: int | None  # steps finished before that the new world trains again
    at: float  # when it was detected (epoch seconds)
    # The pause's share spent broadcasting the state from a live rank in the new group (the
    # least of the ranks' times in it: the last rank to arrive's); None: no live rank's state
    # was broadcast (continued from a checkpoint), or not known.
    broadcast_s: float | None = None


class ResumedRecord(BaseRecord):
    """The job's first attempt continues from a checkpoint an earlier run left."""

    kind: Literal["resumed"] = "resumed"
    job_id: str
    step: int
    checkpoint: str  # its folder, or URL

    def line(self) -> str:
        """What ``run``, ``launch`` and ``train`` print for it."""
        return f"resuming from step {self.step} at {self.checkpoint}"


class RecoveryRecord(BaseRecord):
    """A restart after a failure: what failed, what the next attempt continued from, and the
    seconds lost (each entry of ``LaunchResult.recoveries`` without ``kind`` and count)."""

    kind: Literal["recovery"] = "recovery"
    recoveries: int  # restarts so far, this one included
    failure: str
    detected_at: str  # ISO 8601, UTC
    detected_at_s: float
    recovered_from: Literal["replica", "checkpoint", "start"]
    resumed_from_step: int
    redo_s: float
    restart_s: float | None
    seconds_lost: float


class TrialRecord(BaseRecord):
    """A sweep's trial changed state (started, finished, pruned, failed)."""

    TOPIC: ClassVar[Topic] = "sweep"
    kind: Literal["trial"] = "trial"
    sweep: str
    number: int
    state: str
    value: float | None
    params: dict[str, Any]
    job_id: str
    wall_s: float
    error: str | None = None  # on_trial's copy of a failed trial; the event goes without


Record = Annotated[
    Union[  # noqa: UP007 (a discriminated union is spelled with Union)
        StartRecord,
        StepRecord,
        EpochRecord,
        CheckpointFailedRecord,
        ReportRecord,
        OutputRecord,
        HeartbeatRecord,
        QueuedRecord,
        AdmittedRecord,
        WorldRecord,
        ResizedRecord,
        ResumedRecord,
        RecoveryRecord,
        TrialRecord,
    ],
    Field(discriminator="kind"),
]
_RECORD: TypeAdapter[Record] = TypeAdapter(Record)


def parse_record(event: Mapping[str, Any]) -> Record:
    """The typed record of a Dask event's data.

    Raises:
        MalformedRecord: The data is no record: no or an unknown ``kind``, a field missing,
            of the wrong type or unknown to its kind. The message names the kind and fields.
    """
    try:
        return _RECORD.validate_python(event)
    except ValidationError as error:
        kind = event.get("kind") if isinstance(event, Mapping) else None
        problems = "; ".join(_describe(problem) for problem in error.errors())
        what = f"a {kind!r} record" if kind else f"{type(event).__name__} {_preview(event)}"
        raise MalformedRecord(f"{what} refused: {problems}") from None


def _describe(problem: Any) -> str:
    # The first element of a location is the kind the union picked; the field follows.
    where = ".".join(str(part) for part in problem["loc"][1:])
    return f"{where}: {problem['msg']}" if where else problem["msg"]


def _preview(event: Any) -> str:
    text = repr(event)
    return text if len(text) <= 120 else text[:117] + "..."


__all__ = [
    "REPORT_BOOKKEEPING",
    "AdmittedRecord",
    "BaseRecord",
    "CheckpointFailedRecord",
    "EpochRecord",
    "HeartbeatRecord",
    "MalformedRecord",
    "NumberedRecord",
    "OutputRecord",
    "QueueHolder",
    "QueuedRecord",
    "RankRecord",
    "Record",
    "RecoveryRecord",
    "ReportRecord",
    "ResizedRecord",
    "ResumedRecord",
    "StartRecord",
    "StepRecord",
    "TrialRecord",
    "WorldRecord",
    "parse_record",
]
