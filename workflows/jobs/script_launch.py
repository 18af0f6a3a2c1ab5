"""``dask-train launch``: an unmodified torchrun script, a module or a function on the cluster.

The script runs as a child process of each chosen worker (see ``workers.script_runner``),
through the same :func:`workflows.launch` as every other job: rank assignment, restarts,
events and the dashboard are the same. Its output comes back prefixed by rank.
"""

import hashlib
import importlib
import importlib.util
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from workers.records import OutputRecord, ResumedRecord, parse_record
from workers.script_runner import ScriptResult, ScriptSpec, run_script
from workers.spec.cluster import ClusterConfig
from workers.spec.errors import ConfigError
from workers.spec.launch import LaunchConfig
from workflows.cluster.training_cluster import start_cluster
from workflows.jobs.code_shipping import ship_modules
from workflows.jobs.launch import LaunchResult, launch_on
from workflows.jobs.request import JobRequest
from workflows.observe.metrics_file import MetricsFile


class ScriptNotFound(ValueError):
    """The script, module or function to launch does not exist here."""


# What a launch writes into its --output folder; any of them there means the folder holds a run.
METRICS = "metrics.jsonl"
RUN_FILES = ("output.log", METRICS, "summary.json")
SUMMARY = "summary.json"
# Whose checkpoints an --output folder's are (workers/checkpoint.py names a run in each
# manifest): the one run the folder holds.
OUTPUT_RUN = "launch-output"


def check_output(
    output: Path, *, resume: bool, target: str, args: tuple[str, ...]
) -> dict[str, Any] | None:
    """Whether ``--output`` may take this launch, as ``run`` decides for its directory: one
    that holds a run is refused unless ``resume`` continues it, and one that holds none has
    nothing to resume. Returns the summary of the same launch (target and arguments) that
    finished there: nothing is left to do then. Other arguments (more steps) continue it.

    Raises:
        ConfigError: The folder may not take it; the message says why and what to do.
    """
    if output.exists() and not output.is_dir():
        raise ConfigError(f"--output: {output} exists and is not a directory")
    held = output.is_dir() and any((output / name).exists() for name in RUN_FILES)
    if held and not resume:
        raise ConfigError(
            f"--output: {output} already holds a run; choose a new directory, or add --resume "
            "to continue it"
        )
    if resume and not held:
        raise ConfigError(f"--resume: {output} holds no run to continue")
    if resume and (output / SUMMARY).exists():
        summary = json.loads((output / SUMMARY).read_text())
        if summary.get("target") == target and summary.get("args") == list(args):
            return summary
    return None


def resolve_target(target: str, *, module: bool) -> tuple[ScriptSpec | None, Callable | None]:
    """What ``dask-train launch TARGET`` means: a script file, ``-m`` a module, or
    ``package.module:function``, a function for the Python API. Checked before anything
    starts."""
    if not module and ":" in target and not Path(target).exists():
        module_name, _, function_name = target.partition(":")
        try:
            function = getattr(importlib.import_module(module_name), function_name)
        except (ImportError, AttributeError) as error:
            raise ScriptNotFound(f"{target}: no function {function_name!r} ({error})") from None
        if not callable(function):
            raise ScriptNotFound(f"{target}: {function_name!r} is not callable")
        return None, function
    if module:
        if importlib.util.find_spec(target.split(".")[0]) is None:
            raise ScriptNotFound(f"-m {target}: no module {target.split('.')[0]!r} here")
        return ScriptSpec(target=target, module=True), None
    path = Path(target)
    if not path.is_file():
        raise ScriptNotFound(f"{target}: no such script")
    source = path.read_bytes()
    return (
        ScriptSpec(
            target=str(path.absolute()),
            source=source,
            sha256=hashlib.sha256(source).hexdigest(),
        ),
        None,
    )


@dataclass(frozen=True)
class LaunchTarget:
    """What ``dask-train launch`` runs: a script file, a module (``module``: ``-m``), or
    ``package.module:function``, and the arguments it is given."""

    target: str
    args: tuple[str, ...] = ()
    module: bool = False


def launch_script(
    target: LaunchTarget,
    *,
    cluster: ClusterConfig,
    launch_config: LaunchConfig,
    output: Path | None = None,
    echo: Callable[[str], None] = print,
) -> LaunchResult:
    """Run ``target`` on every rank; ``output`` (a folder) gets the run's summary and log."""
    called_at = time.time()
    spec, function = resolve_target(target.target, module=target.module)
    stem = Path(target.target).stem or "launch"
    run_id = f"{stem}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}"
    with _RunOutput(output, echo) as run_output, start_cluster(cluster) as training_cluster:
        client = training_cluster.client
        if spec is not None and spec.module:
            ship_modules(client, {spec.target.split(".")[0]})
        if spec is not None:
            spec = replace(spec, args=tuple(target.args), cwd=str(Path.cwd()), run_id=run_id)
        request = JobRequest(
            fn=run_script if spec is not None else function,
            settings=launch_config,
            name=run_id,
            args=(spec,) if spec is not None else target.args,
            # A function's ctx.save: a folder of the run's own, that --resume continues.
            checkpoint_dir=output / "checkpoints" if output and spec is None else None,
            keep_checkpoints=1,
            # The folder holds one run (check_output): its checkpoints are that run's
            # whatever this launch is named, so a --resume finds them.
            run_id=OUTPUT_RUN if output is not None else None,
            # torchrun's contract: any failure of a script restarts it, within the bound.
            retry_code_errors=spec is not None,
            # An elastic script restarts at a resize; a function resizes at ctx.step_done.
            step_boundaries=spec is None,
            final_records=_final_output if spec is not None else None,
            called_at=called_at,
        )
        result = launch_on(client, request, on_event=run_output.on_event)
    if output is not None:
        summary = {
            "target": target.target,
            "args": list(target.args),
            "world_size": result.world_size,
            "attempts": result.attempts,
            "recoveries": result.recoveries,
            "wall_s": result.wall_s,
            "first_step_s": result.first_step_s,
        }
        (output / SUMMARY).write_text(json.dumps(summary, indent=2) + "\n")
    return result


class _RunOutput:
    """Where a launch's records go: its ranks' output to ``echo``, and in ``folder`` (if one is
    given) to ``output.log``, its reports to ``metrics.jsonl``: each rank's step once, as
    ``dask-train run`` keeps its steps (a recovery or a --resume from an older checkpoint
    drops the reports of the steps done again, see ``MetricsFile``)."""

    def __init__(self, folder: Path | None, echo: Callable[[str], None]) -> None:
        self.echo = echo
        if folder is not None:
            folder.mkdir(parents=True, exist_ok=True)
        self.log = (folder / "output.log").open("a", buffering=1) if folder else None
        self.metrics = MetricsFile(folder / METRICS, kinds={"report"}).open() if folder else None

    def on_event(self, record: dict[str, Any]) -> None:
        typed = parse_record(record)
        match typed:
            case OutputRecord(rank=rank, lines=lines):
                text = "".join(f"[rank {rank}] {line}" for line in lines)
                self.echo(text.rstrip("\n"))
                if self.log is not None:
                    self.log.write(text)
            case ResumedRecord() as resumed:
                self.echo(resumed.line())
        if self.metrics is not None:
            self.metrics.append(record, typed)

    def __enter__(self) -> "_RunOutput":
        return self

    def __exit__(self, *exc: object) -> None:
        for file in (self.log, self.metrics):
            if file is not None:
                file.close()


def _final_output(results: list[ScriptResult]) -> list[dict[str, Any]]:
    return [record for result in results for record in result.output]
