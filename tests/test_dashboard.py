"""The Training page on the scheduler's dashboard, fetched raw and rendered by a real browser."""

import json
import re
import shutil
import urllib.parse
import urllib.request

import numpy as np
import pytest
from PIL import Image

from tests.commands import run_python
from tests.test_monitoring import send_elastic_job
from workflows.observe.dashboard import ROUTE
from workflows.runs.driver import train
from workflows.runs.screenshot import screenshot

BOKEH_BLUE = (31, 119, 180)  # the train curves' default colour


@pytest.fixture(scope="module")
def trained_page(cluster, make_config):
    result = train(make_config({"name": "page"}, epochs=3), cluster=cluster, on_event=None)
    return cluster.dashboard_link.replace("/status", ROUTE), result


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as response:
        assert response.status == 200
        return response.read().decode()


def test_the_dashboards_navigation_links_the_training_page(trained_page):
    url, _ = trained_page
    status = _get(url.replace(ROUTE, "/status"))
    # distributed's bar: <li><a href="status">Status</a></li> ... and ours beside them.
    assert re.search(r'<a href="training">\s*Training\s*</a>', status), "no Training link"


def test_the_training_page_has_the_dashboards_navigation_bar(cluster):
    job = send_elastic_job(cluster.client, "page-nav")
    url = cluster.dashboard_link.replace("/status", ROUTE)
    html = _get(url)
    # distributed's own bar, as on /status: its pages, ours among them, and its stylesheet.
    assert '<div class="navbar" id="myTopnav">' in html
    assert re.search(r'<a href="status">\s*Status\s*</a>', html), "no Status link"
    assert re.search(r'<a href="training">\s*Training\s*</a>', html), "no Training link"
    (css,) = re.findall(r'<link rel="stylesheet" href="([^"]+)"', html)
    with urllib.request.urlopen(urllib.parse.urljoin(url, css), timeout=30) as response:
        assert response.status == 200 and b".navbar" in response.read()
    assert "<title>dask-train: Training</title>" in html
    assert f"&lt;h2&gt;{job}&lt;/h2&gt;" in html  # and the page's own content below it


def test_the_training_page_plots_an_elastic_jobs_world_size(cluster):
    job = send_elastic_job(cluster.client, "page-elastic")
    html = _get(cluster.dashboard_link.replace("/status", ROUTE))
    # The job's line of facts (escaped in the Bokeh document): the ranks it runs on now.
    facts = html.split(f"&lt;h2&gt;{job}&lt;/h2&gt;")[1].split("&lt;/p&gt;")[0]
    assert "3 ranks" in facts and "recoveries 0, resizes 2" in facts, facts
    assert '"ranks over time"' in html  # the plot's title in the Bokeh document
    # Its markers' legend names the causes; the hover shows each resize's change.
    for cause in ("formed", "joined", "lost"):
        assert f'"{cause}"' in html, cause
    assert r'["change",["4 \u2192 3"]]' in html  # "4 → 3", JSON-escaped


def test_the_training_page_loads_bokehjs_from_the_dashboard_once(trained_page):
    url, _ = trained_page
    html = _get(url)
    # BokehJS inlined made the page 1.7 MB; the browser now caches the dashboard's copy.
    assert len(html.encode()) < 300_000, len(html.encode())
    scripts = re.findall(r'<script[^>]+src="([^"]+)"', html)
    assert any("static/js/bokeh.min.js" in src for src in scripts), scripts
    for src in scripts:
        script = urllib.parse.urljoin(url, src)
        with urllib.request.urlopen(script, timeout=30) as response:
            assert response.status == 200, script


def test_the_training_page_lists_the_jobs_figures(trained_page):
    url, result = trained_page
    html = _get(url)
    # The text sits HTML-escaped inside the Bokeh document's JSON.
    assert "page-" in html and "ddp" in html
    assert "2 ranks, epoch 3/3" in html
    assert f"step {result.final['step']}, recoveries 0" in html
    for title in ("loss", "accuracy", "samples/s per rank"):
        assert f'"{title}"' in html  # the figures' titles in the Bokeh document


