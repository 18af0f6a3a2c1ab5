"""CIFAR-10 batch files that someone planted: a pickle that would run code is refused unrun,
by the workers that decode batches and by the command that plans a prediction; the real
format (Python 2's pickles, and what Python 3 and numpy 2 write) still reads. Every payload
is shown to work against an unrestricted loader first, so a refusal here is a real one."""

import copyreg
import importlib.util
import io
import json
import pickle
import re
import struct
from pathlib import Path

import fsspec
import numpy as np
import pytest
import torch

from tests.commands import CONFIGS, run_dask_train
from tests.datasets import write_tiny_cifar10
from workers.models import build_model
from workers.sources import Decoding, InputRequest, SourceError
from workers.sources.cifar10 import BatchRefused, Cifar10, read_batch
from workflows.runs.config import load_config

# -- hand-assembled pickles -------------------------------------------------------------------


def _int(n: int) -> bytes:
    if 0 <= n < 256:
        return pickle.BININT1 + bytes([n])
    if 0 <= n < 65536:
        return pickle.BININT2 + struct.pack("<H", n)
    return pickle.BININT + struct.pack("<i", n)


def _str2(data: bytes) -> bytes:
    """A Python 2 str: 8 bits, read back as str under encoding="latin1"."""
    if len(data) < 256:
        return pickle.SHORT_BINSTRING + bytes([len(data)]) + data
    return pickle.BINSTRING + struct.pack("<i", len(data)) + data


def _s(text: str) -> bytes:
    data = text.encode()
    return pickle.SHORT_BINUNICODE + bytes([len(data)]) + data


def python2_array(data: np.ndarray) -> bytes:
    """A uint8 array as numpy 1 under Python 2 pickled it: _reconstruct under
    numpy.core.multiarray, then the dtype and the array's state, its bytes an 8-bit str."""
    return (
        pickle.GLOBAL
        + b"numpy.core.multiarray\n_reconstruct\n"
        + pickle.BINPUT
        + b"\x02"
        + pickle.GLOBAL
        + b"numpy\nndarray\n"
        + pickle.BINPUT
        + b"\x03"
        + _int(0)
        + pickle.TUPLE1
        + _str2(b"b")
        + pickle.TUPLE3
        + pickle.REDUCE
        + pickle.MARK
        + _int(1)
        + _int(data.shape[0])
        + _int(data.shape[1])
        + pickle.TUPLE2
        + pickle.GLOBAL
        + b"numpy\ndtype\n"
        + _str2(b"u1")
        + _int(0)
        + _int(1)
        + pickle.TUPLE3
        + pickle.REDUCE
        + pickle.MARK
        + _int(3)
        + _str2(b"|")
        + pickle.NONE * 3
        + _int(-1) * 2
        + _int(0)
        + pickle.TUPLE
        + pickle.BUILD
        + pickle.NEWFALSE
        + _str2(data.tobytes())
        + pickle.TUPLE
        + pickle.BUILD
    )


def python2_batch(
    labels: list[int], filenames: list[bytes], *, data: np.ndarray | None = None, value=b""
) -> bytes:
    """A batch as Python 2's cPickle wrote the official files (protocol 2), str values as 8-bit
    strings; its "data" the pickle of ``data``, or ``value`` (pickled items) in its place."""
    items = {
        b"batch_label": _str2(b"training batch 1 of 5"),
        b"data": python2_array(data) if data is not None else value,
        b"labels": pickle.EMPTY_LIST + pickle.MARK + b"".join(map(_int, labels)) + pickle.APPENDS,
        b"filenames": pickle.EMPTY_LIST
        + pickle.MARK
        + b"".join(map(_str2, filenames))
        + pickle.APPENDS,
    }
    body = b"".join(_str2(key) + value for key, value in items.items())
    return (
        pickle.PROTO
        + b"\x02"
        + pickle.EMPTY_DICT
        + pickle.BINPUT
        + b"\x01"
        + pickle.MARK
        + body
        + pickle.SETITEMS
        + pickle.STOP
    )


EXTENSION_CODE = 0xF2  # a private copyreg extension code, registered for one test only


class _System:
    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return (__import__("os").system, (self.command,))


