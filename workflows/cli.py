"""``dask-train``: the batch entry point.

Exit codes a scheduler can act on: 0 success, 2 invalid config or arguments (one line, no
traceback), 1 training (or prediction) failure, 130 interrupted.
"""

import atexit
import contextlib
import errno
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import click

from workers.sources import SourceError, check_root, store_to_build
from workers.spec.errors import ConfigError
from workers.spec.run import RunConfig
from workers.spec.secrets import RedactingFilter, redact
from workers.spec.sections import LOSSES
from workflows.jobs.interrupts import DroppedInterrupts
from workflows.jobs.launcher import LaunchError
from workflows.runs.config import load_config, read_raw_config
from workflows.sweeps.sweep_space import PRUNERS, SAMPLERS

if TYPE_CHECKING:
    from workers.spec.cluster import ClusterConfig
    from workflows.cluster.training_cluster import TrainingCluster
    from workflows.observe.tracking import Tracker
    from workflows.runs.run_directory import RunDirectory
    from workflows.sweeps.sweep import SweepRequest, SweepSpec
    from workflows.sweeps.sweep_directory import SweepDirectory

EXIT_FAILED, EXIT_INVALID, EXIT_INTERRUPTED = 1, 2, 130
# After Ctrl-C (or SIGTERM), the run stops its ranks and closes the cluster; should that take
# longer than this (a wait that cannot be interrupted, a worker that does not answer), the
# process exits anyway. The longest bounded cleanup waits are 120 s (letting a store's
# partitions settle) and 60 s (restarting rank workers).
INTERRUPT_EXIT_BOUND_S = 180.0


class _Interrupts:
    """Ctrl-C and SIGTERM (a scheduler's kill, handled alike: stop the ranks, close the
    cluster) become a KeyboardInterrupt in the main thread, and are never lost: one that Python
    drops in a finalizer is raised again (``workflows/jobs/interrupts.py``), one that comes after
    the command's work still makes the exit 130, and whatever else might still hold the
    process, it exits 130 once the bound has passed.
    """

    def __init__(self) -> None:
        self.received = threading.Event()
        self.status: int | None = None  # the command's exit status, once it has one

    def install(self) -> None:
        signal.signal(signal.SIGINT, self._handle)
        signal.signal(signal.SIGTERM, self._handle)
        DroppedInterrupts(only_if=self.received.is_set).install()
        # Exit hooks run last registered first: this one runs after those registered while the
        # command ran (the fork server's stop), before those modules registered on import
        # (logging's, Dask's, multiprocessing's), which it skips; see _end_process.
        atexit.register(self._end_process)

    def _handle(self, signum: int, frame: object) -> None:
        if not self.received.is_set():
            self.received.set()
            threading.Thread(target=self._after, name="dask-train-exit", daemon=True).start()
        if self.status is None:  # the command still runs: stop it
            raise KeyboardInterrupt
        # Past the command, in the exit hooks: raised there, Python would print it as an
        # ignored exception and exit 0. _end_process makes it 130.

    def _end_process(self) -> NoReturn:
        """The process's last step. A signal that came once the command was done (its results
        written, the exit hooks running) still makes the exit 130; and the interpreter's
        finalization is skipped. Python puts its default signal handlers back for it, so a
        Ctrl-C landing there killed the process by SIGINT instead of exiting 130; and its
        garbage collection, scanning every object torch, Dask and pydantic made, took 1.0-1.2 s
        of every command's exit, measured here. By now the command has closed what it opened,
        threads are joined, and the exit hooks it skips have nothing left to do: the clusters
        are closed (context managers) with their workers, and every log handler flushed each
        record as it came."""
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        late = bool(signal.sigpending() & {signal.SIGINT, signal.SIGTERM})
        status = EXIT_FAILED if self.status is None else self.status
        if (self.received.is_set() or late) and status != EXIT_INTERRUPTED:
            with contextlib.suppress(OSError):
                os.write(2, b"dask-train: interrupted\n")
            status = EXIT_INTERRUPTED
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):  # a reader gone away: nothing to flush to
                stream.flush()
        os._exit(status)

    def _after(self) -> None:
        time.sleep(INTERRUPT_EXIT_BOUND_S)
        os.write(
            2,
            f"dask-train: interrupted; shutting down took over {INTERRUPT_EXIT_BOUND_S:g} s, "
            "exiting now\n".encode(),
        )
        os._exit(EXIT_INTERRUPTED)


