"""One directory per run: what was asked, what happened, and what came out.

runs/<name>-<UTC time>/
  config.json     the resolved configuration
  metrics.jsonl   one record per logged step and per epoch, as they arrive; a step trained
                  again (after a recovery or a resize from an earlier step, or --resume from
                  a checkpoint older than the step reached) keeps the record of the redone
                  step only, that of the parameters that survive
  attempts.jsonl  one record per attempt at training (a first start, each --resume), written
                  when it ends: finished, interrupted or failed, its wall seconds, the steps
                  from and to, its samples
  summary.json    strategy, world size, epochs, final metrics, samples/s, wall seconds (both
                  over every attempt, each attempt listed), and the store's normalization
                  statistics and classes (what batch inference applies); written last, only
                  by a run that finished: its presence says the run is done
  model.pt        the final parameters (a plain state_dict: load with weights_only=True)
  checkpoints/    step-<n>/ folders written with torch.distributed.checkpoint, newest kept
  run.log         the run's log lines
  tensorboard/    TensorBoard event files (tensorboard --logdir runs/)
  mlflow_run_id   the MLflow run this run logs to, when tracking.mlflow_uri is set: a resumed
                  run goes on logging to it (kept by the tracker, workflows/observe/tracking.py)

config.json, summary.json and mlflow_run_id are replaced whole (written aside, then renamed), and
a new directory appears with its config.json already in it: a run interrupted at any moment
leaves either no directory or one that ``--resume`` takes.

``--output`` may be an fsspec URL (``s3://bucket/runs/x``): the directory is then written into
a private local mirror and copied there as the run goes (``workflows/runs/run_storage.py``),
summary.json last; its checkpoints go straight to ``<url>/checkpoints``. With a signing key,
config.json.hmac signs config.json (``workflows/runs/trust.py``).
"""

import contextlib
import functools
import json
import logging
import math
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

from workers.records import EpochRecord, StepRecord, parse_record
from workers.spec.errors import ConfigError
from workers.spec.run import RunConfig
from workers.spec.secrets import RedactingFilter
from workflows.observe.metrics_file import MetricsFile, write_atomically
from workflows.runs.config import load_config
from workflows.runs.run_storage import (
    UNSENT,
    RunMirror,
    checked_url,
    is_url,
    make_mirror_root,
    mirror_folder,
)
from workflows.runs.trust import CONFIG_SIGNATURE, config_signature

if TYPE_CHECKING:  # the driver imports torch: a refused or finished run never needs it
    from workflows.runs.driver import TrainResult

CONFIG, SUMMARY, ATTEMPTS = "config.json", "summary.json", "attempts.jsonl"
METRICS = "metrics.jsonl"
CHECKPOINTS, TENSORBOARD = "checkpoints", "tensorboard"
_DEFAULT_NAME = RunConfig.model_fields["name"].default

logger = logging.getLogger(__name__)


