"""cifar10: CIFAR-10 in torchvision's on-disk format (pickled batches), under ``data.root``,
local or any fsspec URL. One record a batch file: a partition reads its file once.

``predict`` scores its test batch: the file itself, or the CIFAR-10 folder (or the folder
above it) that holds it.

A batch is a pickle, and ``pickle.load`` runs whatever a pickle names: a planted batch would
run code on every worker that reads it. Batches are read with ``read_batch`` instead, which
admits only what a CIFAR-10 batch is made of and refuses the rest unrun."""

import functools
import json
import pickle
import pickletools
from typing import IO, TYPE_CHECKING, Any

import fsspec
import numpy as np
from PIL import Image

from workers.compat.cpython_private import PurePythonUnpickler
from workers.sources.base import (
    Decoded,
    Decoding,
    InputPlan,
    InputRequest,
    Listing,
    Partition,
    Source,
    SourceError,
    digest,
    file_stamp,
    look_at_root,
    register,
    required_root,
)
from workers.sources.images import resize, stack

if TYPE_CHECKING:
    from workers.spec.sections import DataConfig

CIFAR_FOLDER = "cifar-10-batches-py"
CIFAR_TRAIN = tuple(f"data_batch_{i}" for i in range(1, 6))
CIFAR_TEST = ("test_batch",)
(TEST_BATCH,) = CIFAR_TEST
# What reading a batch raises for a file that is not one: named, never "training failed".
UNREADABLE = (EOFError, OSError, ValueError, KeyError, TypeError, pickle.UnpicklingError)


def cifar10_folder(root: str, storage_options: dict[str, Any]) -> tuple[Any, str]:
    """The filesystem and path of ``root``'s batch folder; a SourceError naming it if absent."""
    folder = root.rstrip("/") + "/" + CIFAR_FOLDER
    # One look, through the sources' one wrapping of a backend's errors (an s3:// root without
    # s3fs, missing credentials): a SourceError naming data.root, not a traceback.
    fs, base, found = look_at_root(folder, storage_options, lambda fs, path: fs.isdir(path))
    if not found:
        # A local folder: how to fetch it there, as docs/getting-started.md shows (torchvision
        # checks the archive's published MD5).
        fetch = (
            f'fetch it with python -c "from torchvision.datasets import CIFAR10; '
            f"CIFAR10('{root}', download=True)\" (or set data.download = true), or "
            if "://" not in root
            else ""
        )
        raise SourceError(
            f"data.root: {root}/{CIFAR_FOLDER} does not exist; {fetch}point data.root at the "
            "folder holding cifar-10-batches-py"
        )
    return fs, base


@register
class Cifar10(Source):
    name = "cifar10"

    @classmethod
    def check_root(cls, data: "DataConfig") -> None:
        if data.download:
            return  # the download makes it
        cifar10_folder(required_root(data), data.storage_options)

    @classmethod
    def listing(cls, data: "DataConfig", *, seed: int) -> Listing:
        root = required_root(data)
        fs, base = cifar10_folder(root, data.storage_options)
        names = CIFAR_TRAIN + CIFAR_TEST
        missing = [name for name in names if not fs.isfile(f"{base}/{name}")]
        if missing:
            raise SourceError(f"data.root: {root}/{CIFAR_FOLDER} lacks {', '.join(missing)}")
        files = {name: fs.unstrip_protocol(f"{base}/{name}") for name in names}
        stamps = [file_stamp(fs.info(f"{base}/{name}")) for name in names]
        fingerprint = digest("cifar10", list(zip(files.values(), stamps, strict=True)))
        # Sample counts are read from each file at decode time.
        return Listing(
            train=[files[name] for name in CIFAR_TRAIN],
            val=[files[name] for name in CIFAR_TEST],
            classes=[f"class{i}" for i in range(10)],
            fingerprint=fingerprint,
            partition_size=1,
        )

    @classmethod
    def decode(cls, records: list[Any], how: Decoding) -> Decoded:
        images: list[np.ndarray] = []
        labels: list[int] = []
        bad: list[tuple[str, str]] = []
        for url in records:
            try:
                with fsspec.open(url, "rb", **how.storage_options) as f:
                    batch = read_batch(f)  # rows of uint8 images, one int label each
                data = batch["data"].reshape(-1, 3, 32, 32)
                batch_labels = batch["labels"]
            except UNREADABLE as error:
                why = _why(error)
                if how.on_bad == "fail":
                    raise SourceError(f"{url}: not a readable CIFAR-10 batch ({why})") from error
                bad.append((url, why))
                continue
            for image in data:
                if how.image_size != 32:
                    image = resize(Image.fromarray(image.transpose(1, 2, 0)), how.image_size)
                images.append(image)
            labels.extend(batch_labels)
        return Decoded(*stack(images, labels, how.image_size), bad=bad)

    @classmethod
    def prediction_input(
        cls, fs: Any, path: str, url: str, request: InputRequest
    ) -> InputPlan | None:
        batch = _test_batch(fs, path)
        if batch is None:
            return None
        batch_url = fs.unstrip_protocol(batch)
        parts = [
            Partition(i, lo, hi, "cifar10", batch_url, split=TEST_BATCH, rows=(lo, hi))
            for i, (lo, hi) in enumerate(request.ranges(_batch_size(fs, batch)))
        ]
        return InputPlan("cifar10", batch_url, parts, [f"class{i}" for i in range(10)])

    @classmethod
    def prediction_images(
        cls, partition: Partition, how: Decoding
    ) -> tuple[np.ndarray, np.ndarray]:
        assert partition.rows is not None
        images, labels = _decoded_batch(
            partition.url, how.image_size, json.dumps(how.storage_options, sort_keys=True)
        )
        lo, hi = partition.rows
        return images[lo:hi], labels[lo:hi]


