"""text: files as training data for a language model, listed on the client, tokenized into
fixed-length windows in Dask tasks (``workflows/data/text_store.py`` builds the graph). numpy,
fsspec and zarr only.

A sample is ``sequence_length`` tokens and its target the same window moved on by one token:
a language model learns to predict each next token. Windows are cut from each partition's
files read one after another, every ``sequence_length`` tokens; the few tokens after a
partition's last whole window are dropped.

Tokenizers: ``byte`` (the file's bytes, 256 tokens, nothing to learn first) or ``char`` (the
corpus's distinct characters after UTF-8 decoding, a vocabulary found in a first pass).
"""

import importlib.util
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import fsspec
import numpy as np
import zarr

from workers.sources.base import (
    Listing,
    Source,
    SourceError,
    digest,
    file_stamp,
    register,
    required_root,
    split_records,
)

if TYPE_CHECKING:
    from workers.spec.sections import DataConfig

Tokenizer = Literal["byte", "char"]
BYTES = 256
# Each split's arrays in the store, as its manifest names them (workers/data.py open_store
# reads them): the samples, and their targets one token on.
ARRAYS = {"features": "tokens", "targets": "next"}
# data.root = "python:stdlib" or "python:<package>": text every machine with Python has.
PYTHON_ROOT = "python:"


def resolve_root(root: str) -> str:
    """``data.root`` as a path or URL: ``python:stdlib`` is the standard library's folder and
    ``python:<package>`` an installed package's (found without importing it)."""
    if not root.startswith(PYTHON_ROOT):
        return root
    name = root.removeprefix(PYTHON_ROOT)
    if name == "stdlib":
        return sysconfig.get_paths()["stdlib"]
    spec = importlib.util.find_spec(name) if name else None
    if spec is None or not spec.submodule_search_locations:
        raise SourceError(f"data.root: {root}: no installed package {name!r} (a folder of modules)")
    return str(Path(next(iter(spec.submodule_search_locations))))


def list_text(
    root: str,
    *,
    files: str,
    val_fraction: float,
    seed: int,
    storage_options: dict[str, Any],
) -> Listing:
    """The files under ``root`` matching the glob ``files``, split by file into train and val.
    ``classes`` is left empty: a vocabulary is the tokenizer's (see :func:`vocabulary`)."""
    base = resolve_root(root)
    try:
        fs, path = fsspec.core.url_to_fs(base, **storage_options)
        found = fs.glob(f"{path.rstrip('/')}/{files}", detail=True)
    except Exception as error:  # any backend's own error for a bad URL or credentials
        raise SourceError(
            f"data.root: cannot read {root}: {type(error).__name__}: {error}"
        ) from None
    found = {name: info for name, info in found.items() if info.get("type") == "file"}
    if len(found) < 2:
        raise SourceError(
            f"data.files: {files!r} matches {len(found)} file(s) under {root}; the text dataset "
            "needs two at least (train and val are split by file)"
        )
    names = sorted(found)
    records = [fs.unstrip_protocol(name) for name in names]
    train, val = split_records(list(range(len(records))), val_fraction, seed)
    stamps = [
        (record, file_stamp(found[name])) for record, name in zip(records, names, strict=True)
    ]
    return Listing(
        train=[records[i] for i in train],
        val=[records[i] for i in val],
        classes=[],
        fingerprint=digest("text", stamps),
        partition_size=64,
    )


@register
class Text(Source):
    name = "text"
    store = "text"

    @classmethod
    def listing(cls, data: "DataConfig", *, seed: int) -> Listing:
        return list_text(
            required_root(data),
            files=data.files,
            val_fraction=data.val_fraction,
            seed=seed,
            storage_options=data.storage_options,
        )

    @classmethod
    def check_root(cls, data: "DataConfig") -> None:
        cls.listing(data, seed=0)  # a glob: as cheap as a look at the root


def _read(url: str, storage_options: dict[str, Any] | None) -> bytes:
    try:
        with fsspec.open(url, "rb", **(storage_options or {})) as f:
            return f.read()
    except OSError as error:
        raise SourceError(f"{url}: cannot read it ({type(error).__name__}: {error})") from None


