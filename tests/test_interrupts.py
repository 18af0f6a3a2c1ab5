"""A Ctrl-C that Python drops in a finalizer is raised again, in the CLI and while ``launch``
and ``train`` wait (a script or a notebook), and one landing while a job's event is handed over
leaves the relay able to close."""

import sys
import threading

import pytest

from tests.commands import run_python
from workers.records import EpochRecord
from workflows import launch, train
from workflows.observe.events import EventRelay

DROPPED_IN_A_FINALIZER = """
import signal, time
from workflows.jobs.interrupts import DroppedInterrupts

class Finalized:
    def __del__(self):
        signal.raise_signal(signal.SIGINT)  # Ctrl-C, while a finalizer runs

try:
    with {context}:
        Finalized()
        for _ in range({ticks}):  # a bound on its arrival, not a measurement
            time.sleep(0.01)
    print("lost")
except KeyboardInterrupt:
    print("delivered")
"""


@pytest.mark.parametrize(
    ("context", "ticks", "expected"),
    [
        ("DroppedInterrupts()", 6000, "delivered"),
        # Without it Python drops the interrupt (prints "Exception ignored") and goes on.
        ("open('/dev/null')", 200, "lost"),
    ],
)
def test_a_ctrl_c_dropped_in_a_finalizer_is_raised_again(context, ticks, expected):
    code = DROPPED_IN_A_FINALIZER.format(context=context, ticks=ticks)
    done = run_python(code)
    assert done.stdout.strip() == expected, done.stderr
    if expected == "delivered":
        # Raised again and caught: the hook took the dropped one, so Python reported nothing.
        assert done.stderr == ""
    else:
        # Python's report of the interrupt it dropped in the finalizer, and nothing else.
        assert done.stderr.startswith("Exception ignored in: <function Finalized.__del__"), (
            done.stderr
        )
        assert done.stderr.rstrip().splitlines()[-1].startswith("KeyboardInterrupt"), done.stderr


def reports_once(ctx) -> int:
    ctx.report(step=1)
    return ctx.rank


def test_launch_and_train_hold_the_redelivery_while_they_wait(cluster, make_config):
    before = sys.unraisablehook
    seen = []

    def record(event: dict) -> None:  # runs while the call waits for its ranks
        seen.append(type(getattr(sys.unraisablehook, "__self__", None)).__name__)

    assert launch(reports_once, cluster=cluster, world_size=2, on_event=record).results == [0, 1]
    train(make_config({"name": "redelivery"}, epochs=1), cluster=cluster, on_event=record)
    assert seen and set(seen) == {"DroppedInterrupts"}
    assert sys.unraisablehook is before  # given back


# An epoch record as the built-in trainer sends it; each hand-off numbers its own epoch.
EPOCH_RECORD = EpochRecord(
    epoch=1, epochs=9, step=1, loss=1.0, samples_per_s=1.0, lr=0.1
).to_event()


class Interrupted(BaseException):
    """Stands for the KeyboardInterrupt a Ctrl-C or SIGTERM raises in the CLI's main thread
    (not one, so that pytest never takes it for the user's)."""


def _hand_off_interrupted_at(relay: EventRelay, point: int, outcome: list[bool]) -> None:
    """Hand the relay one record, raising Interrupted at the ``point``-th Python event (call,
    line, return) of that hand-off: every place a signal's exception can land. Appends whether
    it was interrupted (False once ``point`` is past the hand-off's last event)."""
    seen = 0

    def interrupt_at_point(frame, event, arg):
        nonlocal seen
        seen += 1
        if seen == point:
            raise Interrupted
        return interrupt_at_point

    sys.settrace(interrupt_at_point)
    try:
        relay._handle((0.0, EPOCH_RECORD | {"epoch": point}))
    except Interrupted:
        outcome.append(True)
        return
    finally:
        sys.settrace(None)
    outcome.append(False)


def test_an_interrupt_anywhere_in_a_records_hand_off_leaves_the_relay_able_to_close(cluster):
    """The queued CLI job's SIGTERM hang, made deterministic: with a queue.Queue as the relay's
    queue, one of these points leaves Queue.put's lock taken (the interrupt raised before its
    ``with`` body) and the close hangs."""
    point, interrupted = 0, True
    while interrupted:
        point += 1
        relay = EventRelay(cluster.client, f"hand-off-{point}", on_event=lambda record: None)
        relay.__enter__()
        outcome: list[bool] = []
        # Its own thread, so that a hand-off or a close that hangs fails the test, not the run.
        hand_off = threading.Thread(
            target=_hand_off_interrupted_at, args=(relay, point, outcome), daemon=True
        )
        hand_off.start()
        hand_off.join(timeout=30)
        assert outcome, f"interrupted at point {point}, the hand-off itself did not return"
        interrupted = outcome[0]
        closing = threading.Thread(target=relay.__exit__, args=(None, None, None), daemon=True)
        closing.start()
        closing.join(timeout=30)
        assert not closing.is_alive(), f"interrupted at point {point}, the relay never closed"
    assert point > 1  # the hand-off ran Python code, so the points were really tried
