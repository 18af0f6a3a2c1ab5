"""What every dataset store built on the cluster shares, whatever it holds (images:
``workflows/data/preprocess.py``; token windows: ``workflows/data/text_store.py``; Dask collections:
``workflows/data/array_store.py``): its format, its manifest, when it may be reused or rewritten,
and how its writes are gathered.

The manifest is written last and carries ``complete = true``: a store left half-written by an
interrupted run is never taken for a finished one.
"""

import contextlib
import logging
from dataclasses import dataclass
from typing import Any

import zarr
from distributed import Client, Future

from workers.futures import wait_futures
from workers.sources import SourceError

logger = logging.getLogger(__name__)

STORE_FORMAT = 1


@dataclass(frozen=True)
class StoreManifest:
    url: str
    fingerprint: str
    counts: dict[str, int]
    mean: list[float]
    std: list[float]
    classes: list[str]
    bad_records: list[tuple[str, str]]
    reused: bool
    seconds: float

    @property
    def num_classes(self) -> int:
        return len(self.classes)


def reusable_store(
    url: str, storage_options: dict[str, Any] | None, fingerprint: str, *, force: bool = False
) -> dict[str, Any] | None:
    """The manifest of the complete store at ``url`` if it was built for ``fingerprint``;
    otherwise None, once it is clear that ``url`` may be (re)written: a location holding
    anything but a store of ours is refused."""
    try:
        attrs = _store_attrs(url, storage_options)  # one read decides reuse and safety
    except SourceError as error:
        raise SourceError(f"data.store: {error}") from error.__cause__
    if _is_complete(attrs) and attrs.get("fingerprint") == fingerprint and not force:
        logger.info("reusing the complete store at %s", url)
        return attrs
    if not _is_complete(attrs) and _has_content(url, storage_options):
        if attrs is None or attrs.get("format") != STORE_FORMAT:
            raise SourceError(
                f"data.store: {url} exists and is not a dask-train dataset store; refusing to "
                "overwrite it (point data.store at a new or empty location)"
            )
        logger.warning("rebuilding %s: it holds no complete store (an interrupted run?)", url)
    return None


def read_manifest(url: str, *, storage_options: dict[str, Any] | None = None) -> dict | None:
    """The manifest of a complete store at ``url``, or None (absent, half-written, other format)."""
    attrs = _store_attrs(url, storage_options)
    return attrs if _is_complete(attrs) else None


def _store_attrs(url: str, storage_options: dict[str, Any] | None) -> dict[str, Any] | None:
    """The zarr group attributes at ``url``, or None where there is no zarr group. A location
    that cannot be read at all (denied, unreachable, a filesystem this zarr and fsspec cannot
    open) is a SourceError naming why: taking it for an empty one would rebuild over it, and
    taking it for a foreign one would say the wrong thing."""
    try:
        group = zarr.open_group(url, mode="r", storage_options=storage_options or None)
    except (FileNotFoundError, ValueError):  # absent, or not a zarr group: not a store of ours
        return None
    except Exception as error:
        raise SourceError(f"{url} cannot be read: {type(error).__name__}: {error}") from error
    return dict(group.attrs)


def _is_complete(attrs: dict[str, Any] | None) -> bool:
    return (
        attrs is not None and attrs.get("format") == STORE_FORMAT and attrs.get("complete") is True
    )


def gather_settled(client: Client, futures: list[Future]) -> list[Any]:
    """Results of all futures; on the first failure, wait until the others have finished too,
    so that none of them still writes into the store when the caller (or a rebuild) moves on."""
    try:
        return client.gather(futures)
    except BaseException:
        # Partitions are small, so letting the running ones finish is quick; cancelling would
        # not stop a task already writing.
        with contextlib.suppress(Exception):
            wait_futures(futures, timeout_s=120)
        client.cancel(futures)
        raise


def manifest_of(url: str, attrs: dict[str, Any], *, reused: bool, seconds: float) -> StoreManifest:
    return StoreManifest(
        url=url,
        fingerprint=attrs["fingerprint"],
        counts=dict(attrs["counts"]),
        mean=list(attrs["mean"]),
        std=list(attrs["std"]),
        classes=list(attrs["classes"]),
        bad_records=[tuple(r) for r in attrs["bad_records"]],
        reused=reused,
        seconds=seconds,
    )


def _has_content(url: str, storage_options: dict[str, Any] | None) -> bool:
    import fsspec

    fs, path = fsspec.core.url_to_fs(url, **(storage_options or {}))
    return fs.exists(path)