class RunDirectory:
    def __init__(self, path: Path, config: RunConfig, mirror: RunMirror | None = None) -> None:
        # path: where the run writes (the local mirror of a run kept at a URL).
        self.path, self.config, self.mirror = path, config, mirror
        # The summary of a run that already finished as far as ``config`` asks (resume only):
        # then there is nothing to do, and nothing in the directory may change.
        self.finished: dict[str, Any] | None = None
        self._metrics: MetricsFile | None = None
        self._log_handler: logging.Handler | None = None
        self._created = False  # this process made the directory (release() may remove it)
        self._remote_held = False  # the URL held a run before this process came
        self._sent = False  # this process's config.json reached the URL
        self._attempt: dict[str, Any] | None = None
        self._reached = 0

    @classmethod
    def create(
        cls, config: RunConfig, output: str | Path | None = None, *, resume: bool = False
    ) -> Self:
        """The run directory at ``output`` (default ``runs/<name>-<UTC time>``), checked now and
        written once entered. A directory that already holds a run is refused, its results
        never overwritten, unless ``resume`` continues that same run from its checkpoints.
        Resuming a run that finished leaves ``finished`` set: nothing is to be written then.
        """
        where = cls.path_of(output, config.name, resume=resume)
        if isinstance(where, str):
            return cls._create_mirrored(config, where, resume=resume)
        return cls._create_at(cls(where, config), where, resume=resume)

    @classmethod
    def open(
        cls, raw: dict[str, Any], output: str | Path | None = None, *, resume: bool = False
    ) -> Self:
        """The run directory of a config's sections ``raw`` (before validation) at ``output``,
        made once for ``dask-train run``: where it is (:meth:`path_of`), the config validated
        once with the folders the run keeps there filled in (:meth:`with_its_folders`; a staged
        model's cut is traced to be checked), and the directory checked as :meth:`create`
        checks it. A config that does not validate is a :class:`ConfigError` that says so
        (``invalid config: ...``)."""
        where = cls.path_of(output, raw.get("name", _DEFAULT_NAME), resume=resume)
        try:
            config = load_config(cls.with_its_folders(raw, where))
        except ConfigError as error:
            raise ConfigError(f"invalid config: {error}") from None
        return cls.create(config, where, resume=resume)

    @classmethod
    def _create_mirrored(cls, config: RunConfig, url: str, *, resume: bool) -> Self:
        """A run at ``url``, written into a fresh local mirror (the bucket's copy, for a run
        resumed), in this user's private folder. A mirror left behind is never deleted unsent:
        what a failed last copy left is sent first, and one left by a killed process (which
        may be older or newer than what it sent) is kept aside."""
        make_mirror_root()
        folder = mirror_folder(url)
        try:
            mirror = RunMirror(url, folder, config.bucket_options(url))
            _settle_leftover(mirror)
            folder.mkdir(mode=0o700)
            held = mirror.holds_run()
            if held and resume:
                mirror.download()
        except (OSError, ValueError, ImportError) as error:
            raise ConfigError(f"--output: {url}: cannot reach it ({error})") from None
        directory = cls(folder, config, mirror)
        directory._remote_held = held
        if held and not resume:
            raise ConfigError(
                f"--output: {url} already holds a run; choose a new location, or add --resume "
                "to continue it"
            )
        return cls._create_at(directory, folder, resume=resume)

    @classmethod
    def _create_at(cls, directory: Self, path: Path, *, resume: bool) -> Self:
        config, where = directory.config, directory.location
        if path.exists() and not path.is_dir():
            raise ConfigError(f"--output: {path} exists and is not a directory")
        if (path / CONFIG).exists():
            if not resume:
                try:
                    held = _read_json(path / CONFIG).get("name", "?")
                except ConfigError:
                    held = "?"
                raise ConfigError(
                    f"--output: {where} already holds run {held!r}; choose a new directory, "
                    "or add --resume to continue it"
                )
            held = _read_json(path / CONFIG).get("name", "?")
            if held != config.name:
                raise ConfigError(
                    f"--resume: {where} holds run {held!r}, not {config.name!r}; resume it "
                    "with its own config"
                )
            directory.finished = directory._finished_summary()
        elif resume:
            raise ConfigError(f"--resume: {where} holds no run to continue")
        return directory

    @property
    def location(self) -> str:
        """Where the run is kept: its folder, or its URL."""
        return self.mirror.url if self.mirror is not None else str(self.path)

    @staticmethod
    def path_of(output: str | Path | None, name: str, *, resume: bool = False) -> str | Path:
        """Where run ``name``'s directory is: ``output`` (a URL stays a string), or
        ``runs/<name>-<UTC time>``."""
        if resume and output is None:
            raise ConfigError("--resume: name the run directory to continue with --output DIR")
        if isinstance(output, str):
            output = checked_url("--output", output)
        if is_url(str(output) if output is not None else None):
            return str(output).rstrip("/")
        stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
        return Path(output) if output is not None else Path("runs") / f"{name}-{stamp}"

    @staticmethod
    def with_its_folders(raw: dict[str, Any], where: str | Path) -> dict[str, Any]:
        """A config's sections (before validation) with what a run keeps in its directory
        ``where`` when the config leaves it unset: checkpoints, so that ``--resume`` (or a
        restart after a failure) finds them, and TensorBoard events, so that ``tensorboard
        --logdir runs/`` shows every run. A run at a URL keeps its checkpoints there, and its
        event files in the mirror that is copied there. A section that is no table is left
        for validation to refuse."""
        local = mirror_folder(where) if isinstance(where, str) else where
        folders = {
            ("checkpoint", "directory"): f"{where}/{CHECKPOINTS}"
            if isinstance(where, str)
            else where / CHECKPOINTS,
            ("tracking", "tensorboard"): local / TENSORBOARD,
        }
        raw = dict(raw)
        for (section, key), folder in folders.items():
            given = raw.get(section, {})
            if isinstance(given, dict) and given.get(key) is None:
                raw[section] = {**given, key: str(folder)}
        return raw

    def _finished_summary(self) -> dict[str, Any] | None:
        """The summary, if the run finished and trained at least as far as ``config`` asks.

        Only a finished run writes summary.json. Asking for more (a larger ``training.epochs``
        or ``max_steps``) continues it from its final checkpoint; asking for as much or less
        leaves nothing to train.
        """
        if not (self.path / SUMMARY).exists():
            return None
        try:
            summary = _read_json(self.path / SUMMARY)
        except ConfigError as error:
            # A summary damaged outside dask-train: continuing from the final checkpoint
            # writes a new one.
            logger.warning("%s; treating the run as unfinished", error)
            return None
        asked = self.config.training
        final = summary.get("final") or {}
        if asked.epochs > final.get("epochs", summary.get("epochs", 0)):
            return None
        # Summaries from before max_steps was kept there read as unbounded.
        if _bound(asked.max_steps) > _bound(summary.get("max_steps")):
            return None
        return summary

    @property
    def checkpoints(self) -> Path:
        return self.path / CHECKPOINTS

    @property
    def tensorboard(self) -> Path:
        return self.path / TENSORBOARD

    @property
    def claimed(self) -> bool:
        """The directory holds this run: ``--resume`` can continue it. At a URL, asked once the
        run is stopped: its local mirror is gone by then, the URL holds it."""
        if self.mirror is not None:
            return self._remote_held or self._sent
        return (self.path / CONFIG).exists()

    @functools.cached_property
    def resumes_from(self) -> int | None:
        """The step of the checkpoint that training continues from; None: from the start.

        Read once, after ``config`` has its checkpoint folder (verifying a checkpoint hashes
        every file), so the tracker and the attempt record see the same one; the launcher
        chooses it again, alike, as it starts.
        """
        from workers.checkpoint import latest_good_checkpoint

        settings = self.config.checkpoint
        if not settings.directory or settings.resume != "auto":
            return None
        found = latest_good_checkpoint(
            settings.directory,
            settings.signing_key_file,
            settings.storage_options,
            run_id=self.config.checkpoint_owner,
        )
        return found[1]["step"] if found else None

    def __enter__(self) -> Self:
        """Start writing: from here on the directory holds this run."""
        text = self.config.model_dump_json(indent=2) + "\n"
        if self.path.is_dir():
            write_atomically(self.path / CONFIG, text)
        else:
            self._claim(text)
        key = self.config.checkpoint.signing_key_file
        # What predict checks before it trusts the file (workflows/runs/trust.py).
        if key is not None:
            signature = config_signature(json.loads(text), key)
            write_atomically(self.path / CONFIG_SIGNATURE, signature + "\n")
        if self.mirror is not None:
            self.mirror.copy()  # config.json: the URL holds this run from now on
            self._sent = True
            self.mirror.start()
        self._metrics = MetricsFile(self.path / METRICS).open()
        self._log_handler = logging.FileHandler(self.path / "run.log")
        self._log_handler.setFormatter(
            logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
        )
        self._log_handler.addFilter(RedactingFilter())
        logging.getLogger().addHandler(self._log_handler)
        logger.info("run %s started in %s", self.config.name, self.path)
        # Where training starts from, read before it writes checkpoints of its own.
        logger.info("training starts from step %d", self.resumes_from or 0)
        return self

    def _claim(self, config_text: str) -> None:
        """Make the directory with its config.json in one step: a directory without one holds
        no run, and a Ctrl-C or SIGTERM between a mkdir and the write would leave exactly that,
        which --resume then refuses."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        staging = self.path.parent / f".{self.path.name}.{os.getpid()}.claim"
        shutil.rmtree(staging, ignore_errors=True)  # left by a killed process of the same pid
        try:
            staging.mkdir()
            (staging / CONFIG).write_text(config_text)
            os.rename(staging, self.path)
        except OSError:
            shutil.rmtree(staging, ignore_errors=True)
            if not self.path.is_dir():
                raise
            # Another process made the directory meanwhile (rename refuses a non-empty one):
            # write into it as into any existing directory.
            write_atomically(self.path / CONFIG, config_text)
            return
        except BaseException:  # Ctrl-C, SIGTERM: no half-made directory stays behind
            shutil.rmtree(staging, ignore_errors=True)
            raise
        self._created = True

    def __exit__(self, *exc: object) -> None:
        self._close()

    def _close(self) -> None:
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None
        if self._log_handler is not None:
            logging.getLogger().removeHandler(self._log_handler)
            self._log_handler.close()
            self._log_handler = None
        if self.mirror is not None and self.mirror.running:
            self.mirror.stop()
            try:
                self.mirror.copy(final=True)
                shutil.rmtree(self.path, ignore_errors=True)  # all of it is at the URL now
            except Exception as error:
                # Nothing is lost: the mirror stays, says where it is, and is marked for the
                # next run at this URL (--resume, or the same command) to send first.
                (self.path / UNSENT).write_text(f"{error}\n")
                logger.error(
                    "run directory %s: the last copy failed (%s); the run's files are in %s, "
                    "and --resume sends them first",
                    self.mirror.url,
                    error,
                    self.path,
                )
                raise

    def release(self) -> None:
        """Give the directory back: the run never started (its cluster did not), so the same
        command may run again without --resume. Only a directory this process made is
        removed; one that held a run before is left as it was."""
        self._close()
        self._sent = False
        if self._created:
            shutil.rmtree(self.path, ignore_errors=True)
            self._created = False
        if self.mirror is not None and not self._remote_held:
            self.mirror.remove()
            shutil.rmtree(self.path, ignore_errors=True)

    @contextlib.contextmanager
    def attempt(self) -> Iterator[None]:
        """Around one attempt at training: one that does not return (interrupted, failed) is
        recorded in attempts.jsonl as it ends, so that the summary of the attempt that
        finishes the run counts its wall time and samples too."""
        started = time.time()
        self._attempt = {
            "started_at": _utc(started),
            "from_step": self.resumes_from or 0,
        }
        self._reached = self._attempt["from_step"]
        try:
            yield
        except BaseException as error:
            # A KeyboardInterrupt is Ctrl-C or SIGTERM (workflows/cli.py).
            status = "interrupted" if isinstance(error, KeyboardInterrupt) else "failed"
            if self._attempt is not None:  # else finish() recorded it, then failed after
                # No step figures come back from an attempt that did not return: its samples
                # count to the last step its records reported.
                self._end_attempt(status, wall_s=time.time() - started, to_step=self._reached)
            raise

    def _end_attempt(
        self, status: str, *, wall_s: float, to_step: int, samples_per_s: float | None = None
    ) -> dict[str, Any]:
        # finish() without attempt() (the Python API): the attempt ran since __enter__.
        started = self._attempt or {
            "started_at": _utc(time.time() - wall_s),
            "from_step": self.resumes_from or 0,
        }
        record = started | {
            "status": status,
            "to_step": to_step,
            "wall_s": wall_s,
            # Optimizer steps times the global batch (an epoch's last batch may be smaller).
            "samples": max(0, to_step - started["from_step"]) * self.config.training.batch_size,
            "samples_per_s": samples_per_s,
        }
        self._attempt = None
        with (self.path / ATTEMPTS).open("a") as file:
            file.write(json.dumps(record) + "\n")
            file.flush()
            os.fsync(file.fileno())
        return record

    def attempts(self) -> list[dict[str, Any]]:
        """The attempts recorded so far, oldest first."""
        kept = self.path / ATTEMPTS
        if not kept.exists():
            if (self.path / SUMMARY).exists():
                # A run finished before attempts were recorded: its summary is its one attempt.
                with contextlib.suppress(ConfigError):
                    return [self._attempt_of(_read_json(self.path / SUMMARY))]
            return []
        attempts = []
        for number, line in enumerate(kept.read_text().splitlines(), 1):
            try:
                attempts.append(json.loads(line))
            except ValueError:
                # Cut short by a SIGKILL mid-write: that attempt's figures are lost.
                logger.warning("%s:%d: not a complete attempt record, skipped", kept, number)
        return attempts

    def _attempt_of(self, summary: dict[str, Any]) -> dict[str, Any]:
        """A summary written before attempts were recorded, as the one attempt it describes."""
        steps = int(summary.get("steps") or 0)
        return {
            "status": "finished",
            "from_step": 0,
            "to_step": steps,
            "wall_s": summary.get("wall_s") or 0.0,
            "samples": steps * self.config.training.batch_size,
            "samples_per_s": summary.get("samples_per_s"),
        }

    def record(self, record: dict[str, Any]) -> None:
        """Append one metrics record (an ``on_event`` handler for :func:`train`).

        Each step once: where the job continues from an earlier step than it reached (a
        recovery, a resize, a resumed run), the records of the steps after it are dropped, and
        the records of those steps trained again take their place as they come
        (``workflows.observe.metrics_file.MetricsFile``, as ``dask-train launch`` keeps them).
        """
        typed = parse_record(record)
        if self._metrics is not None:
            self._metrics.append(record, typed)
        if isinstance(typed, StepRecord | EpochRecord):
            self._reached = max(self._reached, typed.step)
        if isinstance(typed, EpochRecord):
            logger.info("epoch %s/%s: %s", typed.epoch, typed.epochs, record)

    def finish(self, result: "TrainResult") -> dict[str, Any]:
        """Write the final model and the summary; returns the summary. The attempt that trained
        (``attempt()``, or else everything since entering) joins the attempts before it."""
        import torch

        model_path = self.path / "model.pt"
        torch.save(result.state_dict, model_path)
        earlier = self.attempts()
        this = self._end_attempt(
            "finished",
            wall_s=result.wall_s,
            to_step=result.final["step"],
            samples_per_s=result.steady_samples_per_s,
        )
        attempts = [*earlier, this]
        summary = {
            "name": result.name,
            "recoveries": result.recoveries,
            "resizes": result.resizes,
            "strategy": result.strategy,
            "world_size": result.world_size,
            "split_points": list(result.split_points) if result.split_points else None,
            "epochs": len(result.history),
            "steps": result.final["step"],
            "max_steps": self.config.training.max_steps,
            "final": {k: v for k, v in result.final.items() if k != "kind"},
            # Over every attempt: seconds spent, samples trained, and the training loops'
            # throughput (a run resumed from its last checkpoint adds no samples, and so
            # leaves it as it was).
            "samples_per_s": _combined_rate(attempts),
            "samples": sum(a.get("samples") or 0 for a in attempts),
            "wall_s": sum(a.get("wall_s") or 0.0 for a in attempts),
            "attempts": attempts,
            "first_step_s": result.first_step_s,
            "first_step_after_launch_s": result.first_step_after_launch_s,
            "peak_memory_mib": result.peak_memory_mib,  # per rank, the last attempt's
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
        # Written last, and whole: its presence is what says the run finished.
        write_atomically(self.path / SUMMARY, json.dumps(summary, indent=2) + "\n")
        logger.info("run %s finished: %s", self.config.name, summary["final"])
        return summary


def _settle_leftover(mirror: RunMirror) -> None:
    """A mirror folder that an earlier process left at ``mirror.folder``: sent (its last copy
    failed: these are the run's newest files, model.pt and summary.json among them), removed
    when every file is in the bucket as it is here, or else (a killed process's, which may be
    older than the bucket too) moved aside; never deleted unsent."""
    folder = mirror.folder
    if not folder.exists():
        return
    if (folder / UNSENT).exists():
        try:
            mirror.copy(final=True)
        except Exception as error:
            raise ConfigError(
                f"--output: {mirror.url}: the files its last run could not send are in "
                f"{folder}, and sending them failed again ({error}); nothing was deleted"
            ) from None
        logger.info("run directory %s: sent what the last copy left in %s", mirror.url, folder)
        mirror.forget_sent()
        shutil.rmtree(folder)
        return
    if not mirror.unsent():  # every file is in the bucket as it is here: nothing to lose
        shutil.rmtree(folder)
        return
    aside = folder.with_name(f"{folder.name}-left-{time.strftime('%Y%m%d-%H%M%S')}")
    folder.rename(aside)
    logger.warning(
        "run directory %s: a local copy left by an interrupted process is kept in %s",
        mirror.url,
        aside,
    )


def _read_json(path: Path) -> dict[str, Any]:
    try:
        held = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ConfigError(f"{path}: not readable as a run's JSON ({error})") from None
    if not isinstance(held, dict):
        raise ConfigError(f"{path}: not a run's JSON object")
    return held


def _bound(max_steps: int | None) -> float:
    return math.inf if max_steps is None else max_steps


def _utc(seconds: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(seconds))


def _combined_rate(attempts: list[dict[str, Any]]) -> float:
    """Samples per second of training loop over the attempts that measured it: their samples
    over the seconds those took at the rate each measured."""
    measured = [a for a in attempts if (a.get("samples_per_s") or 0) > 0 and a.get("samples")]
    seconds = sum(a["samples"] / a["samples_per_s"] for a in measured)
    return sum(a["samples"] for a in measured) / seconds if seconds else 0.0
