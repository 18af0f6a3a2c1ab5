"""One directory per ``dask-train sweep``: what was asked, the study, and what came out.

runs/<name>-sweep-<UTC time>/
  sweep.json    the request: the config, the space as given, trials, metric, mode, sampler,
                pruner, study name and storage; written first
  study.jsonl   the Optuna study (a journal file), unless --storage names another
  trials.csv    one row per trial of the study (SweepResult.trials; params as JSON)
  best.json     the best trial: number, value, params, its config and checkpoint folder
  checkpoints/  <study>-trial-<n>/ per trial, unless the config names a checkpoint folder

Running the same command with ``--output`` set to such a directory continues its study:
finished trials are kept, the trial that was interrupted runs again, and the study ends with
the trials asked for. With ``--storage`` (and no ``--study-name``) the study is
``<config name>-sweep``, as ``sweep()`` names a config's: the same command again, in a new
directory, continues it too.
"""

import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

from workers.spec.errors import ConfigError
from workers.spec.secrets import MASK, mask_url, redact_value
from workflows.sweeps.sweep import SweepResult, config_study

REQUEST, TRIALS, BEST = "sweep.json", "trials.csv", "best.json"


@dataclass
class SweepDirectory:
    path: Path
    study_name: str
    storage: str
    created: bool = False  # this process made the directory: release() removes it

    @classmethod
    def open(
        cls,
        config_name: str,
        output: Path | None,
        *,
        study_name: str | None,
        storage: str | None,
    ) -> Self:
        """The directory at ``output`` (default ``runs/<name>-sweep-<UTC time>``): a new one,
        or one that holds a sweep, whose study this continues. Its study: ``study_name``, else
        with a ``storage`` the config's (``<name>-sweep``, continued when it exists), else the
        directory's name in its own ``study.jsonl``."""
        stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
        path = output if output is not None else Path("runs") / f"{config_name}-sweep-{stamp}"
        if path.exists() and not path.is_dir():
            raise ConfigError(f"--output: {path} exists and is not a directory")
        if (path / REQUEST).exists():
            return cls._continued(path, study_name=study_name, storage=storage)
        if path.exists() and any(path.iterdir()):
            raise ConfigError(f"--output: {path} is not empty and holds no sweep; choose another")
        if storage is None:
            return cls(path, study_name or path.name, str((path / "study.jsonl").absolute()))
        return cls(path, study_name or config_study(config_name), storage)

    @classmethod
    def _continued(cls, path: Path, *, study_name: str | None, storage: str | None) -> Self:
        try:
            held = json.loads((path / REQUEST).read_text())
            kept = {"--study-name": held["study_name"], "--storage": held["storage"]}
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise ConfigError(
                f"--output: {path / REQUEST} is not a sweep's record ({error})"
            ) from None
        # The storage is kept without its password: given again, it must be the same URL.
        written = None if storage is None else mask_url(storage)
        for option, given in (("--study-name", study_name), ("--storage", written)):
            if given is not None and given != kept[option]:
                raise ConfigError(
                    f"{option}: {path} continues study {kept['--study-name']!r} in "
                    f"{kept['--storage']}; leave {option} out, or choose another --output"
                )
        if storage is None and f":{MASK}@" in kept["--storage"]:
            raise ConfigError(
                f"--storage: {path} continues study {kept['--study-name']!r} in "
                f"{kept['--storage']}, whose password is not kept: give --storage again"
            )
        return cls(path, kept["--study-name"], storage or kept["--storage"])

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    def write_request(self, request: dict[str, Any]) -> None:
        from workflows.runs.run_directory import write_atomically

        if not self.path.exists():
            self.path.mkdir(parents=True)
            self.created = True
        held = {"study_name": self.study_name, "storage": mask_url(self.storage), **request}
        # Every secret masked, by value: a password inside any field of the request too.
        write_atomically(self.path / REQUEST, json.dumps(redact_value(held), indent=2) + "\n")

    def release(self) -> None:
        """Give back a directory this process made for a sweep that never started."""
        if self.created:
            shutil.rmtree(self.path, ignore_errors=True)
            self.created = False

    def write_results(self, result: SweepResult, *, metric: str, mode: str) -> None:
        from workflows.runs.run_directory import write_atomically

        trials = result.trials.copy()
        trials["params"] = [json.dumps(params) for params in trials["params"]]
        write_atomically(self.path / TRIALS, trials.to_csv(index=False))
        best = result.best_trial
        if best is None:
            return
        summary = {
            "study_name": result.study_name,
            "metric": metric,
            "mode": mode,
            "number": best.number,
            "value": best.value,
            "params": best.params,
            "checkpoint_dir": best.checkpoint_dir,
            "config": best.config.model_dump(mode="json") if best.config else None,
        }
        write_atomically(self.path / BEST, json.dumps(summary, indent=2) + "\n")