def _payloads(marker: Path) -> dict[str, bytes]:
    """Each, unpickled freely, creates ``marker``."""
    touch = f"touch {marker}"
    tofile = pickle.dumps(np.zeros(1, np.uint8), protocol=2)[2:-1]  # no PROTO, no STOP
    return {
        # A batch as Python 2 wrote them, its "data" a command (as Python 2 named os.system).
        "a batch whose data is os.system": python2_batch(
            [0],
            [b"x.png"],
            value=b"cos\nsystem\n" + _str2(touch.encode()) + pickle.TUPLE1 + pickle.REDUCE,
        ),
        # What Python 3 writes for a dict holding an object that reduces to os.system.
        "posix.system, protocol 4": pickle.dumps({"data": _System(touch), "labels": []}),
        # A dotted name from an allowed module: protocol 4 resolves it as an attribute chain,
        # here to ndarray.tofile, which writes an array to the named file.
        "a chain from numpy": pickle.PROTO
        + b"\x04"
        + _s("numpy")
        + _s("ndarray.tofile")
        + pickle.STACK_GLOBAL
        + pickle.MARK
        + tofile
        + _s(str(marker))
        + pickle.TUPLE
        + pickle.REDUCE
        + pickle.STOP,
        # Protocol 0/1 instantiation: INST and OBJ look the callable up themselves.
        "INST": pickle.PROTO + b"\x02" + pickle.MARK + _s(touch) + b"ios\nsystem\n" + pickle.STOP,
        "OBJ": pickle.PROTO
        + b"\x02"
        + pickle.MARK
        + b"cos\nsystem\n"
        + _s(touch)
        + pickle.OBJ
        + pickle.STOP,
        # copyreg's extension registry names a global by number (registered by the test).
        "copyreg extension": pickle.PROTO
        + b"\x02"
        + pickle.EXT1
        + bytes([EXTENSION_CODE])
        + _s(touch)
        + pickle.TUPLE1
        + pickle.REDUCE
        + pickle.STOP,
    }


REFUSED = {
    "a batch whose data is os.system": r"refers to os\.system",
    "posix.system, protocol 4": r"refers to posix\.system",
    "a chain from numpy": r"refers to numpy\.ndarray\.tofile",
    "INST": r"uses INST",
    "OBJ": r"refers to os\.system",  # its global comes first
    "copyreg extension": r"uses EXT1",
}


@pytest.fixture
def extension():
    copyreg.add_extension("os", "system", EXTENSION_CODE)
    yield
    copyreg.remove_extension("os", "system", EXTENSION_CODE)


def _folder(root: Path) -> Path:
    write_tiny_cifar10(root)
    return root / "cifar-10-batches-py"


# -- the real format reads ---------------------------------------------------------------------


def test_batches_in_the_real_format_read_as_an_unrestricted_load_reads_them(tmp_path):
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, size=(300, 3072), dtype=np.uint8)  # a BINSTRING over 256 bytes
    labels = [int(v) for v in rng.integers(0, 10, size=300)]
    raw = python2_batch(labels, [f"img_{i}.png".encode() for i in range(300)], data=data)
    for batch in (pickle.loads(raw, encoding="latin1"), read_batch(io.BytesIO(raw))):
        assert batch["labels"] == labels and batch["filenames"][299] == "img_299.png"
        assert batch["data"].dtype == np.uint8 and np.array_equal(batch["data"], data)

    # Through the source, as a worker decodes it and as predict counts it: Python 2's batch,
    # and the tests' own, which Python 3 pickles (protocol 4) with this numpy's names:
    # numpy._core under numpy 2, numpy.core under 1.26 (CI's floors run).
    folder = _folder(tmp_path)
    (folder / "data_batch_1").write_bytes(raw)
    decoded = Cifar10.decode([f"file://{folder / 'data_batch_1'}"], Decoding(32))
    assert np.array_equal(decoded.images.reshape(300, 3072), data)
    assert decoded.labels.tolist() == labels and not decoded.bad
    with open(folder / "test_batch", "rb") as f:
        assert np.ndarray.__reduce__(data)[0].__module__.encode() in f.read()
    plan = Cifar10.prediction_input(*_local(folder), request=_request())
    assert plan is not None and plan.partitions[-1].stop == 6

    # A damaged pickle (a stack underflow: Python's unpickler raises IndexError) is named too.
    (folder / "data_batch_2").write_bytes(pickle.PROTO + b"\x02" + pickle.TUPLE + pickle.STOP)
    with pytest.raises(SourceError, match=r"data_batch_2: not a readable .*IndexError"):
        Cifar10.decode([f"file://{folder / 'data_batch_2'}"], Decoding(32))


def _local(folder: Path):
    return fsspec.filesystem("file"), str(folder), f"file://{folder}"


def _request():
    return InputRequest(image_size=32, channels=3, split="val", partition_size=4)


# -- planted payloads are refused unrun ---------------------------------------------------------


