"""The "Training" page of the scheduler's dashboard, at ``/training``.

Served by the scheduler's own web server (the one behind the dashboard link) from the figures
:class:`workflows.observe.monitoring.TrainingMetrics` keeps: per job its strategy, epoch and step,
loss and accuracy curves, each rank's samples/s, the recoveries and the job's world size over time
(an elastic job's resizes and their causes). The page sits under the dashboard's own
navigation bar, rendered by distributed's template as its ``/status`` pages are. The plots are
Bokeh, with BokehJS from the dashboard's static route, so the page needs nothing from the
internet; it reloads itself every few seconds while a job runs.

The scheduler imports this module: it imports nothing of the client side (the driver, the
launcher). ``make screenshot`` lives in ``workflows/runs/screenshot.py``.
"""

import re
from typing import Any

from tornado import web

from workers.compat.distributed_private import dashboard_page_template
from workers.records import REPORT_BOOKKEEPING
from workers.spec.sections import METRICS

ROUTE = "/training"
REFRESH_S = 5
# The newest jobs get their plots; older ones a row each, so that a long-lived shared
# scheduler's page stays light and its newest job on the first screen.
PLOTTED_JOBS = 5
TITLE = "dask-train: Training"
# The world-size plot's markers: how the job's group formed ("world", "start") and why an
# elastic job resized (the "resized" records' cause): (marker, colour).
WORLD_MARKERS = {
    "formed": ("square", "#1f77b4"),
    "joined": ("triangle", "#2ca02c"),
    "retired": ("inverted_triangle", "#7f7f7f"),
    "yielded": ("diamond", "#ff7f0e"),
    "lost": ("x", "#d62728"),
}
OTHER_CAUSE = ("circle", "#9467bd")


def training_page_url(dashboard_link: str) -> str:
    """The Training page's URL from the dashboard's link (``.../status``)."""
    return dashboard_link.rsplit("/status", 1)[0] + ROUTE


def add_to_navigation(scheduler: Any) -> None:
    """List the page in the dashboard's navigation bar.

    distributed renders the bar from ``template_variables(scheduler)["pages"]``, memoized per
    scheduler, and its Bokeh applications hold that same list: extending it in place shows the
    link on every dashboard page served from now on.
    """
    navigation = dashboard_page_template(scheduler)
    if navigation is None:  # no Bokeh, no dashboard pages to link from
        return
    pages = navigation[1]["pages"]
    page = ROUTE.strip("/")
    if page not in pages:
        pages.append(page)


def render_page(
    jobs: dict[str, dict[str, Any]],
    *,
    queue: dict[str, list[dict[str, Any]]] | None = None,
    sweeps: dict[str, dict[int, dict[str, Any]]] | None = None,
    refresh: bool = True,
    navigation: tuple[Any, dict[str, Any]] | None = None,
) -> str:
    """The page's HTML; under the dashboard's navigation bar with ``navigation`` (what
    ``workers.compat.distributed_private.dashboard_page_template`` returns), a page of its
    own without."""
    from bokeh.models import Div

    blocks = [Div(text="<h1>Training</h1>")]
    if queue and (queue["holding"] or queue["queued"]):
        blocks.append(Div(text=_queue_table(queue)))
    if not jobs:
        blocks.append(Div(text="<p>No training job has reported to this scheduler yet.</p>"))
    newest_first = list(reversed(list(jobs.items())))
    for job, state in newest_first[:PLOTTED_JOBS]:
        blocks += _job_blocks(job, state)
    for sweep, trials in reversed(list((sweeps or {}).items())):  # newest first
        blocks.append(Div(text=_trials_table(sweep, trials)))
    if newest_first[PLOTTED_JOBS:]:
        blocks.append(Div(text=_earlier_jobs_table(newest_first[PLOTTED_JOBS:])))
    page = _html(blocks, navigation)
    if not refresh:
        return page
    reload = f'<meta http-equiv="refresh" content="{REFRESH_S}">'
    return page.replace("<head>", f"<head>\n{reload}", 1)


def _job_blocks(job: str, state: dict[str, Any]) -> list[Any]:
    """One plotted job's rows: its facts, its curves and samples/s per rank, its world size
    and peak memory per rank, and its reports' plots."""
    from bokeh.layouts import row
    from bokeh.models import Div
    from bokeh.plotting import figure

    ranks = state.get("ranks", {})
    facts = (
        f"<h2>{_escape(job)}</h2><p>strategy <b>{_escape(str(state.get('strategy', '?')))}"
        f"</b>, {state.get('world_size', '?')} ranks, epoch {state.get('epoch', 0)}/"
        f"{state.get('epochs', '?')}, step {state.get('step', 0)}, recoveries "
        f"{state.get('recoveries', 0)}"
        + (f", resizes {state['resizes']}" if state.get("resizes") else "")
        + "</p>"
    )
    plots = _curves(state.get("history", []))
    plots.append(_per_rank(figure, "samples/s per rank", ranks))
    blocks = [Div(text=facts), row(*plots)]
    # The ranks: how many over time, and each one's peak memory (a row of their own, so
    # that each row fits a screen).
    world_and_memory = []
    if state.get("world"):
        world_and_memory.append(_world_plot(figure, state["world"], state.get("last_seen")))
    memory = state.get("memory", {})
    if memory:
        mib = {rank: value / 2**20 for rank, value in memory.items()}
        world_and_memory.append(_per_rank(figure, "peak memory per rank (MiB)", mib))
    if world_and_memory:
        blocks.append(row(*world_and_memory))
    reports = state.get("reports", [])
    if reports:
        blocks.append(row(*_report_plots(reports, figure)))
    return blocks