@functools.lru_cache(maxsize=2)
def _decoded_batch(url: str, image_size: int, options: str) -> tuple[np.ndarray, np.ndarray]:
    # One pickled batch holds 10,000 images: its partitions on this worker decode it once.
    decoded = Cifar10.decode([url], Decoding(image_size, storage_options=json.loads(options)))
    return decoded.images, decoded.labels


def _test_batch(fs: Any, path: str) -> str | None:
    if fs.isfile(path):
        return path if path.rstrip("/").endswith(TEST_BATCH) else None
    for candidate in (f"{path}/{TEST_BATCH}", f"{path}/{CIFAR_FOLDER}/{TEST_BATCH}"):
        if fs.isfile(candidate):
            return candidate
    return None


def _batch_size(fs: Any, batch: str) -> int:
    """How many images the batch file holds, checked against its labels."""
    try:
        with fs.open(batch, "rb") as f:
            count = len(read_batch(f)["labels"])  # as many as its images (read_batch checks)
    except UNREADABLE as error:
        raise SourceError(
            f"--input: {fs.unstrip_protocol(batch)}: not a readable CIFAR-10 batch ({_why(error)})"
        ) from None
    return count


# -- reading a batch without running foreign code -------------------------------------------
#
# The official batches are Python 2 pickles (protocol 2; torchvision reads them with
# pickle.load(encoding="latin1")): a dict of str keys holding str, a list of ints (labels), a
# list of str (filenames) and one numpy array, which a pickle rebuilds by calling numpy's
# _reconstruct(ndarray, (0,), "b") and dtype("u1", 0, 1), then setting their state. Numpy 1
# names _reconstruct under numpy.core.multiarray, numpy 2 under numpy._core.multiarray (files
# written by Python 3 carry bytes where Python 2's carry str). As for checkpoints' metadata
# (workers/checkpoint.py), Python's pure-Python unpickler runs each opcode through a table: this
# one holds only the opcodes of such values, every global is one of those three by an exact
# (module, name) pair, and REDUCE and BUILD admit values, not layouts: a dtype only as plain
# uint8 (its state exactly a uint8's: a state may also give a dtype fields, at any offset, and
# decoding would then read past the array's buffer), an array only as the rows of 3,072 such
# bytes that a batch's images are, its buffer exactly that long. What comes out is checked
# too: "data" such an array, "labels" a list of ints, one a row.


class BatchRefused(pickle.UnpicklingError):
    """A batch file whose pickle is not a CIFAR-10 batch: refused before anything in it ran."""


def _numpy_reconstruct() -> Any:
    try:
        from numpy._core.multiarray import _reconstruct  # numpy 2
    except ImportError:  # numpy 1
        from numpy.core.multiarray import _reconstruct  # type: ignore[no-redef]
    return _reconstruct


