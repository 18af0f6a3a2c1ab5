"""Labels against predictions: a confusion matrix's metrics, and its plot, for ``predict``'s
``metrics.json`` and ``confusion_matrix.png``."""

from typing import Any

import numpy as np


def confusion_metrics(matrix: np.ndarray, classes: list[str]) -> dict[str, Any]:
    """Accuracy, per-class precision and recall (0 where a class was never predicted or never
    present, as scikit-learn's zero_division=0), support, and the matrix (rows: true class)."""
    matrix = np.asarray(matrix, dtype=np.int64)
    diagonal = np.diag(matrix).astype(np.float64)
    predicted, actual = matrix.sum(axis=0), matrix.sum(axis=1)
    precision = np.divide(diagonal, predicted, out=np.zeros_like(diagonal), where=predicted > 0)
    recall = np.divide(diagonal, actual, out=np.zeros_like(diagonal), where=actual > 0)
    total = int(matrix.sum())
    return {
        "samples": total,
        "accuracy": float(diagonal.sum() / total) if total else 0.0,
        "classes": list(classes),
        "precision": dict(zip(classes, precision.tolist(), strict=True)),
        "recall": dict(zip(classes, recall.tolist(), strict=True)),
        "support": dict(zip(classes, actual.tolist(), strict=True)),
        "confusion_matrix": matrix.tolist(),
    }


def plot_confusion_matrix(matrix: np.ndarray, classes: list[str]) -> Any:
    """A matplotlib Figure of the matrix (no pyplot: leaves the caller's backend alone)."""
    from matplotlib.figure import Figure

    n = len(classes)
    side = min(12.0, 2.0 + 0.5 * n)
    figure = Figure(figsize=(side, side))
    ax = figure.subplots()
    image = ax.imshow(matrix, cmap="Blues")
    figure.colorbar(image, ax=ax, fraction=0.046, pad=0.04)
    ax.set(
        xticks=range(n),
        yticks=range(n),
        xticklabels=classes,
        yticklabels=classes,
        xlabel="predicted",
        ylabel="true",
        title="confusion matrix",
    )
    if n <= 30:
        threshold = matrix.max() / 2 if matrix.size else 0
        for (i, j), value in np.ndenumerate(matrix):
            ax.text(
                j,
                i,
                str(value),
                ha="center",
                va="center",
                fontsize=8,
                color="white" if value > threshold else "black",
            )
    figure.tight_layout()
    return figure