class _Command(click.Group):
    """The group, run so that Ctrl-C anywhere (argument parsing included, where click would
    make it exit 1) exits 130."""

    def main(  # type: ignore[override]
        self,
        args: list[str] | None = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        **extra: Any,
    ) -> Any:
        if not standalone_mode:  # called from Python: the caller owns signals and errors
            return super().main(args, prog_name, complete_var, False, **extra)
        interrupts = _Interrupts()
        interrupts.install()
        try:
            self._run(args, prog_name, complete_var, **extra)
        except SystemExit as done:
            interrupts.status = _exit_status(done)
            raise
        except BaseException:
            interrupts.status = EXIT_FAILED  # Python prints the traceback and exits 1
            raise

    def _run(
        self, args: list[str] | None, prog_name: str | None, complete_var: str | None, **extra: Any
    ) -> NoReturn:
        try:
            code = super().main(args, prog_name, complete_var, False, **extra)
        except click.ClickException as error:
            error.show()
            sys.exit(error.exit_code)
        except click.Abort as error:
            if isinstance(error.__cause__, KeyboardInterrupt):
                _fail(EXIT_INTERRUPTED, "interrupted")
            _echo("Aborted!", err=True)
            sys.exit(EXIT_FAILED)
        except KeyboardInterrupt:
            _fail(EXIT_INTERRUPTED, "interrupted")
        except OSError as error:
            if error.errno != errno.EPIPE:
                raise
            sys.exit(EXIT_FAILED)  # the reader of our output went away
        sys.exit(code if isinstance(code, int) else 0)


def _exit_status(done: SystemExit) -> int:
    """The status Python exits with for ``done``: None is 0; a message is printed, and is 1."""
    if done.code is None:
        return 0
    return done.code if isinstance(done.code, int) else EXIT_FAILED


@click.group(cls=_Command)
@click.option("-v", "--verbose", is_flag=True, help="log the launcher's steps")
def main(verbose: bool) -> None:
    """Train PyTorch models on a Dask cluster."""
    # The root logger passes INFO on (a run directory's run.log keeps it); the terminal shows
    # warnings only, unless --verbose.
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    for handler in logging.getLogger().handlers:
        handler.setLevel(logging.INFO if verbose else logging.WARNING)
        handler.addFilter(RedactingFilter())


# The config reader checks the file itself, so every problem with it is one line naming it.
config_argument = click.argument("config", type=click.Path(path_type=Path, readable=False))
set_option = click.option(
    "--set",
    "overrides",
    multiple=True,
    metavar="SECTION.KEY=VALUE",
    help="override one config value (repeatable)",
)


class WorldSize(click.ParamType):
    """``--world-size``: a number of ranks, or ``MIN:MAX`` for an elastic job."""

    name = "N|MIN:MAX"

    def convert(self, value: Any, param: Any, ctx: Any) -> int | tuple[int, int] | None:
        from workers.spec.launch import parse_world_size

        try:
            return parse_world_size(value)
        except ValueError as error:
            self.fail(str(error).removeprefix("launch.world_size: "), param, ctx)


world_size_option = click.option(
    "--world-size",
    type=WorldSize(),
    help="ranks, or MIN:MAX for an elastic job that shrinks and grows as workers come and go "
    "(default: every worker)",
)
scheduler_option = click.option(
    "--scheduler", metavar="ADDRESS", help="run on an existing Dask cluster (tcp:// or tls://)"
)
scheduler_file_option = click.option(
    "--scheduler-file",
    metavar="PATH",
    help="run on the existing Dask cluster whose scheduler wrote PATH (--scheduler-file)",
)


def _load(
    config: Path,
    overrides: tuple[str, ...],
    scheduler: str | None = None,
    scheduler_file: str | None = None,
) -> RunConfig:
    """CONFIG with its ``--set`` overrides and the command's cluster options, validated once."""
    return _validated(_read(config, overrides, scheduler, scheduler_file))


