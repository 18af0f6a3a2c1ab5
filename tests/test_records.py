"""The records a job sends (workers/records.py): what the emitters send parses back into its
model and travels as plain data, nothing builds a record by hand, and a record of no known
shape is refused with a message that says why; the scheduler's plugin and the client's relay
log it and go on."""

import ast
import itertools
import logging
import math
import pickle
from pathlib import Path
from typing import Any, get_args

import msgpack
import pytest

from tests.conftest import REPO
from workers.checkpoint import AsyncCheckpoints, _Write
from workers.records import (
    AdmittedRecord,
    BaseRecord,
    EpochRecord,
    HeartbeatRecord,
    MalformedRecord,
    QueuedRecord,
    RankRecord,
    Record,
    ReportRecord,
    StartRecord,
    StepRecord,
    TrialRecord,
    WorldRecord,
    parse_record,
)
from workers.script_runner import KEEP_RECORDS, _OutputStream
from workers.spec.sections import METRICS
from workflows.jobs.controller import Recovery, Resize
from workflows.jobs.spec import JobSpec
from workflows.observe.events import EventRelay
from workflows.observe.monitoring import TOPIC_PREFIXES, TrainingMetrics, read_topic, sweep_topic

MODELS = get_args(get_args(Record)[0])
WORKER = "tcp://127.0.0.1:40001"  # what Dask adds to every event a worker sends


class RankStandIn:
    """What a script's output stream uses of its RankContext: its rank, and ``emit``, which
    checks the record as RankContext.emit does."""

    rank, attempt = 1, 0

    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []

    def emit(self, record: dict[str, Any]) -> None:
        self.sent.append(parse_record(record).to_event())

    def heartbeat(self) -> None:
        pass


def _subclasses(cls: type) -> set[type]:
    return {cls, *(found for sub in cls.__subclasses__() for found in _subclasses(sub))}


def _emitted() -> list[BaseRecord]:
    """Records as their emitters make them, where that takes no cluster (the trainer's and the
    ranks' come through a real job in tests/test_monitoring.py)."""
    resize = Resize(cause="joined", before=2, detected_at=1796293655.1, after=3, step=96)
    resize.pause_s = 0.06
    recovery = Recovery(
        failure="worker lost", detected_at=1796293655.1, resumed_from_step=8, redo_s=1.5
    )
    rank = RankStandIn()
    stream = _OutputStream(rank)  # type: ignore[arg-type]
    stream._add(["hello\n", "world\n"])
    stream.flush()
    failed: list[dict[str, Any]] = []
    checkpoints = AsyncCheckpoints("/nowhere", keep=1, on_failure=failed.append)
    write = _Write(
        step=2,
        name="step-2",
        fields={},
        target=Path("/nowhere"),
        staged={},
        staging="",
        rank=0,
        world_size=1,
    )
    checkpoints._failed(write, ["rank 1: OSError: refused"])
    holder = {"job_id": "holder-1", "name": "holder", "workers": 2, "since": 1796293600.0}
    return [
        resize.record(),
        resize.record().model_copy(update={"job_id": "job-1"}),  # the controller's event
        parse_record({"kind": "recovery", "recoveries": 1, **recovery.summary()}),
        *(parse_record(record) for record in rank.sent + failed),
        StartRecord(strategy="ddp", world_size=2, epochs=3, total_steps=90),
        StepRecord(epoch=1, step=5, loss=2.25),
        EpochRecord(
            **{"epoch": 1, "epochs": 3, "step": 30, "loss": 0.5, "r2": -0.5},
            **{"samples_per_s": 900.0, "lr": 0.1},
        ),
        ReportRecord(rank=0, attempt=0, seq=0, time=1796293655.1, loss=0.25, step=1, note="x"),
        HeartbeatRecord(rank=0, step=3, samples_per_s=120.5, peak_memory_bytes=2**20),
        QueuedRecord(job_id="job-1", position=0, eligible=2, holders=[holder]),
        AdmittedRecord(job_id="job-1", waited_s=3.5),
        WorldRecord(job_id="job-1", world_size=2),
        TrialRecord(
            **{"sweep": "tune", "number": 3, "state": "COMPLETE", "value": 0.5},
            **{"params": {"lr": 0.1}, "job_id": "tune-trial-3-1", "wall_s": 4.0},
        ),
    ]