_RECONSTRUCT = _numpy_reconstruct()
_GLOBALS = {
    ("numpy.core.multiarray", "_reconstruct"): _RECONSTRUCT,
    ("numpy._core.multiarray", "_reconstruct"): _RECONSTRUCT,
    ("numpy", "ndarray"): np.ndarray,
    ("numpy", "dtype"): np.dtype,
}
# Protocols 0 to 5: the structure, memo and value opcodes of dicts, lists, tuples, str,
# bytes, ints, bools and None, and the globals, REDUCE and BUILD that numpy's arrays need.
# Never INST, OBJ, NEWOBJ or NEWOBJ_EX, which call or create what a global names unchecked.
_OPCODES = (
    *(pickle.PROTO, pickle.FRAME, pickle.STOP, pickle.MARK, pickle.POP, pickle.POP_MARK),
    *(pickle.DUP, pickle.EMPTY_DICT, pickle.DICT, pickle.SETITEM, pickle.SETITEMS),
    *(pickle.EMPTY_LIST, pickle.LIST, pickle.APPEND, pickle.APPENDS, pickle.EMPTY_TUPLE),
    *(pickle.TUPLE, pickle.TUPLE1, pickle.TUPLE2, pickle.TUPLE3),
    *(pickle.PUT, pickle.BINPUT, pickle.LONG_BINPUT, pickle.MEMOIZE),
    *(pickle.GET, pickle.BINGET, pickle.LONG_BINGET),
    *(pickle.NONE, pickle.NEWTRUE, pickle.NEWFALSE, pickle.INT, pickle.BININT),
    *(pickle.BININT1, pickle.BININT2, pickle.LONG, pickle.LONG1, pickle.LONG4),
    *(pickle.STRING, pickle.BINSTRING, pickle.SHORT_BINSTRING),
    *(pickle.UNICODE, pickle.BINUNICODE, pickle.SHORT_BINUNICODE, pickle.BINUNICODE8),
    *(pickle.BINBYTES, pickle.SHORT_BINBYTES, pickle.BINBYTES8),
    *(pickle.GLOBAL, pickle.STACK_GLOBAL, pickle.REDUCE, pickle.BUILD),
)
IMAGE_BYTES = 3 * 32 * 32  # one image: a row of a batch's data
# What numpy pickles for a uint8 dtype: dtype("u1", False, True), then this state (version 3,
# no byte order, no subarray, no names, no fields, and the -1s of a type of fixed size).
_UINT8 = np.dtype(np.uint8)
_UINT8_STATE = _UINT8.__reduce__()[2]
# An array: _reconstruct(ndarray, (0,), "b"), then (version, shape, dtype, Fortran?, bytes).
_ARRAY_STATE_VERSION = 1


def _same_values(given: Any, expected: tuple[Any, ...]) -> bool:
    """Whether ``given`` is ``expected``, a tuple of plain values, value for value and type for
    type (a bool is no int here, nor a str bytes)."""
    return (
        type(given) is tuple
        and len(given) == len(expected)
        and all(type(a) is type(b) and a == b for a, b in zip(given, expected, strict=True))
    )


def _plain_uint8(value: Any) -> bool:
    """A dtype instance that is uint8 and nothing more. Not ``==``: a uint8 that a state gave
    fields still compares equal to uint8."""
    return (
        type(value) is type(_UINT8)
        and value == _UINT8
        and value.names is None
        and value.fields is None
        and value.subdtype is None
        and value.itemsize == 1
        and not value.hasobject
    )


def _refusal(code: int) -> Any:
    name = _OPCODE_NAMES.get(code, f"byte {code:#04x}")

    def refuse(self: PurePythonUnpickler) -> None:
        raise BatchRefused(f"its pickle uses {name}, which no CIFAR-10 batch holds: refused")

    return refuse


_OPCODE_NAMES = {op.code.encode("latin1")[0]: op.name for op in pickletools.opcodes}