def _read(
    config: Path,
    overrides: tuple[str, ...],
    scheduler: str | None = None,
    scheduler_file: str | None = None,
    *,
    world_size: int | tuple[int, int] | None = None,
    step_records: bool = False,
) -> dict[str, Any]:
    """CONFIG's sections with the overrides and the command's options applied, not yet
    validated. ``step_records``: a progress bar is fed by step records, so
    ``training.log_every_steps`` is 5 unless the config sets it."""
    try:
        raw = read_raw_config(config, overrides, overrides_named="--set")
    except ConfigError as error:
        _fail(EXIT_INVALID, f"invalid config: {error}")
    cluster = raw.get("cluster", {})
    if (scheduler or scheduler_file) and isinstance(cluster, dict):
        # An existing cluster replaces the config's cluster, sizing included; both options
        # at once are refused by the config's own check. (A cluster that is no table is
        # refused by validation, naming it.)
        raw["cluster"] = cluster | {
            "scheduler": scheduler,
            "scheduler_file": scheduler_file,
            "n_workers": None,
        }
    if world_size is not None and isinstance(raw.get("launch", {}), dict):
        raw["launch"] = raw.get("launch", {}) | {"world_size": world_size}
    training = raw.get("training", {})
    if step_records and isinstance(training, dict) and not training.get("log_every_steps"):
        raw["training"] = {**training, "log_every_steps": 5}
    return raw


def _validated(raw: dict[str, Any]) -> RunConfig:
    try:
        return load_config(raw)
    except ConfigError as error:
        _fail(EXIT_INVALID, f"invalid config: {error}")


def _before_torch(config: RunConfig, *, check_data: bool = True) -> None:
    """What is done before this process imports torch. A missing data.root is told now, not
    once a cluster has started (seconds later). The local workers' fork server starts
    importing torch, beside this process's own import: on two cores a local cluster is then up
    ~3 s sooner (measured: 5.7 s to start cold)."""
    from workflows.cluster.training_cluster import start_fork_server_early

    try:
        if check_data:
            check_root(config.data.resolved())
    except SourceError as error:
        _fail(EXIT_INVALID, str(error))
    start_fork_server_early(config.cluster)


def _echo(message: object = None, **options: Any) -> None:
    """click.echo, with every secret masked (workers/spec/secrets.py)."""
    click.echo(None if message is None else redact(str(message)), **options)


def _fail(code: int, message: str) -> NoReturn:
    _echo(f"dask-train: {message}", err=True)
    sys.exit(code)


@contextlib.contextmanager
def _exit_codes(
    action: str,
    *invalid: type[Exception],
    interrupted: str | Callable[[], str] = "interrupted",
) -> Iterator[None]:
    """Turn what goes wrong inside into the exit code and the one line a scheduler acts on.
    ``interrupted`` may be a function: what to say can depend on when the interrupt came."""
    try:
        yield
    except KeyboardInterrupt:
        _fail(EXIT_INTERRUPTED, interrupted() if callable(interrupted) else interrupted)
    except (ConfigError, SourceError, ConnectionError, *invalid) as error:
        _fail(EXIT_INVALID, str(error))
    except Exception as error:
        logging.getLogger(__name__).debug("%s failed", action, exc_info=True)
        _fail(EXIT_FAILED, f"{action} failed: {type(error).__name__}: {error}")


def _echo_dashboard(cluster: "TrainingCluster") -> None:
    """The dashboard's link, and its Training page's (served from now on)."""
    from workflows.observe.monitoring import serve_training_page

    page = serve_training_page(cluster.client)
    _echo(f"dashboard: {cluster.dashboard_link}")
    if page:
        _echo(f"training page: {page}")


def _open_tracker(config: RunConfig, run_directory: "RunDirectory", resume: bool) -> "Tracker":
    """The run's TensorBoard folder and MLflow run; a resumed run continues its MLflow run."""
    from workflows.observe.tracking import Tracker

    return Tracker.open(
        config.tracking,
        config.model_dump(mode="json"),
        run_dir=run_directory.path,
        resume=resume,
        resume_step=run_directory.resumes_from if resume else None,
    )


def _start_cluster(config: "ClusterConfig") -> "TrainingCluster":
    """The command's cluster. A local one's workers write to this terminal: Dask's "Compute
    Failed" blocks for our own errors are kept off it (the error is said once, as the
    command's last line; the worker's own log keeps them)."""
    from workers.user_errors import UserErrorsOffStderr
    from workflows.cluster.training_cluster import start_cluster

    cluster = start_cluster(config)
    if cluster.cluster is not None:
        try:
            cluster.client.register_plugin(UserErrorsOffStderr())
        except BaseException:
            cluster.close()
            raise
    return cluster


@contextlib.contextmanager
def _cluster_for(run_directory: "RunDirectory", config: RunConfig) -> Iterator["TrainingCluster"]:
    """The run's cluster. One that cannot start (an unreachable scheduler, say) gives the new
    directory back: nothing ran, so the same command may run again, without --resume."""
    try:
        cluster = _start_cluster(config.cluster)
    except Exception:
        run_directory.release()
        raise
    with cluster:
        yield cluster


