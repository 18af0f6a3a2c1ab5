"""One directory per run: what was asked, what happened, and what came out.

runs/<name>-<UTC time>/
  config.json     the resolved configuration
  metrics.jsonl   one record per logged step and per epoch, as they arrive
  summary.json    strategy, world size, epochs, final metrics, samples/s, wall seconds, and the
                  store's normalization statistics and classes (what batch inference applies)
  model.pt        the final parameters (a plain state_dict: load with weights_only=True)
  checkpoints/    step-<n>/ folders written with torch.distributed.checkpoint, newest kept
  run.log         the run's log lines
  tensorboard/    TensorBoard event files (tensorboard --logdir runs/)
  mlflow_run_id   the MLflow run this run logs to, when tracking.mlflow_uri is set: a resumed
                  run goes on logging to it
"""

import json
import logging
import time
from pathlib import Path
from typing import Any, Self

import torch

from workflows.config import ConfigError, RunConfig
from workflows.driver import TrainResult

logger = logging.getLogger(__name__)


class RunDirectory:
    def __init__(self, path: Path, config: RunConfig) -> None:
        self.path, self.config = path, config
        self._metrics = None
        self._log_handler: logging.Handler | None = None

    @classmethod
    def create(
        cls, config: RunConfig, output: str | Path | None = None, *, resume: bool = False
    ) -> Self:
        """The run directory at ``output`` (default ``runs/<name>-<UTC time>``), checked now and
        written once entered. A directory that already holds a run is refused, its results
        never overwritten, unless ``resume`` continues that same run from its checkpoints.
        """
        if resume and output is None:
            raise ConfigError("--resume: name the run directory to continue with --output DIR")
        stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
        path = Path(output) if output is not None else Path("runs") / f"{config.name}-{stamp}"
        if (path / "config.json").exists():
            held = json.loads((path / "config.json").read_text()).get("name", "?")
            if not resume:
                raise ConfigError(
                    f"--output: {path} already holds run {held!r}; choose a new directory, "
                    "or add --resume to continue it"
                )
            if held != config.name:
                raise ConfigError(
                    f"--resume: {path} holds run {held!r}, not {config.name!r}; resume it with "
                    "its own config"
                )
        elif resume:
            raise ConfigError(f"--resume: {path} holds no run to continue")
        if path.exists() and not path.is_dir():
            raise ConfigError(f"--output: {path} exists and is not a directory")
        return cls(path, config)

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    @property
    def tensorboard(self) -> Path:
        return self.path / "tensorboard"

    @property
    def mlflow_run_id(self) -> str | None:
        """The MLflow run an earlier start of this run logged to, if any."""
        kept = self.path / "mlflow_run_id"
        return kept.read_text().strip() or None if kept.exists() else None

    def keep_mlflow_run_id(self, run_id: str) -> None:
        (self.path / "mlflow_run_id").write_text(run_id + "\n")

    def __enter__(self) -> Self:
        """Start writing: from here on the directory holds this run."""
        self.path.mkdir(parents=True, exist_ok=True)
        (self.path / "config.json").write_text(self.config.model_dump_json(indent=2) + "\n")
        self._metrics = (self.path / "metrics.jsonl").open("a", buffering=1)
        self._log_handler = logging.FileHandler(self.path / "run.log")
        self._log_handler.setFormatter(
            logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
        )
        logging.getLogger().addHandler(self._log_handler)
        logger.info("run %s started in %s", self.config.name, self.path)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None
        if self._log_handler is not None:
            logging.getLogger().removeHandler(self._log_handler)
            self._log_handler.close()
            self._log_handler = None

    def record(self, record: dict[str, Any]) -> None:
        """Append one metrics record (an ``on_event`` handler for :func:`train`)."""
        if self._metrics is not None:
            self._metrics.write(json.dumps(record) + "\n")
        if record.get("kind") == "epoch":
            logger.info("epoch %s/%s: %s", record["epoch"], record["epochs"], record)

    def finish(self, result: TrainResult) -> dict[str, Any]:
        """Write the final model and the summary; returns the summary."""
        model_path = self.path / "model.pt"
        torch.save(result.state_dict, model_path)
        summary = {
            "name": result.name,
            "recoveries": result.recoveries,
            "strategy": result.strategy,
            "world_size": result.world_size,
            "split_points": list(result.split_points) if result.split_points else None,
            "epochs": len(result.history),
            "steps": result.final["step"],
            "final": {k: v for k, v in result.final.items() if k != "kind"},
            "samples_per_s": result.steady_samples_per_s,
            "wall_s": result.wall_s,
            "first_step_s": result.first_step_s,
            "first_step_after_launch_s": result.first_step_after_launch_s,
            # None: trained from Dask collections (train(data=...)), no store.
            "store": None
            if result.store is None
            else {
                "url": result.store.url,
                "counts": result.store.counts,
                "reused": result.store.reused,
                # The preprocessing the model was trained with, kept with the model: batch
                # inference normalizes with these even after the store is gone or rebuilt.
                "mean": result.store.mean,
                "std": result.store.std,
                "classes": result.store.classes,
                "image_size": self.config.data.image_size,
            },
            "model": model_path.name,
        }
        (self.path / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        logger.info("run %s finished: %s", self.config.name, summary["final"])
        return summary
