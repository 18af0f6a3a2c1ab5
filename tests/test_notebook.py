"""The notebook driver runs end to end on a real cluster, as a person would run it."""

import re
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from tests.extras import needs_extra

NOTEBOOKS = Path(__file__).parents[1] / "notebooks"


@pytest.mark.slow
@needs_extra("ipykernel", "optuna")  # its kernel; the notebook's sweep
def test_training_notebook_executes_end_to_end(store_dir, monkeypatch):
    monkeypatch.setenv("DASK_TRAIN_STORE", str(store_dir / "digits"))
    notebook = nbformat.read(NOTEBOOKS / "train_on_dask.ipynb", as_version=4)
    assert all(not cell.get("outputs") for cell in notebook.cells if cell.cell_type == "code")
    NotebookClient(
        notebook,
        timeout=600,
        kernel_name="python3",
        resources={"metadata": {"path": NOTEBOOKS}},
        # Not the graceful shutdown: ipykernel then signals its child processes and waits for
        # them to go, and multiprocessing's resource tracker ignores SIGTERM (any local Dask
        # cluster's workers start one), so the kernel is terminated 2.5 s later all the same.
        shutdown_kernel="immediate",
    ).execute()
    text = "\n".join(
        output.get("text", "") + str(output.get("data", {}).get("text/plain", ""))
        for cell in notebook.cells
        if cell.cell_type == "code"
        for output in cell.outputs
    )
    assert "dashboard: http://127.0.0.1:" in text
    assert "training page: http://127.0.0.1:" in text and "/training" in text
    assert "Epoch 1/4:" in text  # tqdm's bar (a widget, or text without ipywidgets)
    assert "Epoch [4/4]" in text  # the epoch line that replaces it
    assert "samples/s" in text and "predicted:" in text
    assert "359 predictions in 3 partitions, accuracy" in text  # batch inference
    assert "pipeline cut at ['" in text  # the pipeline strategy, with a planned cut
    assert "accuracy of each rank's shard:" in text  # the user's own loop on launch()
    assert "reports from rank 0" in text
    assert "best learning rate" in text and "COMPLETE" in text  # the sweep and its trials
    # The tabular section: a factory from the notebook trained on a Parquet dataframe learns.
    accuracy = re.search(r"validation accuracy (\d\.\d+)", text)
    assert accuracy and float(accuracy.group(1)) > 0.8, text[-2000:]
    assert any(
        "image/png" in output.get("data", {})
        for cell in notebook.cells
        if cell.cell_type == "code"
        for output in cell.outputs
    )