@main.command()
@config_argument
@set_option
def validate(config: Path, overrides: tuple[str, ...]) -> None:
    """Check CONFIG and print it resolved, without starting anything."""
    resolved = _load(config, overrides)
    training = resolved.training
    if (
        not resolved.model.builtin
        or training.loss not in LOSSES
        or not training.checked_without_torch
    ):
        # Code named by import path, torchvision or timm: import it and build the model once
        # on the meta device, and the optimizer (this imports torch, which built-in models
        # and optimizers never need here).
        from workflows.data.stores import read_manifest
        from workflows.runs.config import check_model

        data = resolved.data.resolved()
        manifest = read_manifest(data.store_url, storage_options=data.storage_options)
        try:
            check_model(resolved, num_classes=len(manifest["classes"]) if manifest else 10)
        except ConfigError as error:
            _fail(EXIT_INVALID, f"invalid config: {error}")
    _echo(resolved.model_dump_json(indent=2))


@main.command()
@config_argument
@set_option
@scheduler_option
@scheduler_file_option
@click.option("--force", is_flag=True, help="rebuild the store even if it is up to date")
def preprocess(
    config: Path,
    overrides: tuple[str, ...],
    scheduler: str | None,
    scheduler_file: str | None,
    force: bool,
) -> None:
    """Build CONFIG's dataset store as Dask tasks (or confirm it is up to date)."""
    resolved = _load(config, overrides, scheduler, scheduler_file)  # before torch's import
    try:
        store_to_build(resolved.data.dataset)
    except SourceError as error:
        _fail(EXIT_INVALID, str(error))
    _before_torch(resolved)
    from workflows.data.preprocess import prepare_store

    with _exit_codes("preprocessing"), _start_cluster(resolved.cluster) as cluster:
        _echo(f"dashboard: {cluster.dashboard_link}")
        manifest = prepare_store(
            cluster.client, resolved.data.resolved(), seed=resolved.training.seed, force=force
        )
    state = "up to date, reused" if manifest.reused else f"built in {manifest.seconds:.1f} s"
    _echo(
        f"store {manifest.url}: {state}; train {manifest.counts['train']}, "
        f"val {manifest.counts['val']} images; {len(manifest.bad_records)} bad records skipped"
    )


@main.command()
@config_argument
@set_option
@scheduler_option
@scheduler_file_option
def plan(
    config: Path, overrides: tuple[str, ...], scheduler: str | None, scheduler_file: str | None
) -> None:
    """Profile CONFIG's model on a worker; print the stage split and the strategy that fits."""
    resolved = _load(config, overrides, scheduler, scheduler_file)  # before torch's import
    _before_torch(resolved, check_data=False)  # the store's classes, if there is one yet
    from workflows.data.stores import read_manifest
    from workflows.runs.planner import plan as plan_stages
    from workflows.runs.resolved_run import resolve_run

    data = resolved.data.resolved()
    manifest = read_manifest(data.store_url, storage_options=data.storage_options)
    # The class count only sizes the last layer; before preprocessing, assume CIFAR-10's.
    num_classes = len(manifest["classes"]) if manifest else 10
    # A ValueError here is the planner's: the model does not fit the stages it is given.
    with _exit_codes("planning", ValueError), _start_cluster(resolved.cluster) as cluster:
        run = resolve_run(cluster.client, resolved)
        # A run writes checkpoints (dask-train run: into its run directory): their copies count.
        result = plan_stages(cluster.client, run, num_classes=num_classes, checkpointed=True)
    _echo(
        f"{resolved.model.name} on {run.layout.world_size} workers, global batch "
        f"{resolved.training.batch_size}"
    )
    _echo(result.render())