def characters(records: list[str], *, storage_options: dict[str, Any] | None) -> set[str]:
    """The distinct characters of a partition's files (a Dask task of the ``char`` pass)."""
    seen: set[str] = set()
    for url in records:
        seen.update(_read(url, storage_options).decode("utf-8", errors="replace"))
    return seen


def vocabulary(tokenizer: Tokenizer, found: list[set[str]]) -> list[str]:
    """The tokens, in token order: byte values, or the sorted characters ``found``."""
    if tokenizer == "byte":
        return [str(value) for value in range(BYTES)]
    return sorted(set().union(*found))


def token_dtype(size: int) -> np.dtype:
    """The narrowest unsigned integer holding token ids below ``size``."""
    return np.dtype(np.uint8 if size <= 256 else np.uint16 if size <= 65536 else np.uint32)


@dataclass(frozen=True)
class Encoding:
    """How a store's text becomes its samples: the ``tokenizer``, its ``vocabulary`` (in token
    order, :func:`vocabulary`), and windows of ``sequence_length + 1`` tokens."""

    tokenizer: Tokenizer
    vocabulary: list[str]
    sequence_length: int


def encode_partition(
    records: list[str],
    encoding: Encoding,
    *,
    url: str,
    component: str,
    storage_options: dict[str, Any] | None,
) -> dict[str, Any]:
    """Tokenize a partition's files as ``encoding`` says and write its windows as ``component``
    (raw, one row a window); returns how many windows it wrote."""
    tokenizer, vocabulary = encoding.tokenizer, encoding.vocabulary
    sequence_length = encoding.sequence_length
    dtype = token_dtype(len(vocabulary))
    # Sorted characters are sorted code points: a character's token is its rank among them.
    codes = np.array([ord(char) for char in vocabulary] if tokenizer == "char" else [], np.uint32)
    pieces = [np.zeros(0, dtype)]
    for record in records:
        payload = _read(record, storage_options)
        if tokenizer == "byte":
            pieces.append(np.frombuffer(payload, dtype=np.uint8))
        else:
            text = payload.decode("utf-8", errors="replace").encode("utf-32-le")
            points = np.frombuffer(text, dtype=np.uint32)
            pieces.append(np.searchsorted(codes, points).astype(dtype))
    stream = np.concatenate(pieces)
    count = max(0, (len(stream) - 1) // sequence_length)
    starts = np.arange(count)[:, None] * sequence_length
    windows = stream[starts + np.arange(sequence_length + 1)]
    zarr.create_array(
        url,
        name=component,
        data=windows.reshape(count, sequence_length + 1),
        chunks=(max(1, count), sequence_length + 1),
        overwrite=True,
        storage_options=storage_options or None,
    )
    return {"component": component, "count": count}


def pack_windows(
    url: str,
    blocks: list[tuple[str, int]],
    start: int,
    stop: int,
    *,
    split: str,
    storage_options: dict[str, Any] | None,
) -> int:
    """Write windows ``start:stop`` of the concatenated raw blocks as the store's samples
    (``split/tokens``: the first ``sequence_length`` tokens) and targets (``split/next``: the
    last ``sequence_length``); returns how many it wrote. One task per store chunk: chunks never
    overlap, so no locks are needed."""
    options = storage_options or None
    pieces, offset = [], 0
    for component, count in blocks:
        lo, hi = max(start, offset), min(stop, offset + count)
        if lo < hi:
            raw = zarr.open_array(url, path=component, storage_options=options)
            pieces.append(np.asarray(raw[lo - offset : hi - offset]))
        offset += count
    windows = np.concatenate(pieces)
    for name, values in (
        (ARRAYS["features"], windows[:, :-1]),
        (ARRAYS["targets"], windows[:, 1:]),
    ):
        target = zarr.open_array(url, path=f"{split}/{name}", mode="r+", storage_options=options)
        target[start:stop] = values
    return stop - start