@pytest.mark.skipif(
    shutil.which("chromium") is None,
    reason="Debian's chromium is not installed (make test installs it where apt can)",
)
def test_headless_chromium_renders_the_training_plots(trained_page, tmp_path):
    url, _ = trained_page
    shot = tmp_path / "training.png"
    screenshot(url + "?refresh=0", str(shot))
    pixels = np.asarray(Image.open(shot).convert("RGB")).reshape(-1, 3)
    # BokehJS draws everything on this page, curves included: blue pixels mean it rendered.
    blue = np.all(np.abs(pixels.astype(int) - BOKEH_BLUE) <= 12, axis=1).sum()
    assert blue > 200, f"only {blue} pixels of the curves' blue: the plots did not render"


def test_the_scheduler_side_modules_do_not_import_the_driver():
    # The scheduler imports both; the driver imports the monitoring plugin, which imports the
    # dashboard: importing the driver from there would close a cycle.
    code = (
        "import sys, workflows.observe.dashboard, workflows.observe.monitoring; "
        "print('workflows.runs.driver' in sys.modules)"
    )
    done = run_python(code)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


def test_a_long_lived_schedulers_page_plots_the_newest_jobs_and_folds_the_sweeps():
    from workflows.observe.dashboard import PLOTTED_JOBS, render_page

    record = {"strategy": "ddp", "world_size": 2, "epoch": 1, "epochs": 1, "step": 3}
    history = [{"epoch": 1, "loss": 1.0, "accuracy": 0.5}]
    jobs = {f"job{i}": record | {"history": history, "ranks": {0: 9.0}} for i in range(20)}
    trials = {
        0: {"state": "COMPLETE", "value": 0.25, "params": {"lr": 0.1}},
        1: {"state": "PRUNED", "value": None, "params": {"lr": 0.9}},
    }
    html = render_page(jobs, sweeps={"tune": trials}, refresh=False)
    # The Div's HTML sits escaped inside the Bokeh document's JSON.
    plotted = [f"job{i}" for i in range(20) if f"&lt;h2&gt;job{i}&lt;/h2&gt;" in html]
    assert plotted == [f"job{i}" for i in range(20 - PLOTTED_JOBS, 20)]
    assert "Earlier jobs" in html and "job0" in html  # the oldest, as a row
    assert "Sweep tune: 2 trials (1 complete, 1 pruned)" in html


def _figures(html: str) -> list[dict]:
    """The Bokeh document's figures, as the page's embedded JSON has them."""
    (text,) = re.findall(
        r'<script type="application/json" id="[^"]+">\s*(.*?)\s*</script>', html, re.S
    )

    def walk(node):
        if isinstance(node, dict):
            yield node
            yield from (found for value in node.values() for found in walk(value))
        elif isinstance(node, list):
            yield from (found for value in node for found in walk(value))

    return [node["attributes"] for node in walk(json.loads(text)) if node.get("name") == "Figure"]


def test_the_plots_legends_sit_beside_them_not_over_their_curves():
    from workflows.observe.dashboard import render_page

    world = [
        {"kind": "world", "at": 1000.0, "world_size": 2, "cause": "formed"},
        {"kind": "resized", "at": 1010.0, "world_size": 3, "from": 2, "cause": "joined"},
    ]
    state = {
        **{"strategy": "ddp", "world_size": 3, "ranks": {0: 9.0}, "memory": {0: 2**20}},
        "history": [{"epoch": 1, "loss": 1.0, "accuracy": 0.5, "val_loss": 1.1}],
        "reports": [{"step": 1, "loss": 0.9}],
        **{"world": world, "last_seen": 1020.0},
    }
    figures = _figures(render_page({"job": state}, refresh=False))
    titles = [figure["title"]["attributes"]["text"] for figure in figures]
    assert "ranks over time" in titles and "loss" in titles, titles
    legends = 0
    for title, figure in zip(titles, figures, strict=True):
        assert "Legend" not in [m.get("name") for m in figure.get("center", [])], title
        for side in ("above", "below", "left", "right"):
            legends += [m.get("name") for m in figure.get(side, [])].count("Legend")
    assert legends == 3  # train/validation of loss and accuracy; the resizes' causes