@main.command()
@config_argument
@set_option
@world_size_option
@scheduler_option
@scheduler_file_option
@click.option(
    "--output",
    metavar="DIR|URL",
    help="the run directory (default runs/<name>-<UTC time>), or an fsspec URL "
    "(s3://bucket/runs/x) to keep it in object storage; must not hold a run already",
)
@click.option(
    "--resume",
    is_flag=True,
    help="continue the run in --output DIR from its newest good checkpoint",
)
def run(
    config: Path,
    overrides: tuple[str, ...],
    world_size: int | tuple[int, int] | None,
    scheduler: str | None,
    scheduler_file: str | None,
    output: str | None,
    resume: bool,
) -> None:
    """Train as CONFIG says: one line per epoch, results in the run directory."""
    # The config first: a mistyped path or field is told at once, not after importing torch.
    terminal = sys.stdout.isatty()  # a progress bar, fed by step records
    raw = _read(
        config, overrides, scheduler, scheduler_file, world_size=world_size, step_records=terminal
    )
    progress = _progress_bar() if terminal else None
    from workflows.runs.run_directory import RunDirectory

    try:  # validated once, with the run directory's folders filled in
        run_directory = RunDirectory.open(raw, output, resume=resume)
    except (ConfigError, OSError) as error:
        _fail(EXIT_INVALID, str(error))
    if run_directory.finished is not None:
        # Training again would redo nothing and overwrite the run's figures with those of an
        # empty attempt: the directory is left exactly as it is.
        _echo_finished(run_directory)
        return
    resolved = run_directory.config
    _before_torch(resolved)
    from workflows.jobs.collections import DataError
    from workflows.observe.tracking import TrackingError
    from workflows.runs.driver import train

    on_event = _run_events(run_directory, progress)
    failures = (LaunchError, TrackingError, DataError)
    # The directory is written before the cluster starts, and named only once written: a run
    # stopped from then on, even while its cluster starts, is one that --resume continues.
    with _exit_codes("training", *failures, interrupted=_interrupted(run_directory)), run_directory:
        _echo(f"run directory: {run_directory.location}")
        with (
            _cluster_for(run_directory, resolved) as cluster,
            _open_tracker(resolved, run_directory, resume).closing() as tracker,
        ):
            _echo_dashboard(cluster)
            with run_directory.attempt():
                result = train(resolved, cluster=cluster, on_event=on_event, tracker=tracker)
                summary = run_directory.finish(result)
            outputs = [run_directory.path / "model.pt", run_directory.path / "summary.json"]
            tracker.finish(summary, outputs)
    final = summary["final"]
    # The task's headline figure: accuracy, or R² for regression.
    headline = "val_accuracy" if "val_accuracy" in final else "val_r2"
    _echo(
        f"done: {summary['strategy']} on {summary['world_size']} ranks, "
        f"{headline.replace('_', ' ')} {final[headline]:.4f}, "
        f"{summary['samples_per_s']:.0f} samples/s, {summary['wall_s']:.1f} s; results in "
        f"{run_directory.location}"
    )


def _progress_bar() -> Callable[[dict], None]:
    """A terminal's progress bar, fed by step records (under cron, with no terminal, only
    epoch lines are written)."""
    from workflows.runs.progress import EpochProgress

    return EpochProgress(file=sys.stdout)


def _echo_finished(run_directory: "RunDirectory") -> None:
    done = run_directory.finished or {}
    _echo(
        f"{run_directory.location} finished already ({done.get('steps')} steps, "
        f"{done.get('samples_per_s') or 0:.0f} samples/s, {done.get('wall_s') or 0:.1f} s): "
        "nothing to resume"
    )


def _run_events(
    run_directory: "RunDirectory", progress: Callable[[dict], None] | None
) -> Callable[[dict], None]:
    """Each record into the run directory, then to the progress bar, or as an epoch line."""
    from workflows.runs.driver import print_progress

    def on_event(record: dict) -> None:
        run_directory.record(record)
        if progress:
            progress(record)
        else:
            print_progress(record)

    return on_event


def _interrupted(run_directory: "RunDirectory") -> Callable[[], str]:
    """What an interrupt says, asked when it comes: --resume is offered only for a directory
    it takes."""

    def interrupted() -> str:
        path = run_directory.location
        if not run_directory.claimed:
            return f"interrupted before the run started; nothing was written to {path}"
        return f"interrupted; partial results in {path}; continue with --output {path} --resume"

    return interrupted