def test_every_record_model_is_in_the_union_under_a_kind_of_its_own():
    kinds = [model.model_fields["kind"].default for model in MODELS]
    assert len(set(kinds)) == len(MODELS), kinds
    concrete = {c for c in _subclasses(BaseRecord) if not c.model_fields["kind"].is_required()}
    assert concrete == set(MODELS)  # a model left out of Record would never be read


def test_no_emitter_builds_a_record_by_hand():
    """Every record is made from its model: a dict literal with a record's "kind" is one that
    no model checks."""
    kinds = {model.model_fields["kind"].default for model in MODELS}
    by_hand = []
    for path in [*REPO.glob("workers/**/*.py"), *REPO.glob("workflows/**/*.py")]:
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if not isinstance(node, ast.Dict):
                continue
            for key, value in zip(node.keys, node.values, strict=True):
                if (
                    isinstance(key, ast.Constant)
                    and key.value == "kind"
                    and isinstance(value, ast.Constant)
                    and value.value in kinds
                ):
                    by_hand.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not by_hand, by_hand


def test_what_the_emitters_send_parses_back_and_travels_as_plain_data():
    records = _emitted()
    for record in records:
        event = record.to_event()
        assert next(iter(event)) == "kind"
        # Dask events are msgpack'd; NaN survives, and nothing else than plain data is in it.
        back = msgpack.unpackb(msgpack.packb(event), strict_map_key=False)
        assert parse_record(back).to_event().keys() == event.keys()
        assert parse_record(event) == record and parse_record(event).to_event() == event
        if isinstance(record, RankRecord):  # as a worker's event reaches the scheduler
            assert parse_record(event | {"worker": WORKER}).worker == WORKER
    # R² of a constant target is NaN: msgpack carries it.
    undefined = EpochRecord(
        epoch=1, epochs=1, step=1, loss=1.0, r2=float("nan"), samples_per_s=1, lr=1
    )
    assert math.isnan(parse_record(msgpack.unpackb(msgpack.packb(undefined.to_event()))).r2)
    documented = {
        "kind",
        "from",
        "to",
        "step",
        "cause",
        "pause_s",
        "redone_steps",
        "at",
        "broadcast_s",
    }
    assert records[0].to_event().keys() == documented  # docs/guides/elastic.md#records


def test_epoch_records_carry_every_figure_a_task_reports():
    figures = {"loss", *itertools.chain(*METRICS.values())}
    fields = set(EpochRecord.model_fields)
    assert figures | {f"val_{name}" for name in figures} <= fields
    # A regression's epoch sends its own figures, no accuracy set to None.
    regression = EpochRecord(epoch=1, epochs=1, step=1, loss=1.0, mse=1.0, samples_per_s=1, lr=1)
    assert "accuracy" not in regression.to_event()


@pytest.mark.parametrize(
    ("event", "message"),
    [
        ({"kind": "nope"}, r"^a 'nope' record refused: .*expected tags: 'start', 'step'"),
        ({"world_size": 2}, r"^dict \{'world_size': 2\} refused: .*discriminator 'kind'"),
        (
            {"kind": "world", "job_id": "j"},
            r"^a 'world' record refused: world_size: Field required",
        ),
        (
            {"kind": "world", "job_id": "j", "world_size": 2, "number": 7},
            r"^a 'world' record refused: number: Extra inputs are not permitted$",
        ),
        (
            {"kind": "step", "epoch": 1, "step": "two", "loss": 1.0},
            r"^a 'step' record refused: step: Input should be a valid integer",
        ),
        ("text", r"^str 'text' refused: "),
    ],
)
def test_a_record_of_no_known_shape_is_refused_with_what_is_wrong(event, message):
    with pytest.raises(MalformedRecord, match=message):
        parse_record(event)


def _plugin() -> TrainingMetrics:
    """The plugin as the scheduler gets it: pickled."""
    return pickle.loads(pickle.dumps(TrainingMetrics()))


