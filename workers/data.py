"""The data a rank trains on: its own shard of the preprocessed store, read lazily in batches.

The store (built by ``workflows/data/preprocess.py``) holds normalized float32 images chunked along
samples. Each epoch, the chunks are shuffled, samples are shuffled within windows of a few
chunks, and the resulting order is cut into one contiguous share per rank: every training
sample is seen exactly once per epoch across ranks (padded with repeats like DistributedSampler,
or cut with ``drop_last``), the order is a pure function of (seed, epoch), and each rank only
ever reads its own few chunks at a time.
"""

import contextlib
import json
import math
import queue
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import zarr

from workers.spec.sections import DataConfig


@dataclass(frozen=True)
class SampleOrder:
    """How a split of ``n`` samples is ordered each epoch and how the epoch's end is cut: the
    order is a pure function of (seed, epoch), chunk-local (``chunk_size`` rows a chunk,
    shuffled within windows of ``shuffle_window`` chunks); ``drop_last`` drops the rows that
    do not fill a share, else they are filled up with repeats."""

    n: int
    seed: int
    chunk_size: int
    shuffle_window: int
    drop_last: bool

    def of_epoch(self, epoch: int) -> np.ndarray:
        """Every sample index of ``epoch``, in the order the job trains on them."""
        return epoch_order(
            self.n,
            epoch=epoch,
            seed=self.seed,
            chunk_size=self.chunk_size,
            shuffle_window=self.shuffle_window,
        )