@pytest.mark.parametrize("name", list(REFUSED))
def test_a_planted_batch_payload_is_refused_unrun(tmp_path, extension, name):
    potent = tmp_path / "potent"
    pickle.loads(_payloads(potent)[name], encoding="latin1")
    assert potent.exists(), "the payload does nothing even unrestricted"

    folder = _folder(tmp_path / "raw")
    marker = tmp_path / "payload-ran"
    batch = folder / "data_batch_1"
    batch.write_bytes(_payloads(marker)[name])
    url = f"file://{batch}"
    with pytest.raises(SourceError, match=rf"data_batch_1: not a readable .*{REFUSED[name]}"):
        Cifar10.decode([url], Decoding(32))
    # Under on_bad="skip" it is left out and listed, unrun as well.
    skipped = Cifar10.decode(
        [url, f"file://{folder / 'data_batch_2'}"], Decoding(32, on_bad="skip")
    )
    assert [record for record, _ in skipped.bad] == [url] and len(skipped.labels) == 6
    # predict counts a test batch's images on the client, with the same reader.
    (folder / "test_batch").write_bytes(_payloads(marker)[name])
    with pytest.raises(
        SourceError, match=rf"--input: .*test_batch: not a readable .*{REFUSED[name]}"
    ):
        Cifar10.prediction_input(*_local(folder), request=_request())
    assert not marker.exists()


