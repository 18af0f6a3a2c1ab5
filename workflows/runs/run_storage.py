"""A run directory that lives in object storage (``dask-train run --output s3://bucket/runs/x``).

The run writes its directory as it does on local disk: into a local mirror folder, with its
atomic renames, its log file and its TensorBoard event files, none of which an object store can
do. :class:`RunMirror` copies the mirror to the URL: config.json at once (the claim: a URL that
holds one holds a run), every changed file every few seconds while the run goes on, and at the
end everything, summary.json last, so that its presence in the bucket still says the run
finished. Checkpoints do not pass through the mirror: ranks write them straight to
``<url>/checkpoints`` (``workers/checkpoint.py``), each good only once its manifest is there.

The mirror lives in a folder of the user's own (0700, :func:`make_mirror_root`), and is never
deleted unsent: a mirror whose last copy failed is marked (``.unsent``) and sent by the next
run at the URL (``workflows/runs/run_directory.py``).

Credentials come from where fsspec finds them (environment variables, fsspec's config, the
cloud's own files), or from the config's storage options for the URL's bucket
(``RunConfig.bucket_options``): none is written into the run directory.
"""

import contextlib
import hashlib
import json
import logging
import os
import stat
import tempfile
import threading
from pathlib import Path
from typing import Any

import fsspec

from workers.spec.errors import ConfigError
from workers.spec.locations import checked_location

logger = logging.getLogger(__name__)

SYNC_EVERY_S = 5.0  # how stale the bucket's copy of a running run's records may be
CONFIG, SUMMARY, CHECKPOINTS = "config.json", "summary.json", "checkpoints"
# In a mirror whose last copy to the bucket failed: it holds the run's newest files.
UNSENT = ".unsent"
# In every mirror: what is in the bucket as it is here (name: size, mtime), so that a mirror
# left behind is known to hold nothing unsent.
SENT = ".sent.json"


def checked_url(field: str, location: str) -> str:
    """``location`` (an option's value) as a path or a URL of a protocol fsspec knows, else a
    ConfigError naming ``field`` in one line; ``file:///x`` comes back as ``/x``."""
    try:
        return checked_location(field, location)
    except ValueError as error:
        raise ConfigError(str(error)) from None


def is_url(location: "str | Path | None") -> bool:
    """Whether ``location`` names object storage (``s3://``, ``gs://``...) rather than a path
    on this machine."""
    if location is None or isinstance(location, Path):
        return False
    protocol = location.split("://", 1)[0] if "://" in location else "file"
    return protocol not in ("file", "local")


def mirror_root() -> Path:
    """Where this user's runs are mirrored: a folder of their own in the temporary folder,
    which no other local user can read (the mirror holds model.pt and the run's records)."""
    return Path(tempfile.gettempdir()) / f"dask-train-runs-{os.getuid()}"


def mirror_folder(url: str) -> Path:
    """The local folder a run at ``url`` is written into before it is copied there: the same
    for the same URL, so that a resumed run's TensorBoard folder is known before it starts."""
    digest = hashlib.sha256(url.encode()).hexdigest()[:16]
    return mirror_root() / digest


def make_mirror_root() -> Path:
    """:func:`mirror_root`, made private (0700) if absent; one that another user made, or
    that others may read or enter, or a link, is refused rather than written into."""
    root = mirror_root()
    with contextlib.suppress(FileExistsError):
        root.mkdir(mode=0o700)
    held = root.lstat()
    if not stat.S_ISDIR(held.st_mode) or held.st_uid != os.getuid():
        raise ConfigError(
            f"--output: {root}, where runs kept at a URL are mirrored, is not a folder of "
            "this user's (made by someone else?); remove it"
        )
    if held.st_mode & 0o077:
        os.chmod(root, 0o700)  # ours, but open to others: made so by hand
    return root


