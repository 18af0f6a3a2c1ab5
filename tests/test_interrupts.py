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


class _Landed(Exception):
    """Raised by the test's signal wherever the main thread is, as Ctrl-C raises
    KeyboardInterrupt (which pytest would take as the session's own)."""


def _land(signum, frame):
    raise _Landed


def test_a_signal_landing_while_a_record_is_relayed_never_leaves_the_relay_stuck(cluster):
    # The CLI's Ctrl-C and SIGTERM land wherever its main thread is, and the "queued" record
    # of a queued job is relayed right when a scheduler's SIGTERM is likely. Landing inside
    # the relay's queue used to leave its lock taken: the job hung on it at its exit. Here
    # the main thread hands the relay records (as Dask's event handler does) until a
    # signal lands, at a moment of the thread's own, a hundred times.
    import _thread
    import itertools
    import queue
    import random
    import signal
    import threading
    import time
    import uuid

    from workflows.events import EventRelay

    relay = EventRelay(cluster.client, f"relay-{uuid.uuid4().hex[:8]}", on_event=lambda r: None)
    go: queue.SimpleQueue = queue.SimpleQueue()

    def signal_once_per_go() -> None:
        rng = random.Random(0)
        while go.get():
            time.sleep(rng.uniform(0, 2e-4))
            _thread.interrupt_main(signal.SIGUSR1)

    previous = signal.signal(signal.SIGUSR1, _land)
    try:
        with relay:
            threading.Thread(target=signal_once_per_go, daemon=True).start()
            for landing in range(100):
                try:
                    go.put(True)
                    for seq in itertools.count():  # the signal lands in here
                        relay._handle((time.time(), {"kind": "output", "seq": seq, "rank": 0}))
                except _Landed:
                    pass
                # Another thread's record still gets through.
                probe = (time.time(), {"kind": "probe", "seq": landing})
                sender = threading.Thread(target=relay._handle, args=(probe,), daemon=True)
                sender.start()
                sender.join(timeout=10)
                assert not sender.is_alive(), f"the relay is stuck after landing {landing + 1}"
    finally:
        go.put(False)
        signal.signal(signal.SIGUSR1, previous)
