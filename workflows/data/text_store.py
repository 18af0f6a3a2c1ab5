"""A text corpus into a store of token windows, as Dask tasks: list → (vocabulary) → tokenize
→ pack. The store::

    store/
      train/tokens  (n, sequence_length) unsigned ints, a window of tokens a sample
      train/next    (n, sequence_length) the same window one token on: the targets
      val/tokens, val/next
      attrs: the manifest, with the vocabulary as ``classes`` and ``"features": "tokens"``

Written and reused as the image stores are (``workflows/data/preprocess.py``): the manifest last,
a fingerprint of the files and every parameter deciding reuse.
"""

import time
from typing import Any

import numpy as np
import zarr
from distributed import Client, Future

from workers.sources import Listing, SourceError, digest, list_records
from workers.sources.text import (
    ARRAYS,
    Encoding,
    characters,
    encode_partition,
    pack_windows,
    token_dtype,
    vocabulary,
)
from workers.spec.sections import DataConfig
from workflows.data.stores import (
    STORE_FORMAT,
    StoreManifest,
    gather_settled,
    manifest_of,
    reusable_store,
)


def prepare_text_store(
    client: Client, config: DataConfig, *, seed: int, force: bool = False
) -> StoreManifest:
    """Build the token store for ``config`` on the cluster, or reuse a complete one."""
    started = time.perf_counter()
    listing = list_records(config, seed=seed)
    fingerprint = digest(
        listing.fingerprint,
        (STORE_FORMAT, "text", config.files, config.tokenizer, config.sequence_length),
        (config.val_fraction, config.chunk_size, seed, listing.train, listing.val),
    )
    url = config.store_url
    reusable = reusable_store(url, config.storage_options, fingerprint, force=force)
    if reusable is not None:
        return manifest_of(url, reusable, reused=True, seconds=time.perf_counter() - started)
    attrs = _build(client, config, listing, fingerprint)
    return manifest_of(url, attrs, reused=False, seconds=time.perf_counter() - started)


def _partitions(listing: Listing) -> dict[str, list[list[str]]]:
    size = listing.partition_size
    return {
        split: [records[start : start + size] for start in range(0, len(records), size)]
        for split, records in (("train", listing.train), ("val", listing.val))
    }


def _build(
    client: Client, config: DataConfig, listing: Listing, fingerprint: str
) -> dict[str, Any]:
    url, options, tag = config.store_url, config.storage_options, fingerprint[:8]
    group = zarr.open_group(url, mode="w", storage_options=options or None)  # wipes the old store
    group.attrs.update({"format": STORE_FORMAT, "complete": False})  # ours, not finished
    partitions = _partitions(listing)
    tokens = _vocabulary(client, config, partitions, tag=tag)
    encoded = _encode(client, config, partitions, tokens, tag=tag)
    dtype = token_dtype(len(tokens))
    counts = {
        split: _pack(client, config, split, gather_settled(client, futures), dtype=dtype, tag=tag)
        for split, futures in encoded.items()
    }
    del zarr.open_group(url, mode="a", storage_options=options or None)["raw"]
    attrs = {
        "format": STORE_FORMAT,
        "fingerprint": fingerprint,
        "dataset": "text",
        "kind": "tokens",
        "arrays": ARRAYS,
        "tokenizer": config.tokenizer,
        "sequence_length": config.sequence_length,
        "counts": counts,
        "mean": [],
        "std": [],
        "classes": tokens,
        "bad_records": [],
    }
    group = zarr.open_group(url, mode="a", storage_options=options or None)
    group.attrs.update(attrs)
    group.attrs["complete"] = True  # last: only now is the store visible as finished
    return {**attrs, "complete": True}


def _vocabulary(
    client: Client, config: DataConfig, partitions: dict[str, list[list[str]]], *, tag: str
) -> list[str]:
    """The tokenizer's vocabulary; a character tokenizer's is every split's characters,
    found by a task a partition."""
    found = []
    if config.tokenizer == "char":
        found = gather_settled(
            client,
            [
                client.submit(
                    characters,
                    part,
                    storage_options=config.storage_options,
                    key=f"characters-{split}-{i}-{tag}",
                )
                for split, parts in partitions.items()
                for i, part in enumerate(parts)
            ],
        )
    return vocabulary(config.tokenizer, found)


def _encode(
    client: Client,
    config: DataConfig,
    partitions: dict[str, list[list[str]]],
    tokens: list[str],
    *,
    tag: str,
) -> dict[str, list[Future]]:
    """Each split's tokenizing tasks, one a partition, each writing its raw windows."""
    return {
        split: [
            client.submit(
                encode_partition,
                part,
                Encoding(config.tokenizer, tokens, config.sequence_length),
                url=config.store_url,
                component=f"raw/{split}/{i:06d}",
                storage_options=config.storage_options,
                key=f"tokenize-{split}-{i:06d}-{tag}",
                pure=False,
            )
            for i, part in enumerate(parts)
        ]
        for split, parts in partitions.items()
    }


def _pack(
    client: Client,
    config: DataConfig,
    split: str,
    outcomes: list[dict[str, Any]],
    *,
    dtype: np.dtype,
    tag: str,
) -> int:
    """Lay the split's raw windows out as its ``tokens`` and ``next`` arrays, one task a chunk;
    returns the split's sample count."""
    blocks = [(o["component"], o["count"]) for o in outcomes if o["count"]]
    total = sum(count for _, count in blocks)
    if not total:
        raise SourceError(
            f"data.sequence_length: the {split} files hold no window of "
            f"{config.sequence_length + 1} tokens; lower it or add text"
        )
    shape = (total, config.sequence_length)
    for name in ARRAYS.values():
        zarr.create_array(
            config.store_url,
            name=f"{split}/{name}",
            shape=shape,
            dtype=dtype,
            chunks=(config.chunk_size, config.sequence_length),
            overwrite=True,
            storage_options=config.storage_options or None,
        )
    writes = [
        client.submit(
            pack_windows,
            config.store_url,
            blocks,
            start,
            min(total, start + config.chunk_size),
            split=split,
            storage_options=config.storage_options,
            key=f"pack-{split}-{index:06d}-{tag}",
            pure=False,
        )
        for index, start in enumerate(range(0, total, config.chunk_size))
    ]
    gather_settled(client, writes)
    return total