def test_the_scheduler_plugin_logs_and_skips_what_it_cannot_read(caplog):
    plugin = _plugin()
    spec = JobSpec.mint("odd")
    heartbeat = HeartbeatRecord(rank=0, step=1, samples_per_s=5.0).to_event()
    with caplog.at_level(logging.DEBUG, logger="workflows.observe.monitoring"):
        for event in [{"kind": "nope"}, {"kind": "nope", "x": 1}, "text", heartbeat]:
            plugin.log_event(spec.event_topic, event)  # none of them a job's record
        plugin.log_event(spec.event_topic, WorldRecord(job_id=spec.job_id, world_size=2).to_event())
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    # One warning per kind of refusal on a topic (a client of another version would refuse
    # every step), each naming the topic and why.
    assert len(warnings) == 3, warnings
    assert all(w.startswith(f"event on {spec.event_topic} skipped: ") for w in warnings)
    assert "a 'nope' record refused" in warnings[0]
    assert "a 'heartbeat' record belongs on a heartbeat topic" in warnings[2]
    assert len([r for r in caplog.records if "skipped" in r.getMessage()]) == 4
    (state,) = plugin.snapshot().values()  # the job's valid record still counts
    assert state["world_size"] == 2 and state["ranks"] == {}


def test_a_name_never_carries_its_records_into_another_kind_of_topic():
    """No topic prefix begins another, and each record says which kind of topic it belongs on:
    a job named "sweep-a" or "heartbeat-a" stays a job, a study named "job-a" a study."""
    prefixes = list(TOPIC_PREFIXES.values())
    assert not [(a, b) for a, b in itertools.permutations(prefixes, 2) if a.startswith(b)]
    plugin = _plugin()
    specs = [JobSpec.mint(name) for name in ("sweep-a", "heartbeat-a", "job-a")]
    for spec in specs:
        assert read_topic(spec.event_topic) == ("job", spec.job_id)
        assert read_topic(spec.heartbeat_topic) == ("heartbeat", spec.job_id)
        plugin.log_event(spec.event_topic, WorldRecord(job_id=spec.job_id, world_size=2).to_event())
        beat = HeartbeatRecord(rank=1, step=2, samples_per_s=7.0, peak_memory_bytes=8)
        plugin.log_event(spec.heartbeat_topic, beat.to_event())
    trial = TrialRecord(
        **{"sweep": "job-a", "number": 1, "state": "RUNNING", "value": None},
        **{"params": {}, "job_id": "", "wall_s": 0.0},
    )
    assert read_topic(sweep_topic("job-a")) == ("sweep", "job-a")
    plugin.log_event(sweep_topic("job-a"), trial.to_event())
    jobs = plugin.snapshot()
    assert set(jobs) == {spec.job_id for spec in specs}
    for spec in specs:
        assert jobs[spec.job_id]["world_size"] == 2
        assert (jobs[spec.job_id]["ranks"], jobs[spec.job_id]["memory"]) == ({1: 7.0}, {1: 8})
    assert list(plugin.sweeps) == ["job-a"] and list(plugin.sweeps["job-a"]) == [1]
    assert read_topic("dask-train-jobs") is None and read_topic("all") is None


def test_the_relay_hands_on_event_what_it_can_read_and_logs_the_rest(cluster, caplog):
    received: list[dict[str, Any]] = []
    relay = EventRelay(cluster.client, "dask-train-job-relay-1", on_event=received.append)
    report = ReportRecord(rank=0, attempt=0, seq=0, time=1.0, loss=0.5).to_event()
    beat = HeartbeatRecord(rank=0, step=1).to_event()
    with caplog.at_level(logging.WARNING, logger="workflows.observe.events"):
        # Not entered: what arrives late is delivered here, at once.
        relay.deliver_missed([{"kind": "nope"}, report | {"worker": WORKER}, beat, report])
    assert received == [report | {"worker": WORKER}]  # the dict as it travelled, once
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2 and "a 'nope' record refused" in warnings[0], warnings
    assert "a heartbeat record on a job's topic; dropped" in warnings[1]


def test_a_scripts_output_records_stay_numbered_past_the_ones_it_keeps():
    """The client drops a record whose number it has seen: numbered by the records kept
    (KEEP_RECORDS at most), a long script's output stopped reaching it."""
    rank = RankStandIn()
    stream = _OutputStream(rank)  # type: ignore[arg-type]
    for n in range(KEEP_RECORDS + 5):
        stream._add([f"line {n}\n"])
        stream.flush()
    assert [record["seq"] for record in rank.sent] == list(range(KEEP_RECORDS + 5))
    assert len(stream.records) == KEEP_RECORDS
