"""The "Training" page of the scheduler's dashboard, at ``/training``.

Served by the scheduler's own web server (the one behind the dashboard link) from the figures
:class:`workflows.monitoring.TrainingMetrics` keeps: per job its strategy, epoch and step, loss
and accuracy curves, each rank's samples/s and the recoveries. The plots are Bokeh, with
BokehJS inlined, so the page needs nothing from the internet; it reloads itself every few
seconds while a job runs.
"""

from typing import Any

from tornado import web

ROUTE = "/training"
REFRESH_S = 5


def training_page_url(dashboard_link: str) -> str:
    """The Training page's URL from the dashboard's link (``.../status``)."""
    return dashboard_link.rsplit("/status", 1)[0] + ROUTE


def serve_training_page(client: Any) -> str | None:
    """Serve the Training page on ``client``'s scheduler from now on (otherwise the first
    training job does) and return its URL, or None when the scheduler has no dashboard."""
    from workflows.monitoring import TrainingMetrics

    client.register_plugin(TrainingMetrics(), name=TrainingMetrics.name)
    link = client.dashboard_link
    return training_page_url(link) if link else None


def add_to_navigation(scheduler: Any) -> None:
    """List the page in the dashboard's navigation bar.

    distributed renders the bar from ``template_variables(scheduler)["pages"]``, memoized per
    scheduler, and its Bokeh applications hold that same list: extending it in place shows the
    link on every dashboard page served from now on.
    """
    try:
        from distributed.dashboard.scheduler import template_variables
    except ImportError:  # no Bokeh, no dashboard pages to link from
        return
    pages = template_variables(scheduler)["pages"]
    page = ROUTE.strip("/")
    if page not in pages:
        pages.append(page)


def render_page(jobs: dict[str, dict[str, Any]], *, refresh: bool = True) -> str:
    from bokeh.embed import file_html
    from bokeh.layouts import column, row
    from bokeh.models import ColumnDataSource, Div
    from bokeh.plotting import figure
    from bokeh.resources import Resources

    blocks = [Div(text="<h1>Training</h1>")]
    if not jobs:
        blocks.append(Div(text="<p>No training job has reported to this scheduler yet.</p>"))
    for job, state in reversed(list(jobs.items())):  # newest first
        history = state.get("history", [])
        ranks = state.get("ranks", {})
        facts = (
            f"<h2>{_escape(job)}</h2><p>strategy <b>{_escape(str(state.get('strategy', '?')))}"
            f"</b>, {state.get('world_size', '?')} ranks, epoch {state.get('epoch', 0)}/"
            f"{state.get('epochs', '?')}, step {state.get('step', 0)}, recoveries "
            f"{state.get('recoveries', 0)}</p>"
        )
        blocks.append(Div(text=facts))
        epochs = [r["epoch"] for r in history]
        source = ColumnDataSource(
            {
                "epoch": epochs,
                "loss": [r.get("loss") for r in history],
                "val_loss": [r.get("val_loss") for r in history],
                "accuracy": [r.get("accuracy") for r in history],
                "val_accuracy": [r.get("val_accuracy") for r in history],
            }
        )
        loss = figure(title="loss", width=420, height=260, x_axis_label="epoch")
        loss.line("epoch", "loss", source=source, legend_label="train", line_width=2)
        loss.line("epoch", "val_loss", source=source, legend_label="validation", color="orange")
        accuracy = figure(title="accuracy", width=420, height=260, x_axis_label="epoch")
        accuracy.line("epoch", "accuracy", source=source, legend_label="train", line_width=2)
        accuracy.line(
            "epoch", "val_accuracy", source=source, legend_label="validation", color="orange"
        )
        names = [str(rank) for rank in sorted(ranks)]
        throughput = figure(
            title="samples/s per rank", x_range=names or ["-"], width=300, height=260
        )
        throughput.vbar(x=names, top=[ranks[int(n)] for n in names], width=0.6)
        blocks.append(row(loss, accuracy, throughput))
    # BokehJS from the dashboard's static route, relative so a proxy's prefix is kept: inlined,
    # it made every reload of this page 1.7 MB.
    resources = Resources(mode="server", root_url="./")
    page = file_html(column(*blocks), resources=resources, title="dask-train: Training")
    if not refresh:
        return page
    reload = f'<meta http-equiv="refresh" content="{REFRESH_S}">'
    return page.replace("<head>", f"<head>\n{reload}", 1)


class TrainingPage(web.RequestHandler):
    def initialize(self, snapshot: Any) -> None:
        self.snapshot = snapshot

    def get(self) -> None:
        self.set_header("Content-Type", "text/html; charset=utf-8")
        # ?refresh=0 for a still page (a screenshot, a page to keep).
        refresh = self.get_argument("refresh", "1") != "0"
        self.write(render_page(self.snapshot(), refresh=refresh))


def _escape(text: str) -> str:
    import html

    return html.escape(text)


def screenshot(url: str, path: str, *, width: int = 1300, height: int = 900) -> None:
    """Render ``url`` in headless Chromium (Debian's ``chromium``) and save a PNG at ``path``."""
    import shutil
    import subprocess

    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        raise FileNotFoundError("chromium is not installed (apt-get install chromium)")
    subprocess.run(
        [
            browser,
            "--headless",
            "--no-sandbox",  # root in a container has no user namespace for the sandbox
            "--disable-gpu",
            "--disable-background-networking",
            "--disable-component-update",
            "--no-first-run",
            "--hide-scrollbars",
            f"--window-size={width},{height}",
            "--virtual-time-budget=5000",  # let BokehJS render before the shot
            f"--screenshot={path}",
            url,
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )


def main() -> None:
    """Train digits briefly on a local cluster and save a screenshot of the Training page.

    python -m workflows.dashboard [--output workflows/assets/training-page.png]
    """
    import argparse
    import tempfile

    from workflows.cluster import start_cluster
    from workflows.config import load_config
    from workflows.driver import train

    parser = argparse.ArgumentParser(description=main.__doc__.splitlines()[0])
    parser.add_argument("--output", default="workflows/assets/training-page.png")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, start_cluster(n_workers=2, dashboard_port=0) as c:
        config = load_config(
            "workflows/configs/digits_ddp.toml",
            [f"data.store='{tmp}/digits'", "training.epochs=8", "cluster.dashboard_port=0"],
        )
        train(config, cluster=c, on_event=None)
        screenshot(c.dashboard_link.replace("/status", ROUTE) + "?refresh=0", args.output)
    print(f"saved {args.output}")


if __name__ == "__main__":
    main()