def _curves(history: list[dict[str, Any]]) -> list[Any]:
    """The loss's and the task's figures' plots by epoch, training and validation."""
    from bokeh.models import ColumnDataSource, Legend
    from bokeh.plotting import figure

    epochs = [r["epoch"] for r in history]
    # The task's figures (workers/losses.py): accuracy, or MSE, MAE and R² for regression.
    figures = [name for names in METRICS.values() for name in names]
    shown = [name for name in figures if any(name in r for r in history)] or ["accuracy"]
    source = ColumnDataSource(
        {"epoch": epochs}
        | {
            key: [r.get(key) for r in history]
            for name in ("loss", *shown)
            for key in (name, f"val_{name}")
        }
    )
    plots = []
    for name in ("loss", *shown):
        plot = figure(title=name, width=420, height=260, x_axis_label="epoch")
        train = plot.line("epoch", name, source=source, line_width=2)
        validation = plot.line("epoch", f"val_{name}", source=source, color="orange")
        # Above the plot, not over its curves.
        items = [("train", [train]), ("validation", [validation])]
        plot.add_layout(Legend(items=items, orientation="horizontal", margin=0), "above")
        plots.append(plot)
    return plots


def _html(blocks: list[Any], navigation: tuple[Any, dict[str, Any]] | None) -> str:
    """The blocks as one HTML page, under distributed's navigation bar where given."""
    from bokeh.embed import file_html
    from bokeh.layouts import column
    from bokeh.resources import Resources

    # BokehJS from the dashboard's static route, relative so a proxy's prefix is kept: inlined,
    # it made every reload of this page 1.7 MB.
    resources = Resources(mode="server", root_url="./")
    if navigation is None:
        return file_html(column(*blocks), resources=resources, title=TITLE)
    # distributed's page: its bar, its stylesheet (statics/), then the Bokeh document.
    template, variables = navigation
    page = file_html(
        column(*blocks),
        resources=resources,
        title=TITLE,
        template=template,
        template_variables=variables,
    )
    # Its template names every page "Dask Diagnostic UI".
    return re.sub(r"<title>.*?</title>", f"<title>{TITLE}</title>", page, count=1)


def _queue_table(queue: dict[str, list[dict[str, Any]]]) -> str:
    rows = [
        (job["name"], job["job_id"], f"holds {job['workers']} workers", job["since"])
        for job in queue["holding"]
    ] + [
        (job["name"], job["job_id"], f"waits for {job['wanted']} workers", job["since"])
        for job in queue["queued"]
    ]
    return _table(
        "Workers", ("job", "id", "state", "since"), [(*r[:3], _clock(r[3])) for r in rows]
    )


def _earlier_jobs_table(jobs: list[tuple[str, dict[str, Any]]]) -> str:
    rows = [
        (
            job,
            state.get("strategy", "?"),
            state.get("world_size", "?"),
            f"{state.get('epoch', 0)}/{state.get('epochs', '?')}",
            state.get("step", 0),
            state.get("recoveries", 0),
        )
        for job, state in jobs
    ]
    header = ("job", "strategy", "ranks", "epoch", "step", "recoveries")
    return _table("Earlier jobs", header, rows)


def _trials_table(sweep: str, trials: dict[int, dict[str, Any]]) -> str:
    """A sweep's trials, folded under one line of its counts by state."""
    rows = []
    for number in sorted(trials):
        trial = trials[number]
        value = trial.get("value")
        params = ", ".join(
            f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
            for k, v in (trial.get("params") or {}).items()
        )
        shown = "" if value is None else f"{value:.5g}"
        rows.append((number, trial.get("state", "?"), shown, params))
    states = [str(trial.get("state", "?")) for trial in trials.values()]
    counts = ", ".join(f"{states.count(state)} {state.lower()}" for state in sorted(set(states)))
    table = _table("", ("trial", "state", "value", "params"), rows)
    summary = f"Sweep {sweep}: {len(trials)} trials ({counts})"
    return f"<details><summary>{_escape(summary)}</summary>{table}</details>"


