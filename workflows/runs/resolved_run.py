"""A run's facts, worked out once on the client before anything starts.

``resolve_run`` turns a validated ``RunConfig`` and the cluster it will run on into a
``ResolvedRun``: its world size (the workers it may hold, unless the config names one), the
layout of its ranks, its data and checkpoint paths made absolute. The driver, the planner and
``dask-train plan`` read the run from here; none of them works the world or the layout out again.
"""

from dataclasses import dataclass, replace

from distributed import Client

from workers.spec.errors import ConfigError
from workers.spec.launch import LaunchConfig
from workers.spec.layout import Layout
from workers.spec.run import RunConfig
from workers.spec.sections import DataConfig
from workflows.jobs.launcher import ranks_for


@dataclass(frozen=True)
class ResolvedRun:
    """One run's facts, worked out once on the client before anything starts; every step after
    reads them here rather than working them out again."""

    config: RunConfig  # its data and checkpoint paths absolute
    layout: Layout  # its world size among the rest (an elastic run's: at the range's top)
    launch: LaunchConfig  # [launch] with the world size
    store_named: bool  # whether the config names data.store (else it is the dataset's default)
    layouts: dict[int, Layout] | None = None  # an elastic run's, for each world of its range

    def with_data(self, data: DataConfig) -> "ResolvedRun":
        """This run reading ``data`` instead (collections written into a store)."""
        return replace(self, config=self.config.model_copy(update={"data": data}))


def resolve_run(client: Client, config: RunConfig) -> ResolvedRun:
    """``config`` on the cluster of ``client``: its world size (the workers it may hold), the
    layout of its ranks, its paths made absolute. A batch that does not split is a
    :class:`ConfigError` here, before any data is read or any rank starts."""
    absolute = config.model_copy(
        update={"data": config.data.resolved(), "checkpoint": config.checkpoint.resolved()}
    )
    try:
        layouts = config.elastic_layouts()
    except ValueError as error:
        raise ConfigError(str(error)) from None
    if layouts is not None:  # an elastic run: its world changes within its range
        return ResolvedRun(
            config=absolute,
            layout=layouts[max(layouts)],
            launch=config.launch,
            store_named=config.data.store is not None,
            layouts=layouts,
        )
    world_size = config.world_size or ranks_for(client, config.launch)
    layout = config.layout(world_size)
    launch = config.launch.model_copy(update={"world_size": world_size})
    return ResolvedRun(
        config=absolute, layout=layout, launch=launch, store_named=config.data.store is not None
    )


__all__ = ["ResolvedRun", "resolve_run"]