class _BatchUnpickler(PurePythonUnpickler):
    dispatch = {code: _refusal(code) for code in range(256)} | {
        op[0]: PurePythonUnpickler.dispatch[op[0]]  # type: ignore[attr-defined]
        for op in _OPCODES
    }

    def find_class(self, module: str, name: str) -> Any:
        found = _GLOBALS.get((module, name))
        if found is None:
            raise BatchRefused(
                f"its pickle refers to {module}.{name}, which no CIFAR-10 batch holds: "
                "refused unrun"
            )
        return found

    def load_reduce(self) -> None:
        func, args = self.stack[-2], self.stack[-1]
        if func is _RECONSTRUCT:
            fits = (
                type(args) is tuple
                and len(args) == 3
                and args[0] is np.ndarray
                and _same_values(args[1], (0,))
                and (_same_values(args[2:], ("b",)) or _same_values(args[2:], (b"b",)))
            )
        elif func is np.dtype:
            # dtype("u1", 0, 1): numpy 1 under Python 2 wrote ints, numpy 2 writes bools.
            fits = (
                type(args) is tuple
                and len(args) == 3
                and type(args[0]) is str
                and args[0] == "u1"
                and all(type(flag) in (int, bool) for flag in args[1:])
                and tuple(args[1:]) == (0, 1)
            )
        else:
            fits = False
        if not fits:
            called = getattr(func, "__name__", type(func).__name__)
            raise BatchRefused(
                f"its pickle calls {called} in a way no CIFAR-10 batch does: refused"
            )
        super().load_reduce()

    def load_build(self) -> None:
        state, inst = self.stack[-1], self.stack[-2]
        # type(), not isinstance: a class itself (whose attributes BUILD would set) never
        # passes, nor does a subclass.
        if type(inst) is np.ndarray:
            fits = _image_rows(state)
        elif type(inst) is type(_UINT8):
            fits = _plain_uint8(inst) and _same_values(state, _UINT8_STATE)
        else:
            fits = False
        if not fits:
            what = "dtype" if isinstance(inst, np.dtype) else repr(type(inst))
            raise BatchRefused(
                f"its pickle sets the state of {what} other than to a CIFAR-10 batch's "
                "uint8 images: refused"
            )
        super().load_build()

    dispatch[pickle.REDUCE[0]] = load_reduce
    dispatch[pickle.BUILD[0]] = load_build


def _image_rows(state: Any) -> bool:
    """Whether ``state`` makes an array a batch's images: rows of 3,072 plain uint8 values,
    C order, from a buffer exactly that long (an 8-bit str under Python 2's pickles)."""
    if type(state) is not tuple or len(state) != 5:
        return False
    version, shape, dtype, fortran, buffer = state
    return (
        type(version) is int
        and version == _ARRAY_STATE_VERSION
        and type(shape) is tuple
        and len(shape) == 2
        and all(type(n) is int for n in shape)
        and shape[0] >= 0
        and shape[1] == IMAGE_BYTES
        and _plain_uint8(dtype)
        and type(fortran) in (bool, int)
        and not fortran
        and type(buffer) in (bytes, str)
        and len(buffer) == shape[0] * IMAGE_BYTES
    )


def read_batch(file: IO[bytes]) -> dict[str, Any]:
    """The dict a CIFAR-10 batch file holds, read without running anything it names:
    BatchRefused for anything a batch is not made of, before it ran; an UnpicklingError (or
    EOFError, OSError) for a damaged file."""
    try:
        batch = _BatchUnpickler(file, encoding="latin1").load()
    except (pickle.UnpicklingError, EOFError, OSError):
        raise
    except Exception as error:  # a damaged pickle: Python's unpickler raises IndexError & co.
        raise pickle.UnpicklingError(f"{type(error).__name__}: {error}") from None
    if type(batch) is not dict:
        raise BatchRefused(f"its pickle holds a {type(batch).__name__}, not a batch's dict")
    _check_values(batch)
    return batch


def _check_values(batch: dict[str, Any]) -> None:
    """A batch's images and labels as the format has them: BatchRefused otherwise."""
    data, labels = batch.get("data"), batch.get("labels")
    # Every array that got through BUILD is rows of images; one REDUCE made without its BUILD
    # (an empty int8 array) is not.
    if type(data) is not np.ndarray or data.ndim != 2 or not _plain_uint8(data.dtype):
        raise BatchRefused("its data is not rows of 3,072 uint8 values (3x32x32 images)")
    if type(labels) is not list or any(type(label) is not int for label in labels):
        raise BatchRefused("its labels are not a list of ints")
    if len(labels) != len(data):
        raise BatchRefused(f"it holds {len(data)} images but {len(labels)} labels")


def _why(error: Exception) -> str:
    return str(error) if isinstance(error, BatchRefused) else f"{type(error).__name__}: {error}"
