"""The tqdm bar, drawn on a real pseudo-terminal by a separate process."""

import os
import subprocess
import sys

DRAW = """
import sys
from workflows.runs.progress import EpochProgress

from workers.records import EpochRecord, StartRecord, StepRecord

progress = EpochProgress(file=sys.stdout)
progress(StartRecord(strategy="ddp", world_size=2, epochs=2, total_steps=40).to_event())
for epoch in (1, 2):
    for step in range(20 * epoch - 15, 20 * epoch + 1, 5):
        progress(StepRecord(epoch=epoch, step=step, loss=1.0 / step).to_event())
    figures = {"loss": 0.5, "accuracy": 0.75, "val_loss": 0.625, "val_accuracy": 0.8}
    done = EpochRecord(epoch=epoch, epochs=2, step=20 * epoch, samples_per_s=100.0, lr=0.1,
                       **figures)
    progress(done.to_event())
"""


def _on_a_pty(code: str) -> str:
    leader, follower = os.openpty()
    process = subprocess.Popen([sys.executable, "-c", code], stdout=follower)
    os.close(follower)
    chunks = []
    try:
        while True:
            try:
                chunk = os.read(leader, 4096)
            except OSError:  # the terminal closed: the process is gone
                break
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(leader)
        assert process.wait(timeout=60) == 0
    return b"".join(chunks).decode()


def test_each_epoch_gets_a_bar_that_gives_way_to_its_line():
    screen = _on_a_pty(DRAW)
    # Each bar's first drawing already shows the step that opened it, and its loss.
    assert "\rEpoch 1/2:  25%|" in screen and "| 5/20 [" in screen and "loss=0.2000" in screen
    assert "\rEpoch 2/2:  25%|" in screen and "loss=0.0400" in screen
    lines = [line.strip("\r ") for line in screen.split("\n")]
    epoch_lines = [line[line.index("Epoch [") :] for line in lines if "Epoch [" in line]
    assert epoch_lines == [
        "Epoch [1/2], Loss: 0.5000, Acc: 0.7500, Val Loss: 0.6250, Val Acc: 0.8000, 100 samples/s",
        "Epoch [2/2], Loss: 0.5000, Acc: 0.7500, Val Loss: 0.6250, Val Acc: 0.8000, 100 samples/s",
    ]
    # Bars are erased (leave=False): each epoch line starts a cleared line, not a bar's tail.
    assert all("%|" not in line[line.index("Epoch [") :] for line in lines if "Epoch [" in line)
