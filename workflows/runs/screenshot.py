"""A screenshot of the scheduler's Training page, for the README (``make screenshot``).

Tooling, not part of the scheduler: it trains briefly through the driver, so it lives apart
from ``workflows.observe.dashboard``, which the scheduler imports.

    python -m workflows.runs.screenshot [--output docs/assets/training-page.png]
"""

import argparse
import shutil
import subprocess
import tempfile

from workflows.cluster.training_cluster import start_cluster
from workflows.observe.dashboard import ROUTE
from workflows.runs.config import load_config
from workflows.runs.driver import train


def screenshot(url: str, path: str, *, width: int = 1300, height: int = 900) -> None:
    """Render ``url`` in headless Chromium (Debian's ``chromium``) and save a PNG at ``path``."""
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
    """Train digits briefly on a local cluster and save a screenshot of the Training page."""
    parser = argparse.ArgumentParser(description=main.__doc__.splitlines()[0])
    parser.add_argument("--output", default="docs/assets/training-page.png")
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