@main.command()
@config_argument
@set_option
@click.option(
    "--model",
    required=True,
    metavar="RUN_DIR_OR_CHECKPOINT",
    help="a run directory (dask-train run), or a checkpoint that CONFIG describes",
)
@click.option(
    "--input",
    "input_path",
    required=True,
    metavar="DATA",
    help="a dataset store, an image folder, or CIFAR-10's test batch",
)
@click.option(
    "--output",
    required=True,
    metavar="PATH",
    help="where predictions, metrics and summary go; must not exist",
)
@click.option("--scheduler", metavar="ADDRESS", help="run on an existing Dask cluster")
@click.option(
    "--trust-config",
    is_flag=True,
    help="build the model that the run's config.json names by import path (its code runs "
    "here and on the workers): only for a run you trust",
)
def predict(
    config: Path,
    overrides: tuple[str, ...],
    model: str,
    input_path: str,
    output: str,
    scheduler: str | None,
    trust_config: bool,
) -> None:
    """Score DATA with a trained model as Dask tasks; predictions and metrics go to PATH.

    CONFIG's [predict] section (or --set predict.KEY=VALUE) sets batch_size, precision,
    outputs, format and the rest.
    """
    from workflows.prediction.batch_predict import (
        CheckpointError,
        load_predict_config,
        prepare,
        run_prepared,
    )

    # Everything about the request is checked before a cluster starts.
    try:
        run_config, settings = load_predict_config(_read(config, overrides, scheduler))
        prepared = prepare(
            model=model,
            input=input_path,
            output=output,
            config=run_config,
            settings=settings,
            trust_config=trust_config,
        )
    except (ConfigError, CheckpointError, SourceError) as error:
        _fail(EXIT_INVALID, str(error))
    plan = prepared.plan
    interrupted = f"interrupted; partial output in {prepared.output}"
    with (
        _exit_codes("prediction", CheckpointError, interrupted=interrupted),
        _start_cluster(prepared.cluster) as cluster,
    ):
        _echo(f"dashboard: {cluster.dashboard_link}")
        _echo(
            f"scoring {plan.count} images ({plan.kind} {plan.url}) in "
            f"{len(plan.partitions)} partitions"
        )
        result = run_prepared(cluster.client, prepared)
    for note in result.notes:
        _echo(f"note: {note}")
    accuracy = f", accuracy {result.metrics['accuracy']:.4f}" if result.metrics else ""
    _echo(
        f"done: {result.count} predictions on {result.workers} workers, "
        f"{result.images_per_s:.0f} images/s, {result.seconds:.1f} s{accuracy}; "
        f"results in {result.output}"
    )


def _parse_params(ctx: click.Context, param: click.Parameter, values: tuple[str, ...]) -> dict:
    """``--param KEY=SPEC`` options as a space; a bad one is a usage error naming it."""
    from workflows.sweeps.sweep_space import parse_param

    space: dict[str, Any] = {}
    for text in values:
        try:
            key, form = parse_param(text)
        except ValueError as error:
            raise click.BadParameter(str(error)) from None
        if key in space:
            raise click.BadParameter(f"{key!r} is given twice")
        space[key] = form
    return space