class RunMirror:
    """Copies a run directory's local mirror to ``url``: what changed, summary.json last."""

    def __init__(self, url: str, folder: Path, storage_options: dict[str, Any] | None = None):
        self.url, self.folder = url.rstrip("/"), folder
        self.fs, self.root = fsspec.core.url_to_fs(self.url, **(storage_options or {}))
        self._copied: dict[str, tuple[int, int]] = {}  # relative name: (size, mtime_ns) sent
        self._lock = threading.Lock()  # the periodic copy and the final one, never both
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def holds_run(self) -> bool:
        return self.fs.exists(f"{self.root}/{CONFIG}")

    def download(self) -> None:
        """The run's files, but its checkpoints (read where they are), into the mirror."""
        for remote in self.fs.find(self.root):
            name = remote[len(self.root) :].lstrip("/")
            if name.split("/", 1)[0] == CHECKPOINTS:
                continue
            local = self.folder / name
            local.parent.mkdir(parents=True, exist_ok=True)
            self.fs.get_file(remote, str(local))
            self._copied[name] = _stamp(local)
        self._keep_sent()

    def forget_sent(self) -> None:
        """Send every file again at the next copy (the folder's files are others now)."""
        self._copied.clear()

    def copy(self, *, final: bool = False) -> None:
        """Send each file that changed since it was last sent; ``final``: summary.json too,
        after every other file (a run's summary in the bucket means the rest is there)."""
        with self._lock:
            files = sorted(p for p in self.folder.rglob("*") if p.is_file())
            names = [p.relative_to(self.folder).as_posix() for p in files]
            # Files written aside and renamed (write_atomically) are not the run's.
            todo = [n for n in names if not n.rsplit("/", 1)[-1].startswith(".")]
            summary = [n for n in todo if n == SUMMARY]
            for name in [n for n in todo if n != SUMMARY] + (summary if final else []):
                local = self.folder / name
                try:
                    stamp = _stamp(local)
                except FileNotFoundError:  # replaced meanwhile: the next copy sends it
                    continue
                if self._copied.get(name) == stamp:
                    continue
                self.fs.put_file(str(local), f"{self.root}/{name}")
                self._copied[name] = stamp
                self._keep_sent()

    def _keep_sent(self) -> None:
        kept = self.folder / SENT
        partial = kept.with_name(f"{SENT}.partial")
        partial.write_text(json.dumps(self._copied))
        os.replace(partial, kept)

    def unsent(self) -> list[str]:
        """The files of a mirror left behind that are not in the bucket as they are here (all
        of them, when it never recorded what it sent)."""
        try:
            sent = {k: tuple(v) for k, v in json.loads((self.folder / SENT).read_text()).items()}
        except (OSError, ValueError, AttributeError, TypeError):
            sent = {}
        names = [p.relative_to(self.folder).as_posix() for p in self.folder.rglob("*")]
        return [
            name
            for name in names
            if (self.folder / name).is_file()
            and not name.rsplit("/", 1)[-1].startswith(".")
            and sent.get(name) != _stamp(self.folder / name)
        ]

    def start(self) -> None:
        """Copy every ``SYNC_EVERY_S`` until :meth:`stop`."""
        self._stop.clear()
        self._thread = threading.Thread(
            target=self._every, name="dask-train-run-mirror", daemon=True
        )
        self._thread.start()

    def _every(self) -> None:
        while not self._stop.wait(SYNC_EVERY_S):
            try:
                self.copy()
            except Exception as error:  # the next round, or the final copy, tries again
                logger.warning(
                    "run directory %s: copying to the bucket failed: %s", self.url, error
                )

    @property
    def running(self) -> bool:
        return self._thread is not None

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=SYNC_EVERY_S * 4)
            self._thread = None

    def remove(self) -> None:
        """The run's objects, for a run that never started (its claim only)."""
        if self.fs.exists(self.root):
            self.fs.rm(self.root, recursive=True)


def _stamp(path: Path) -> tuple[int, int]:
    stat = path.stat()
    return stat.st_size, stat.st_mtime_ns