def test_preprocess_and_predict_of_a_planted_batch_exit_2_naming_it_and_run_nothing(
    cluster, tmp_path
):
    folder = _folder(tmp_path / "raw")
    marker = tmp_path / "payload-ran"
    planted = _payloads(marker)["a batch whose data is os.system"]
    (folder / "data_batch_1").write_bytes(planted)
    settings = [
        *("--set", f"data.root='{tmp_path / 'raw'}'"),
        *("--set", f"data.store='{tmp_path / 'store'}'"),
        *("--set", "cluster.dashboard_port=0"),
    ]
    # preprocess: the session cluster's workers decode the batches (each its own process, on
    # this machine: a payload run there would create the marker too).
    scheduler = ("--scheduler", cluster.cluster.scheduler_address)
    done = run_dask_train("preprocess", str(CONFIGS / "cifar10_ddp.toml"), *settings, *scheduler)
    assert done.returncode == 2, done.stderr
    last = done.stderr.splitlines()[-1]
    assert f"{folder / 'data_batch_1'}: not a readable CIFAR-10 batch" in last
    assert "refers to os.system" in last and "Traceback" not in done.stderr
    assert not marker.exists()

    # predict: the command reads the test batch to plan the partitions, before any cluster.
    # The model: a run directory as `run` leaves it, its statistics in its summary.
    (folder / "test_batch").write_bytes(planted)
    run = tmp_path / "run"
    run.mkdir()
    torch.save(build_model("cifar_cnn", num_classes=10, seed=0).state_dict(), run / "model.pt")
    config = load_config(CONFIGS / "cifar10_ddp.toml", [f"data.root='{tmp_path / 'raw'}'"])
    (run / "config.json").write_text(json.dumps(config.model_dump(mode="json")))
    classes = [f"class{i}" for i in range(10)]
    statistics = {"mean": [0.5] * 3, "std": [0.25] * 3, "classes": classes, "image_size": 32}
    (run / "summary.json").write_text(json.dumps({"store": statistics}))
    done = run_dask_train(
        "predict",
        str(CONFIGS / "cifar10_ddp.toml"),
        *settings,
        *("--model", str(run), "--input", str(folder)),
        *("--output", str(tmp_path / "scored")),
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().count("\n") == 0 and "Traceback" not in done.stderr
    assert f"--input: file://{folder / 'test_batch'}: not a readable CIFAR-10 batch" in done.stderr
    assert "refers to os.system" in done.stderr
    assert not marker.exists()


# The module this numpy's pickles name for _reconstruct: numpy._core under numpy 2,
# numpy.core under 1.26 (CI's floors run), where numpy._core does not exist.
MULTIARRAY = (
    b"numpy._core.multiarray"
    if np.lib.NumpyVersion(np.__version__) >= "2.0.0"
    else (b"numpy.core.multiarray")
)


@pytest.mark.parametrize(
    ("body", "refused"),
    [
        # Arrays and dtypes of Python objects, through the allowed globals.
        (
            b"c" + MULTIARRAY + b"\n_reconstruct\ncnumpy\nndarray\nK\x00\x85U\x01O\x87R",
            "calls _reconstruct in a way",
        ),
        (b"cnumpy\ndtype\nU\x02O8K\x00K\x01\x87R", "calls dtype in a way"),
        # An allowed global called other than a batch calls it.
        (b"cnumpy\nndarray\nK\x01\x85R", "calls ndarray in a way"),
        # BUILD on a class itself, which would set its attributes.
        (b"cnumpy\ndtype\n}U\x01xK\x01sb", "sets the state of <class 'numpy._DTypeMeta'>"),
    ],
    ids=["object array", "object dtype", "ndarray called", "BUILD on a class"],
)
def test_numpy_used_other_than_a_batch_uses_it_is_refused(body, refused):
    with pytest.raises(BatchRefused, match=re.escape(refused)):
        read_batch(io.BytesIO(pickle.PROTO + b"\x02" + body + pickle.STOP))


@pytest.mark.parametrize(
    ("root", "told"),
    [
        # ossfs, Alibaba's backend, is not installed: fsspec knows the protocol, cannot load it.
        ("oss://bucket/data", r"cannot read oss://bucket/data/cifar-10-batches-py: "),
        ("memory://absent", r"memory://absent/cifar-10-batches-py does not exist; point"),
    ],
)
def test_a_root_the_backend_cannot_read_is_one_line_naming_data_root(root, told):
    # A backend's own error (a protocol whose package is missing, as an s3:// root without
    # s3fs) is wrapped as every source's is: one line naming the field, not a traceback. (A
    # protocol fsspec does not know is refused as the config loads: tests/test_run_trust.py.)
    if root.startswith("oss:") and importlib.util.find_spec("ossfs") is not None:
        pytest.skip("ossfs is installed here: oss:// can be read")
    data = load_config({"data": {"dataset": "cifar10", "root": root}}).data
    with pytest.raises(SourceError, match=rf"^data\.root: {told}") as error:
        Cifar10.check_root(data)
    assert "\n" not in str(error.value)


# -- values, not layouts ------------------------------------------------------------------------


def _uint8_dtype() -> bytes:
    """dtype("u1", 0, 1) and its state, as numpy pickles a plain uint8."""
    minus_one = pickle.BININT + struct.pack("<i", -1)
    return (
        pickle.GLOBAL
        + b"numpy\ndtype\n"
        + _s("u1")
        + _int(0)
        + _int(1)
        + pickle.TUPLE3
        + pickle.REDUCE
        + pickle.MARK
        + _int(3)
        + _s("|")
        + pickle.NONE * 3
        + minus_one * 2
        + _int(0)
        + pickle.TUPLE
        + pickle.BUILD
    )


def _structured_dtype(base: str, offset: int) -> bytes:
    """dtype(base) given, by its state, one uint8 field ``offset`` bytes in: an itemsize of 1
    whose field lies past the item, and past the buffer of any array of it."""
    return (
        pickle.GLOBAL
        + b"numpy\ndtype\n"
        + _s(base)
        + _int(0)
        + _int(1)
        + pickle.TUPLE3
        + pickle.REDUCE
        + pickle.MARK
        + _int(3)
        + _s("|")
        + pickle.NONE
        + _s("f0")
        + pickle.TUPLE1
        + pickle.EMPTY_DICT
        + _s("f0")
        + _uint8_dtype()
        + _int(offset)
        + pickle.TUPLE2
        + pickle.SETITEM
        + _int(1)
        + _int(1)
        + _int(16)
        + pickle.TUPLE
        + pickle.BUILD
    )


def _image_array(dtype: bytes, rows: int, *, columns: int = 3072, spare: int = 0) -> bytes:
    """An array of ``rows`` images as this numpy pickles it, of the dtype that ``dtype`` makes
    (``columns`` bytes a row, its buffer ``spare`` bytes longer than they need)."""
    return (
        pickle.GLOBAL
        + MULTIARRAY
        + b"\n_reconstruct\n"
        + pickle.GLOBAL
        + b"numpy\nndarray\n"
        + _int(0)
        + pickle.TUPLE1
        + pickle.SHORT_BINBYTES
        + b"\x01b"
        + pickle.TUPLE3
        + pickle.REDUCE
        + pickle.MARK
        + _int(1)
        + _int(rows)
        + _int(columns)
        + pickle.TUPLE2
        + dtype
        + pickle.NEWFALSE
        + pickle.BINBYTES
        + struct.pack("<I", rows * columns + spare)
        + bytes(rows * columns + spare)
        + pickle.TUPLE
        + pickle.BUILD
    )


OUT_OF_BOUNDS = 1 << 30  # a field a gigabyte past a 3,072-byte buffer


@pytest.mark.parametrize(
    ("base", "refused"),
    [("V1", "calls dtype in a way"), ("u1", "sets the state of dtype other than")],
    ids=["void", "uint8 given fields"],
)
def test_a_structured_dtype_whose_field_lies_past_the_buffer_is_refused(tmp_path, base, refused):
    # The reproduction: decoding such a batch read other heap bytes as images, and at a
    # larger offset the worker died of SIGSEGV. Unrestricted, the array comes back with its
    # field a gigabyte past its buffer (looked at, never read: that would crash this process).
    raw = python2_batch(
        [0], [b"x.png"], value=_image_array(_structured_dtype(base, OUT_OF_BOUNDS), 1)
    )
    # Only its dtype is kept: a failed assertion's report would print the array itself.
    layout = pickle.loads(raw, encoding="latin1")["data"].dtype
    assert layout.itemsize == 1 and layout.fields["f0"][1] == OUT_OF_BOUNDS
    if base == "u1":
        assert layout == np.uint8  # numpy's == does not tell it from a plain uint8

    with pytest.raises(BatchRefused, match=refused):
        read_batch(io.BytesIO(raw))
    folder = _folder(tmp_path)
    (folder / "data_batch_1").write_bytes(raw)
    with pytest.raises(SourceError) as refused:
        Cifar10.decode([f"file://{folder / 'data_batch_1'}"], Decoding(32))
    assert str(refused.value).startswith(f"file://{folder / 'data_batch_1'}: not a readable")
    assert "\n" not in str(refused.value)

    # The same bytes under a plain uint8 read: the refusal is the layout's, not the array's.
    plain = python2_batch([0], [b"x.png"], value=_image_array(_uint8_dtype(), 1))
    assert read_batch(io.BytesIO(plain))["data"].shape == (1, 3072)


@pytest.mark.parametrize(
    ("value", "refused"),
    [
        # Images not 3,072 bytes a row, a buffer longer than its shape, no array at all.
        (_image_array(_uint8_dtype(), 1, columns=3071), "sets the state"),
        (_image_array(_uint8_dtype(), 1, spare=1), "sets the state"),
        (_int(1) + _int(2) + pickle.TUPLE2, "its data is not rows"),
    ],
    ids=["rows of 3071", "a buffer longer than its shape", "a tuple"],
)
def test_images_other_than_a_batchs_rows_of_uint8_are_refused(value, refused):
    with pytest.raises(BatchRefused, match=refused):
        read_batch(io.BytesIO(python2_batch([0], [b"x.png"], value=value)))


def test_labels_other_than_one_int_an_image_are_refused():
    images = np.zeros((2, 3072), np.uint8)
    with pytest.raises(BatchRefused, match=r"2 images but 1 labels"):
        read_batch(io.BytesIO(python2_batch([0], [b"x.png"], data=images)))
    labels = pickle.EMPTY_LIST + pickle.MARK + _int(0) + _str2(b"1") + pickle.APPENDS
    as_str = python2_batch([0, 1], [b"x.png"], data=images).replace(
        pickle.EMPTY_LIST + pickle.MARK + _int(0) + _int(1) + pickle.APPENDS, labels
    )
    assert as_str.count(labels) == 1
    with pytest.raises(BatchRefused, match=r"labels are not a list of ints"):
        read_batch(io.BytesIO(as_str))


def _ndarray_by(opcode: bytes) -> bytes:
    """np.ndarray((1,), "O"), an array of Python objects, made by ``opcode`` on the allowed
    global numpy.ndarray, never through REDUCE."""
    args = _int(1) + pickle.TUPLE1 + _s("O")
    ndarray = pickle.GLOBAL + b"numpy\nndarray\n"
    return {
        pickle.INST: pickle.MARK + args + pickle.INST + b"numpy\nndarray\n",
        pickle.OBJ: pickle.MARK + ndarray + args + pickle.OBJ,
        pickle.NEWOBJ: ndarray + args + pickle.TUPLE2 + pickle.NEWOBJ,
        pickle.NEWOBJ_EX: ndarray + args + pickle.TUPLE2 + pickle.EMPTY_DICT + pickle.NEWOBJ_EX,
    }[opcode]


@pytest.mark.parametrize("opcode", ["INST", "OBJ", "NEWOBJ", "NEWOBJ_EX"])
def test_instances_of_allowed_globals_other_than_by_reduce_are_refused(opcode):
    # The globals check passes numpy.ndarray: only the opcode's own refusal stands between the
    # payload and an array of Python objects (which unrestricted loading returns).
    raw = python2_batch([0], [b"x.png"], value=_ndarray_by(getattr(pickle, opcode)))
    made = pickle.loads(raw, encoding="latin1")["data"]
    assert type(made) is np.ndarray and made.dtype == object
    with pytest.raises(BatchRefused, match=rf"uses {opcode}, which no CIFAR-10 batch holds"):
        read_batch(io.BytesIO(raw))