@main.command("sweep")
@config_argument
@set_option
@click.option(
    "--param",
    "space",
    multiple=True,
    required=True,
    callback=_parse_params,
    metavar="KEY=SPEC",
    help="a config value to sweep and its range: log:1e-4:1e-1 (log-uniform), 0.0:0.5 "
    "(uniform), int:1:8, or choices 32,64,128 (repeatable)",
)
@click.option(
    "--trials",
    "n_trials",
    type=click.IntRange(min=1),
    required=True,
    help="trials in the study, those of an earlier start counted",
)
@click.option("--metric", default="val_loss", show_default=True, help="an epoch figure")
@click.option("--mode", type=click.Choice(["min", "max"]), default="min", show_default=True)
@click.option(
    "--trial-world-size",
    type=click.IntRange(min=1),
    help="ranks per trial (default: the config's launch.world_size, else 1)",
)
@click.option(
    "--max-concurrent",
    type=click.IntRange(min=1),
    help="trials at once (default: the workers over --trial-world-size)",
)
@click.option("--sampler", type=click.Choice(SAMPLERS), default="tpe", show_default=True)
@click.option("--pruner", type=click.Choice(PRUNERS), help="stop trials that fall behind")
@click.option(
    "--storage",
    metavar="URL_OR_PATH",
    help="sqlite:///runs/sweep.db or a journal file (*.log, *.jsonl; also in object storage, "
    "s3://bucket/sweeps/study.log), whose study the same command again continues; default: "
    "study.jsonl in the sweep's directory",
)
@click.option(
    "--study-name",
    metavar="NAME",
    help="default: <config name>-sweep with --storage (another name starts a fresh study), "
    "else the sweep directory's name",
)
@click.option(
    "--output",
    type=click.Path(path_type=Path, file_okay=False),
    help="the sweep's directory (default runs/<name>-sweep-<UTC time>); an earlier one "
    "continues its study",
)
@scheduler_option
def sweep(
    config: Path,
    overrides: tuple[str, ...],
    space: dict[str, Any],
    n_trials: int,
    metric: str,
    mode: str,
    trial_world_size: int | None,
    max_concurrent: int | None,
    sampler: str,
    pruner: str | None,
    storage: str | None,
    study_name: str | None,
    output: Path | None,
    scheduler: str | None,
) -> None:
    """Sweep CONFIG's values: one training run per trial, chosen by Optuna, several at once;
    trials.csv and best.json in the sweep's directory."""
    resolved = _load(config, overrides, scheduler)
    _before_torch(resolved)
    directory = _sweep_directory(resolved.name, output, study_name, storage)
    from workflows.sweeps.sweep import SweepRequest, run_sweep

    request = SweepRequest(
        resolved,
        space,
        n_trials=n_trials,
        metric=metric,
        mode=mode,
        trial_world_size=trial_world_size,
        max_concurrent=max_concurrent,
        sampler=sampler,
        pruner=pruner,
        storage=directory.storage,
        study_name=directory.study_name,
        checkpoint_dir=None if resolved.checkpoint.directory else directory.checkpoints,
    )
    spec = _checked_sweep(request, directory, own_storage=storage)
    if spec is None:  # the same command again: no cluster, no sweep directory, nothing run
        return
    interrupted = f"interrupted; continue the sweep with --output {directory.path}"
    with (
        _exit_codes("sweep", interrupted=interrupted),
        _start_cluster(resolved.cluster) as cluster,
    ):
        _echo(f"sweep directory: {directory.path}")
        _echo_dashboard(cluster)
        result = run_sweep(spec, cluster=cluster, on_trial=_trial_line(metric))
        directory.write_results(result, metric=metric, mode=mode)
    if result.best_trial is None:
        _fail(EXIT_FAILED, f"sweep failed: no trial completed; see {directory.path / 'trials.csv'}")
    best = result.best_trial
    _echo(
        f"done: best trial {best.number}, {metric} {best.value:.4f}, {_described(best.params)}; "
        f"results in {directory.path}"
    )


def _sweep_directory(
    name: str, output: Path | None, study_name: str | None, storage: str | None
) -> "SweepDirectory":
    """The sweep's directory: ``--output``, or a new one named after the config."""
    from workflows.runs.run_storage import checked_url
    from workflows.sweeps.sweep_directory import SweepDirectory

    try:
        if output is not None:  # a folder here: a URL there is a typo (Path made s3:// s3:/)
            output = Path(checked_url("--output", str(output)))
        return SweepDirectory.open(name, output, study_name=study_name, storage=storage)
    except ConfigError as error:
        _fail(EXIT_INVALID, str(error))


def _checked_sweep(
    request: "SweepRequest", directory: "SweepDirectory", own_storage: str | None
) -> "SweepSpec | None":
    """The sweep checked before its cluster starts, and its request written into its
    directory; None when the study in ``--storage`` (``own_storage``) finished already,
    which is said."""
    from workflows.sweeps.sweep import finished_study, sweep_spec

    written = {
        "config": request.target.model_dump(mode="json"),
        "space": request.space,
        "n_trials": request.n_trials,
        "metric": request.metric,
        "mode": request.mode,
        "trial_world_size": request.trial_world_size,
        "sampler": request.sampler,
        "pruner": request.pruner,
    }
    _quiet_optuna()
    finished = None
    try:
        if own_storage is None:  # written first: the study is a journal file in the directory
            directory.write_request(written)
        spec = sweep_spec(request)
        if own_storage is not None:  # a study of its own storage may be done already
            finished = finished_study(spec)
            if finished is None:
                directory.write_request(written)
    except (ValueError, ImportError, OSError) as error:
        directory.release()
        _fail(EXIT_INVALID, str(error))
    if finished is None:
        return spec
    best = finished.best_trial
    outcome = (
        f"best trial {best.number}, {request.metric} {best.value:.4f}, {_described(best.params)}"
        if best is not None
        else "no trial completed"
    )
    _echo(
        f"study {directory.study_name} in {own_storage} finished already "
        f"({len(finished.trials)} trials; {outcome}): nothing to run; more --trials continue it, "
        "another --study-name starts a fresh one"
    )
    return None