def _table(title: str, header: tuple[str, ...], rows: list[tuple[Any, ...]]) -> str:
    head = "".join(f"<th>{_escape(h)}</th>" for h in header)
    body = "".join(
        "<tr>" + "".join(f"<td>{_escape(str(cell))}</td>" for cell in row) + "</tr>" for row in rows
    )
    heading = f"<h2>{_escape(title)}</h2>" if title else ""
    return f"{heading}<table><tr>{head}</tr>{body}</table>"


def _clock(when: float | None) -> str:
    import time

    return time.strftime("%H:%M:%S", time.localtime(when)) if when else ""


def _per_rank(figure: Any, title: str, values: dict[int, float]) -> Any:
    """A bar per rank (from the ranks' heartbeats)."""
    names = [str(rank) for rank in sorted(values)]
    plot = figure(title=title, x_range=names or ["-"], width=300, height=260)
    plot.vbar(x=names, top=[values[int(n)] for n in names], width=0.6)
    return plot


def _world_plot(figure: Any, world: list[dict[str, Any]], until: float | None) -> Any:
    """The job's ranks over time: a step line from the "world", "start" and "resized"
    records, a marker per record by cause (legend beside the plot, details on hover)."""
    from bokeh.models import ColumnDataSource, HoverTool, Legend

    times = [point["at"] * 1000 for point in world]  # Bokeh's datetime axis: ms since epoch
    sizes = [point["world_size"] for point in world]
    if until is not None and until * 1000 > times[-1]:  # the last size, until the last record
        times, sizes = [*times, until * 1000], [*sizes, sizes[-1]]
    plot = figure(
        title="ranks over time",
        width=520,
        height=260,
        x_axis_type="datetime",
        x_axis_label="time",
        y_axis_label="ranks",
    )
    plot.step(times, sizes, mode="after", line_width=2)
    plot.y_range.start, plot.y_range.end = 0, max(sizes) + 1  # the markers clear of the top
    plot.yaxis.ticker.min_interval = 1  # whole ranks
    plot.xaxis.ticker.desired_num_ticks = 4  # clock times, apart
    by_cause: dict[str, list[dict[str, Any]]] = {}
    for point in world:
        cause = str(point.get("cause", "?"))  # "formed", or why the job resized
        by_cause.setdefault(cause, []).append(point)
    items, markers = [], []
    for cause, points in by_cause.items():
        marker, color = WORLD_MARKERS.get(cause, OTHER_CAUSE)
        source = ColumnDataSource(
            {
                "at": [p["at"] * 1000 for p in points],
                "ranks": [p["world_size"] for p in points],
                "cause": [cause] * len(points),
                "change": [
                    f"{p['from']} → {p['world_size']}" if "from" in p else str(p["world_size"])
                    for p in points
                ],
                "step": [str(p.get("step", "")) for p in points],
                "pause_s": [str(p.get("pause_s", "")) for p in points],
                "redone_steps": [str(p.get("redone_steps", "")) for p in points],
            }
        )
        renderer = plot.scatter(
            "at", "ranks", source=source, marker=marker, color=color, size=11, line_width=2
        )
        items.append((cause, [renderer]))
        markers.append(renderer)
    plot.add_layout(Legend(items=items, title="cause"), "right")
    plot.add_tools(
        HoverTool(
            renderers=markers,
            tooltips=[
                ("cause", "@cause"),
                ("ranks", "@change"),
                ("at", "@at{%H:%M:%S}"),
                ("step", "@step"),
                ("pause (s)", "@pause_s"),
                ("steps redone", "@redone_steps"),
            ],
            formatters={"@at": "datetime"},
        )
    )
    return plot


def _report_plots(reports: list[dict[str, Any]], figure: Any) -> list[Any]:
    """One curve per metric a rank function reported (``ctx.report``), from rank 0."""
    names = sorted({k for r in reports for k in r} - REPORT_BOOKKEEPING - {"step"})[:4]
    plots = []
    for name in names:
        points = [(r.get("step", r.get("seq")), r[name]) for r in reports if name in r]
        plot = figure(title=f"reported: {name}", width=420, height=260, x_axis_label="step")
        plot.line([x for x, _ in points], [y for _, y in points], line_width=2)
        plots.append(plot)
    return plots


class TrainingPage(web.RequestHandler):
    def initialize(
        self, snapshot: Any, navigation: tuple[Any, dict[str, Any]] | None = None
    ) -> None:
        self.snapshot = snapshot
        self.navigation = navigation

    def get(self) -> None:
        self.set_header("Content-Type", "text/html; charset=utf-8")
        # ?refresh=0 for a still page (a screenshot, a page to keep).
        refresh = self.get_argument("refresh", "1") != "0"
        page = self.snapshot()
        self.write(
            render_page(
                page["jobs"],
                queue=page["queue"],
                sweeps=page["sweeps"],
                refresh=refresh,
                navigation=self.navigation,
            )
        )


def _escape(text: str) -> str:
    import html

    return html.escape(text)