def rank_epoch_indices(
    order: SampleOrder,
    *,
    epoch: int,
    rank: int,
    world_size: int,
    global_batch: int | None = None,
) -> np.ndarray:
    """This rank's sample indices for one epoch, in the order it trains on them.

    A fixed world cuts the epoch's order into one share per rank. An elastic job's world
    changes within an epoch, so with ``global_batch`` the order is cut into global batches
    instead, the same for every world, and each rank takes its part of each: batch ``b`` of
    the epoch is the same samples on any number of ranks, and a job resized after ``b``
    batches goes on with batch ``b + 1`` (every sample of the epoch once, none twice)."""
    n, drop_last = order.n, order.drop_last
    samples = order.of_epoch(epoch)
    if global_batch is not None:
        batches = n // global_batch if drop_last else math.ceil(n / global_batch)
        if len(samples) < batches * global_batch:  # the last batch filled up with repeats
            samples = np.concatenate([samples, samples[: batches * global_batch - len(samples)]])
        # Rank r's part of each batch: the rows from its start, the first ranks one more
        # where the world does not divide the batch (Layout.share_of).
        base, extra = divmod(global_batch, world_size)
        start = rank * base + min(rank, extra)
        by_batch = samples[: batches * global_batch].reshape(batches, global_batch)
        return by_batch[:, start : start + base + (rank < extra)].reshape(-1)
    if drop_last:
        samples = samples[: (n // world_size) * world_size]
    else:
        total = math.ceil(n / world_size) * world_size
        samples = np.concatenate([samples, samples[: total - n]])  # pad with repeats
    share = len(samples) // world_size
    return samples[rank * share : (rank + 1) * share]


def epoch_blocks(n: int, *, block: int, drop_last: bool) -> int:
    """Blocks of ``block`` rows in an epoch of ``n`` samples (the last one filled up with
    repeats, or dropped)."""
    return n // block if drop_last else math.ceil(n / block)


def steps_from_block(blocks: int, start_block: int, replicas: int, *, drop_last: bool) -> int:
    """Steps of ``replicas`` blocks each left in an epoch of ``blocks`` from ``start_block``:
    the last one filled up with the epoch's first blocks again, or dropped."""
    left = max(0, blocks - start_block)
    return left // replicas if drop_last else math.ceil(left / replicas)


def rank_block_indices(
    order: SampleOrder,
    *,
    epoch: int,
    rank: int,
    replicas: int,
    start_block: int,
    block: int,
) -> np.ndarray:
    """This rank's sample indices for the rest of one epoch, from ``start_block`` on, for an
    elastic job that keeps each rank's batch (``launch.elastic_batch = "per_rank"``).

    The epoch's order is cut into blocks of ``block`` rows, the same for every world; a step
    of ``replicas`` ranks takes the next ``replicas`` blocks, rank ``r`` the ``r``-th. The
    position is counted in blocks, so a job resized after block ``b`` goes on with block ``b``
    on any number of ranks: every sample of the epoch once, none twice (the last step, which
    may find fewer blocks than ranks, repeats the epoch's first ones, or is dropped)."""
    samples = order.of_epoch(epoch)
    blocks = epoch_blocks(order.n, block=block, drop_last=order.drop_last)
    if len(samples) < blocks * block:
        samples = np.concatenate([samples, samples[: blocks * block - len(samples)]])
    by_block = samples[: blocks * block].reshape(blocks, block)
    steps = steps_from_block(blocks, start_block, replicas, drop_last=order.drop_last)
    return by_block[(start_block + rank + replicas * np.arange(steps)) % blocks].reshape(-1)


def epoch_order(
    n: int, *, epoch: int, seed: int, chunk_size: int, shuffle_window: int
) -> np.ndarray:
    """Every sample index of one epoch, in the order the job trains on them: chunks shuffled,
    then rows within windows of ``shuffle_window`` chunks (reads stay chunk-local)."""
    rng = np.random.default_rng((seed, epoch))
    n_chunks = math.ceil(n / chunk_size)
    chunk_order = rng.permutation(n_chunks)
    windows = []
    for start in range(0, n_chunks, shuffle_window):
        members = [
            np.arange(c * chunk_size, min(n, (c + 1) * chunk_size))
            for c in chunk_order[start : start + shuffle_window]
        ]
        windows.append(rng.permutation(np.concatenate(members)))
    return np.concatenate(windows)


@dataclass(frozen=True)
class StoreSplit:
    """One split of an opened store: lazily read images, labels in memory."""

    images: Any  # zarr array, or a numpy array when read into memory
    labels: np.ndarray
    chunk_size: int
    tokens: bool = False  # the samples are token ids (a text store), not values
    # (url, fingerprint, split) of a complete store: names the split's decompressed chunks in
    # this process's WorkerChunks, shared by later jobs; None: not shared.
    cache_key: tuple[str, str, str] | None = None

    def __len__(self) -> int:
        return len(self.labels)

    def zeros(self, rows: int) -> torch.Tensor:
        """``rows`` samples of zeros, shaped and typed as a model takes this split's."""
        return zero_samples(rows, tuple(self.images.shape[1:]), tokens=self.tokens)


@dataclass(frozen=True)
class OpenedStore:
    train: StoreSplit
    val: StoreSplit
    num_classes: int


# A warm worker's jobs open the same store again and again: the opened store (array handles,
# labels in memory) is kept per (url, storage options, fingerprint). Every open still reads
# the group's manifest, so a store rebuilt for other inputs (another fingerprint), or being
# rebuilt (not complete), is never served from here. A store rebuilt for the same fingerprint
# holds the same samples: the fingerprint names its inputs and every preprocessing parameter.
_OPENED: dict[tuple[str, str, str], OpenedStore] = {}
_OPENED_LOCK = threading.Lock()
_OPENED_STORES = 8  # the oldest goes beyond these: a worker rarely trains on many stores


# What a store's arrays may be made of: numbers, and codecs that only move or compress bytes.
# A store is data, and data may be planted (a data.store in someone else's bucket): zarr runs
# whatever codec an array's metadata names, and numcodecs' pickle filter is pickle.loads
# (numcodecs 0.16.6 refuses to decode it unless NUMCODECS_ALLOW_UNSAFE_PICKLE_DECODE is set
# in the environment; earlier releases run it). Every store dask-train writes fits.
STORE_DTYPE_KINDS = frozenset("biuf")  # bool, int, uint, float: never Python objects or str
STORE_CODECS = frozenset(
    {
        *("bytes", "transpose", "crc32c"),  # zarr 3's serializer, layout and checksum
        *("zstd", "blosc", "gzip", "zlib", "lz4", "bz2", "lzma"),  # compressors, both formats
        *("delta", "shuffle"),  # numeric filters of zarr 2's format
    }
)


class StoreRefused(ValueError):
    """A store whose arrays are made of what no dataset store is: refused before any chunk of
    it is read."""


def checked_array(group: zarr.Group, path: str, *, store: str) -> zarr.Array:
    """``group[path]``, an array of numbers whose codecs are all in ``STORE_CODECS``: a
    StoreRefused naming ``store`` (the field and URL it came from) and the array otherwise,
    before any chunk is decoded."""
    array = group[path]
    where = f"{store}/{path}"
    if not isinstance(array, zarr.Array):
        raise StoreRefused(f"{where} is not an array")
    kind = getattr(array.dtype, "kind", None)  # zarr 3's StringDType and the like have none
    if kind not in STORE_DTYPE_KINDS:
        raise StoreRefused(f"{where} holds {array.dtype} values, not numbers: refused unread")
    unknown = sorted(set(_codec_names(array)) - STORE_CODECS)
    if unknown:
        raise StoreRefused(
            f"{where} is encoded with {', '.join(unknown)}, which no dataset store uses: "
            "refused unread"
        )
    return array


def _codec_names(array: zarr.Array) -> list[str]:
    """The names of every codec ``array``'s metadata has its chunks decoded with."""
    metadata = array.metadata
    if metadata.zarr_format == 2:
        codecs = [*(metadata.filters or ()), metadata.compressor]
        return [codec.codec_id for codec in codecs if codec is not None]
    return [codec.to_dict()["name"] for codec in metadata.codecs]


def open_store(url: str, *, storage_options: dict[str, Any] | None = None) -> OpenedStore:
    group = zarr.open_group(url, mode="r", storage_options=storage_options or None)
    attrs = dict(group.attrs)
    if attrs.get("complete") is not True:
        raise FileNotFoundError(f"data.store: {url} holds no complete dataset store")
    fingerprint = attrs.get("fingerprint")
    key = None
    if isinstance(fingerprint, str):
        key = (url, json.dumps(storage_options or {}, sort_keys=True, default=str), fingerprint)
        with _OPENED_LOCK:
            if key in _OPENED:
                return _OPENED[key]

    # Image stores hold images/labels; stores of Dask collections and of text name theirs in
    # the manifest.
    names = attrs.get("arrays", {"features": "images", "targets": "labels"})
    tokens = attrs.get("kind") == "tokens"

    def split(name: str) -> StoreSplit:
        store = f"data.store: {url}"
        images = checked_array(group, f"{name}/{names['features']}", store=store)
        targets = checked_array(group, f"{name}/{names['targets']}", store=store)
        labels = as_targets(np.asarray(targets[:]))
        # Shared with the later jobs that open this store: never written in place (left
        # writable all the same: torch.from_numpy warns about read-only arrays).
        cache_key = None if key is None else (url, key[2], name)
        return StoreSplit(images, labels, images.chunks[0], tokens=tokens, cache_key=cache_key)

    opened = OpenedStore(
        train=split("train"),
        val=split("val"),
        num_classes=len(attrs["classes"]),
    )
    if key is not None:
        with _OPENED_LOCK:
            if len(_OPENED) >= _OPENED_STORES:
                _OPENED.pop(next(iter(_OPENED)))
            _OPENED[key] = opened
    return opened


def as_features(values: Any, *, tokens: bool = False) -> np.ndarray:
    """Samples as a model takes them: float32 whatever dtype the store keeps, or int64 token
    ids (an embedding's indices)."""
    return np.asarray(values, dtype=feature_dtype(tokens))


def feature_dtype(tokens: bool) -> np.dtype:
    return np.dtype(np.int64 if tokens else np.float32)


def zero_samples(rows: int, shape: tuple[int, ...], *, tokens: bool = False) -> torch.Tensor:
    """``rows`` samples of ``shape``, zeros, typed as a model takes them (``as_features``)."""
    return torch.from_numpy(np.zeros((rows, *shape), dtype=feature_dtype(tokens)))


def as_targets(values: np.ndarray) -> np.ndarray:
    """Class indices (integers) as int64, numeric targets as float32."""
    return values.astype(np.int64 if values.dtype.kind in "biu" else np.float32, copy=False)


class WorkerChunks:
    """Decompressed chunks kept by this process across jobs, least recently used out, up to
    ``capacity`` bytes: a warm worker's next job on the same store trains its first step
    without reading a chunk (reading them was a third of the first step on a small store).

    Keyed by the split's ``cache_key``, which holds the store's fingerprint: a rebuilt store
    with other contents has another key. The chunks are read-only; batches are copies.
    Small on purpose: a store that does not fit is read as before (least recently used would
    only churn through it), and the memory stays with the worker between jobs.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._lock = threading.Lock()
        self._chunks: OrderedDict[tuple[Any, ...], np.ndarray] = OrderedDict()
        self._bytes = 0

    def get(self, key: tuple[Any, ...]) -> np.ndarray | None:
        with self._lock:
            data = self._chunks.get(key)
            if data is not None:
                self._chunks.move_to_end(key)
            return data

    def put(self, key: tuple[Any, ...], data: np.ndarray) -> None:
        if data.nbytes > self.capacity:
            return
        data.flags.writeable = False
        with self._lock:
            if key in self._chunks:
                return
            self._chunks[key] = data
            self._bytes += data.nbytes
            while self._bytes > self.capacity:
                _, dropped = self._chunks.popitem(last=False)
                self._bytes -= dropped.nbytes

    def clear(self) -> None:
        with self._lock:
            self._chunks.clear()
            self._bytes = 0


# 64 MiB: the digits store (17 MB) and the first windows of larger ones; a worker process
# holds at most this much of decompressed chunks between jobs.
WORKER_CHUNKS = WorkerChunks(64 << 20)


class _ChunkCache:
    """The last few decompressed chunks of one array: a window's batches hit the same ones."""

    def __init__(self, split: StoreSplit, capacity: int) -> None:
        self.split, self.capacity = split, capacity
        self._chunks: OrderedDict[int, np.ndarray] = OrderedDict()

    def take(self, indices: np.ndarray) -> np.ndarray:
        tokens = self.split.tokens
        if isinstance(self.split.images, np.ndarray):
            return as_features(self.split.images[indices], tokens=tokens)
        size = self.split.chunk_size
        out = np.empty((len(indices), *self.split.images.shape[1:]), dtype=feature_dtype(tokens))
        chunk_of = indices // size
        for chunk in np.unique(chunk_of):
            rows = np.nonzero(chunk_of == chunk)[0]
            out[rows] = self._chunk(int(chunk))[indices[rows] - chunk * size]
        return out

    def _chunk(self, chunk: int) -> np.ndarray:
        if chunk in self._chunks:
            self._chunks.move_to_end(chunk)
            return self._chunks[chunk]
        shared = None if self.split.cache_key is None else (*self.split.cache_key, chunk)
        data = None if shared is None else WORKER_CHUNKS.get(shared)
        if data is None:
            size = self.split.chunk_size
            data = np.asarray(self.split.images[chunk * size : (chunk + 1) * size])
            if shared is not None:
                WORKER_CHUNKS.put(shared, data)
        self._chunks[chunk] = data
        if len(self._chunks) > self.capacity:
            self._chunks.popitem(last=False)
        return data


@dataclass(frozen=True)
class BatchShare:
    """This rank's part of the job's batches: its place among the ``world_size`` replicas and
    its ``batch_size`` rows a step. ``global_batch``: an elastic job's, of which
    ``batch_size`` is this rank's share; the epoch's order is cut into global batches, the
    same on any number of ranks (``rank_epoch_indices``), so that a job resized within an
    epoch goes on where it stood. ``per_rank_blocks``: an elastic job that keeps each rank's
    batch; the order is cut into blocks of ``batch_size``, a step takes one per rank, and the
    epoch's position counts blocks (``rank_block_indices``)."""

    rank: int
    world_size: int
    batch_size: int
    global_batch: int | None = None
    per_rank_blocks: bool = False


class RankBatches:
    """This rank's training batches for one epoch at a time: ``for x, y in batches.epoch(e)``."""

    def __init__(
        self,
        split: StoreSplit,
        config: DataConfig,
        share: BatchShare,
        *,
        seed: int,
        pin_memory: bool | None = None,
    ) -> None:
        """``share``: which of the epoch's rows this rank takes (:class:`BatchShare`).
        ``pin_memory``: hand out batches in page-locked memory, so that
        ``.to(device, non_blocking=True)`` copies them to the GPU asynchronously (from
        pageable memory that copy is synchronous). None: when CUDA is available, which is
        exactly when a rank's device is a GPU (``workers/devices.py``)."""
        self.split, self.config = split, config
        self.rank, self.world_size, self.batch_size = share.rank, share.world_size, share.batch_size
        self.seed = seed
        self.global_batch = share.global_batch
        self.per_rank_blocks = share.per_rank_blocks
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        if config.in_memory:
            # Read once every chunk this rank could ever need: with shuffled chunks, that is all.
            self.split = StoreSplit(
                np.asarray(split.images[:]), split.labels, split.chunk_size, tokens=split.tokens
            )
        self._cache = _ChunkCache(self.split, capacity=2 * config.shuffle_window + 2)

    @property
    def order(self) -> SampleOrder:
        """How the split's samples are ordered each epoch."""
        return SampleOrder(
            len(self.split),
            seed=self.seed,
            chunk_size=self.split.chunk_size,
            shuffle_window=self.config.shuffle_window,
            drop_last=self.config.drop_last,
        )

    def indices(self, epoch: int) -> np.ndarray:
        return rank_epoch_indices(
            self.order,
            epoch=epoch,
            rank=self.rank,
            world_size=self.world_size,
            global_batch=self.global_batch,
        )

    @property
    def stride(self) -> int:
        """How far one step moves the epoch's position: a batch, or one block per rank."""
        return self.world_size if self.per_rank_blocks else 1

    def steps_from(self, position: int) -> int:
        """Steps left in an epoch from ``position`` (``stride`` units a step)."""
        if self.per_rank_blocks:
            blocks = epoch_blocks(
                len(self.split), block=self.batch_size, drop_last=self.config.drop_last
            )
            return steps_from_block(
                blocks, position, self.world_size, drop_last=self.config.drop_last
            )
        return max(0, len(self) - position)

    @property
    def _share(self) -> int:
        """Samples per rank and epoch: the split cut (drop_last) or padded to equal shares
        (of whole global batches, in an elastic job)."""
        n, world, whole = len(self.split), self.world_size, self.global_batch
        if whole is not None:
            return (n // whole if self.config.drop_last else -(-n // whole)) * self.batch_size
        return n // world if self.config.drop_last else -(-n // world)

    def __len__(self) -> int:
        """Batches per epoch (the same every epoch)."""
        if self.per_rank_blocks:
            return self.steps_from(0)
        share = self._share
        return share // self.batch_size if self.config.drop_last else -(-share // self.batch_size)

    def job_rows(self, batch: int) -> int:
        """Rows all replicas together train on in step ``batch`` of an epoch: every replica
        holds an equal share (padded or cut), so this rank's batch times the replicas; an
        elastic job's batches are all whole."""
        if self.global_batch is not None:
            return self.global_batch
        if self.per_rank_blocks:
            return self.batch_size * self.world_size
        return min(self.batch_size, self._share - batch * self.batch_size) * self.world_size

    def epoch(
        self, epoch: int, *, start_batch: int = 0
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The epoch's batches from ``start_batch`` on (a resumed run skips what it trained;
        ``per_rank_blocks``: from that block on)."""
        if self.per_rank_blocks:
            return self._blocks(epoch, start_block=start_batch)
        order = self.indices(epoch)
        starts = range(0, len(order), self.batch_size)
        if self.config.drop_last:
            starts = range(0, len(order) - self.batch_size + 1, self.batch_size)
        augment = _Augment(self.seed, epoch, self.rank) if self.config.augment else None
        return self._read(order, starts, augment, start_batch=start_batch)

    def _blocks(
        self, epoch: int, *, start_block: int
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        order = rank_block_indices(
            self.order,
            epoch=epoch,
            rank=self.rank,
            replicas=self.world_size,
            start_block=start_block,
            block=self.batch_size,
        )
        starts = range(0, len(order), self.batch_size)
        # Seeded by the block, whichever rank reads it: the same crops on any world.
        augment = _Augment(self.seed, epoch, 0) if self.config.augment else None

        def block_of(start: int) -> int:
            return start_block + self.rank + self.world_size * (start // self.batch_size)

        return self._read(order, starts, augment, start_batch=0, augment_key=block_of)

    def _read(
        self,
        order: np.ndarray,
        starts: range,
        augment: "_Augment | None",
        *,
        start_batch: int,
        augment_key: Callable[[int], int] | None = None,
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:

        def read(batch: int, start: int) -> tuple[torch.Tensor, torch.Tensor]:
            index = order[start : start + self.batch_size]
            x = torch.from_numpy(self._cache.take(index))
            y = torch.from_numpy(self.split.labels[index])
            x = augment(x, augment_key(start) if augment_key else batch) if augment else x
            if self.pin_memory:
                # In the prefetch thread, while the current batch trains.
                x, y = x.pin_memory(), y.pin_memory()
            return x, y

        batches = (read(batch, start) for batch, start in enumerate(starts) if batch >= start_batch)
        if self.config.prefetch_batches:
            return _prefetched(batches, self.config.prefetch_batches)
        return batches


# How often a prefetch thread waiting for room looks whether its consumer has gone (a consumer
# that goes makes room for it at once as well: _prefetched).
HAND_OVER_POLL_S = 0.1


def _prefetched(batches: Iterator[Any], depth: int) -> Iterator[Any]:
    """Read the next batches in a thread while the current one trains (zarr I/O
    releases the GIL)."""
    slots: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()
    done = object()

    def hand_over(item: Any) -> bool:
        """Put item in the queue unless the consumer has gone; False once it has."""
        while not stop.is_set():
            try:
                slots.put(item, timeout=HAND_OVER_POLL_S)
            except queue.Full:
                continue
            # The consumer may have gone while this waited: its drain below made the room.
            return not stop.is_set()
        return False

    def produce() -> None:
        try:
            for batch in batches:
                if not hand_over(batch):
                    return
            hand_over(done)
        except BaseException as error:  # handed to the consumer, raised there
            hand_over(error)

    thread = threading.Thread(target=produce, name="dask-train-prefetch", daemon=True)
    thread.start()
    try:
        while (item := slots.get()) is not done:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        # A producer waiting for room (a run that ends before its epoch does: max_steps, a
        # resize, a stop) gets it now and sees the stop, rather than at its put's timeout,
        # which every such job waited out before its rank could return (up to 0.1 s).
        with contextlib.suppress(queue.Empty):
            while True:
                slots.get_nowait()
        thread.join(timeout=5)


class _Augment:
    """Random crop from a 4-pixel reflection pad, and horizontal flip, seeded per epoch, rank and
    batch: a run resumed mid-epoch draws exactly what it would have drawn."""

    def __init__(self, seed: int, epoch: int, rank: int) -> None:
        self.seed, self.epoch, self.rank = seed, epoch, rank
        self.generator = torch.Generator()

    def __call__(self, x: torch.Tensor, batch: int) -> torch.Tensor:
        # Tuples of ints hash the same in every process (no hash randomization for ints).
        self.generator.manual_seed(hash((self.seed, self.epoch, self.rank, batch)) % 2**63)
        n, _, h, w = x.shape
        padded = torch.nn.functional.pad(x, (4, 4, 4, 4), mode="reflect")
        dy = torch.randint(0, 9, (n,), generator=self.generator)
        dx = torch.randint(0, 9, (n,), generator=self.generator)
        flip = torch.rand(n, generator=self.generator) < 0.5
        out = torch.empty_like(x)
        for i in range(n):
            crop = padded[i, :, dy[i] : dy[i] + h, dx[i] : dx[i] + w]
            out[i] = crop.flip(-1) if flip[i] else crop
        return out


def eval_batches(
    split: StoreSplit, *, rank: int, world_size: int, batch_size: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's contiguous, unpadded share of the validation set: sums across ranks count
    every sample exactly once."""
    n = len(split)
    share = -(-n // world_size)
    start, stop = rank * share, min(n, (rank + 1) * share)
    for begin in range(start, stop, batch_size):
        end = min(stop, begin + batch_size)
        yield (
            torch.from_numpy(as_features(split.images[begin:end], tokens=split.tokens)),
            torch.from_numpy(split.labels[begin:end]),
        )


def fixed_shape_eval_batches(
    split: StoreSplit, *, rank: int, world_size: int, batch_size: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor, int]]:
    """The same share as :func:`eval_batches`, as ``(images, labels, real_rows)`` batches that
    all have ``batch_size`` rows, and the same number of batches on every rank.

    A pipeline's stages exchange fixed-shape buffers and sharded replicas gather parameters in
    lockstep, so the tail is padded with zeros and the caller counts only ``real_rows``.
    """
    n = len(split)
    share = -(-n // world_size)
    start, stop = rank * share, min(n, (rank + 1) * share)
    for begin in range(start, start + share, batch_size):
        end = max(begin, min(stop, begin + batch_size))
        real = end - begin
        images = split.zeros(batch_size)
        # A regression's targets are floats (and may be rows): the padding takes their shape.
        labels = torch.zeros(
            (batch_size, *split.labels.shape[1:]),
            dtype=torch.from_numpy(split.labels[:0]).dtype,
        )
        if real:
            images[:real] = torch.from_numpy(
                as_features(split.images[begin:end], tokens=split.tokens)
            )
            labels[:real] = torch.from_numpy(split.labels[begin:end])
        yield images, labels, real
