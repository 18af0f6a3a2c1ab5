"""A Ctrl-C that Python drops in a finalizer is raised again, in the CLI and while ``launch``
and ``train`` wait (a script or a notebook)."""

import subprocess
import sys

import pytest

from workflows import launch, train

DROPPED_IN_A_FINALIZER = """
import signal, time
from workflows.interrupts import DroppedInterrupts

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
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
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