def _quiet_optuna() -> None:
    """The sweep prints one line per trial; Optuna's own line for each would double them."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)


def _described(params: dict[str, Any]) -> str:
    return ", ".join(
        f"{key}={value:.4g}" if isinstance(value, float) else f"{key}={value}"
        for key, value in params.items()
    )


def _trial_line(metric: str) -> Callable[[dict[str, Any]], None]:
    def echo(record: dict[str, Any]) -> None:
        if record["state"] == "RUNNING":
            return
        value = record["value"]
        figure = f"{metric} {value:.4f}" if value is not None else record.get("error", "")
        _echo(
            f"trial {record['number']} {record['state']}: {figure}, "
            f"{_described(record['params'])} ({record['wall_s']:.1f} s)"
        )

    return echo


@main.command(
    context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False},
)
@world_size_option
@scheduler_option
@scheduler_file_option
@click.option(
    "--max-restarts",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="restart every rank this many times after a failure, as torchrun does",
)
@click.option(
    "--output",
    type=click.Path(path_type=Path, file_okay=False),
    help="a folder for the run's output.log, metrics.jsonl and summary.json (and a "
    "function's checkpoints/); must not hold a run already",
)
@click.option(
    "--resume",
    is_flag=True,
    help="continue the run in --output DIR (a function from its newest checkpoint)",
)
@click.option("-m", "module", is_flag=True, help="SCRIPT is a module name (python -m)")
@click.argument("script")
@click.argument("script_args", nargs=-1, type=click.UNPROCESSED)
def launch(
    world_size: int | tuple[int, int] | None,
    scheduler: str | None,
    scheduler_file: str | None,
    max_restarts: int,
    output: Path | None,
    resume: bool,
    module: bool,
    script: str,
    script_args: tuple[str, ...],
) -> None:
    """Run SCRIPT on every rank, as torchrun would: an unmodified script that calls
    init_process_group() from the environment, ``-m package.module``, or
    ``package.module:function`` (called with a rank context, through the Python API)."""
    from workers.spec.cluster import ClusterConfig
    from workers.spec.launch import LaunchConfig
    from workflows.cluster.training_cluster import start_fork_server_early

    try:
        cluster = ClusterConfig(scheduler=scheduler, scheduler_file=scheduler_file, n_workers=None)
        if not cluster.existing and world_size is not None:
            # An elastic range starts its own cluster at the range's top.
            most = world_size[1] if isinstance(world_size, tuple) else world_size
            cluster = ClusterConfig(n_workers=most)
        settings = LaunchConfig(world_size=world_size, max_failures=max_restarts)
    except ValueError as error:
        _fail(EXIT_INVALID, str(error).splitlines()[0])
    # The workers' imports go on beside ours (torch, and the target's); a target refused below
    # stops the fork server at exit.
    start_fork_server_early(cluster)
    from workflows.jobs.script_launch import (
        LaunchTarget,
        ScriptNotFound,
        check_output,
        launch_script,
        resolve_target,
    )
    from workflows.runs.run_storage import checked_url

    # The current folder's modules are importable, as under `python -m` and torchrun (the
    # console script's own folder is the one Python put first); workers that cannot import
    # them get them shipped (workflows/jobs/code_shipping.py).
    if not {"", os.getcwd()} & set(sys.path):
        sys.path.insert(0, os.getcwd())
    try:
        resolve_target(script, module=module)  # a missing script fails before a cluster starts
        if resume and output is None:
            raise ConfigError("--resume: name the run's folder to continue with --output DIR")
        finished = None
        if output is not None:  # a folder: a URL there is a typo (Path made s3:// s3:/)
            output = Path(checked_url("--output", str(output)))
            finished = check_output(output, resume=resume, target=script, args=script_args)
    except (ValueError, ScriptNotFound) as error:
        _fail(EXIT_INVALID, str(error).splitlines()[0])
    if finished is not None:
        _echo(
            f"{output} finished already ({finished.get('world_size')} ranks, "
            f"{finished.get('wall_s') or 0:.1f} s): nothing to resume"
        )
        return
    with _exit_codes("launch", LaunchError, interrupted="interrupted; every rank was stopped"):
        result = launch_script(
            LaunchTarget(script, script_args, module=module),
            cluster=cluster,
            launch_config=settings,
            output=output,
            echo=_echo,
        )
    restarts = f", {len(result.recoveries)} restarts" if result.recoveries else ""
    _echo(f"done: {result.world_size} ranks exited 0 in {result.wall_s:.1f} s{restarts}")


if __name__ == "__main__":  # python -m workflows.cli, as the dask-train script
    main()
