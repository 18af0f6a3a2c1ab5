"""``dask-train``: the batch entry point.

Exit codes a scheduler can act on: 0 success, 2 invalid config or arguments (one line, no
traceback), 1 training failure, 130 interrupted.
"""

import logging
import sys
from pathlib import Path

import click

from workers.sources import SourceError
from workflows.config import ConfigError, RunConfig, load_config
from workflows.launcher import LaunchError

EXIT_FAILED, EXIT_INVALID, EXIT_INTERRUPTED = 1, 2, 130


@click.group()
@click.option("-v", "--verbose", is_flag=True, help="log the launcher's steps")
def main(verbose: bool) -> None:
    """Train PyTorch models on a Dask cluster."""
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


config_argument = click.argument("config", type=click.Path(path_type=Path))
set_option = click.option(
    "--set",
    "overrides",
    multiple=True,
    metavar="SECTION.KEY=VALUE",
    help="override one config value (repeatable)",
)


def _load(config: Path, overrides: tuple[str, ...], scheduler: str | None = None) -> RunConfig:
    try:
        if scheduler:
            overrides = (*overrides, f"cluster.scheduler={scheduler!r}")
        return load_config(config, overrides)
    except ConfigError as error:
        _fail(EXIT_INVALID, f"invalid config: {error}")


def _fail(code: int, message: str) -> None:
    click.echo(f"dask-train: {message}", err=True)
    sys.exit(code)


@main.command()
@config_argument
@set_option
def validate(config: Path, overrides: tuple[str, ...]) -> None:
    """Check CONFIG and print it resolved, without starting anything."""
    resolved = _load(config, overrides)
    click.echo(resolved.model_dump_json(indent=2))


@main.command()
@config_argument
@set_option
@click.option("--scheduler", metavar="ADDRESS", help="run on an existing Dask cluster")
@click.option("--force", is_flag=True, help="rebuild the store even if it is up to date")
def preprocess(
    config: Path, overrides: tuple[str, ...], scheduler: str | None, force: bool
) -> None:
    """Build CONFIG's dataset store as Dask tasks (or confirm it is up to date)."""
    from workflows.cluster import start_cluster
    from workflows.preprocess import prepare_store

    resolved = _load(config, overrides, scheduler)
    try:
        with start_cluster(resolved.cluster) as cluster:
            click.echo(f"dashboard: {cluster.dashboard_link}")
            manifest = prepare_store(
                cluster.client, resolved.data.resolved(), seed=resolved.training.seed, force=force
            )
    except KeyboardInterrupt:
        _fail(EXIT_INTERRUPTED, "interrupted")
    except (ConfigError, SourceError, ConnectionError) as error:
        _fail(EXIT_INVALID, str(error))
    except Exception as error:
        _fail(EXIT_FAILED, f"preprocessing failed: {type(error).__name__}: {error}")
    state = "up to date, reused" if manifest.reused else f"built in {manifest.seconds:.1f} s"
    click.echo(
        f"store {manifest.url}: {state}; train {manifest.counts['train']}, "
        f"val {manifest.counts['val']} images; {len(manifest.bad_records)} bad records skipped"
    )


@main.command()
@config_argument
@set_option
@click.option("--scheduler", metavar="ADDRESS", help="run on an existing Dask cluster")
def run(config: Path, overrides: tuple[str, ...], scheduler: str | None) -> None:
    """Train as CONFIG says and print one line per epoch."""
    from workflows.cluster import start_cluster
    from workflows.driver import train

    resolved = _load(config, overrides, scheduler)
    try:
        with start_cluster(resolved.cluster) as cluster:
            click.echo(f"dashboard: {cluster.dashboard_link}")
            result = train(resolved, cluster=cluster)
    except KeyboardInterrupt:
        _fail(EXIT_INTERRUPTED, "interrupted")
    except (ConfigError, LaunchError, SourceError, ConnectionError) as error:
        _fail(EXIT_INVALID, str(error))
    except Exception as error:
        logging.getLogger(__name__).debug("training failed", exc_info=True)
        _fail(EXIT_FAILED, f"training failed: {type(error).__name__}: {error}")
    final = result.final
    click.echo(
        f"done: {result.strategy} on {result.world_size} ranks, val accuracy "
        f"{final['val_accuracy']:.4f}, {result.steady_samples_per_s:.0f} samples/s, "
        f"{result.wall_s:.1f} s"
    )
