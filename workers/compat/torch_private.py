"""torch's private APIs that dask-train relies on, all of them, checked at import.

Run with torch 2.13.0 and 2.14.1 (``pyproject.toml`` claims 2.14). Where one is missing,
importing this module fails with one line: ``ImportError: dask-train needs <name> (torch
2.13.0 and 2.14.1 have it; this is torch X.Y)``. Importing it costs what importing DCP
costs (~0.5 s, DTensor included); the modules that need it import it where they already pay
for that, or on first use.

- DTensor's caches, keyed by meshes that compare equal across jobs: emptied before each job
  (:func:`forget_dtensor_caches`, see ``workers/device_mesh.py``).
- ``DeviceMesh._flatten``: one dimension over several of a mesh's (the pipeline's replicas);
  torch has no public way yet.
- ``torch._foreach_copy_``: one kernel for a list of copies (live recovery's buffers); torch's
  docs announce ``torch.foreach.copy_`` for it, not in 2.14.
- DCP's fsspec writer and reader (checkpoints on object stores), public classes in a private
  module: :data:`FSSPEC_WRITER`, :data:`FSSPEC_READER`.
- DCP's file writers' ``fs`` (their ``FileSystemBase``, which opens every file they write), set
  in the constructor and not documented: :func:`hash_as_written` wraps it to hash each file's
  bytes as they are written (checkpoints' manifests, ``workers/checkpoint.py``).
- ``DTensor.__create_chunk_list__``: where a rank's piece of a DTensor lies in the whole
  (:func:`local_offsets`: the model handed to the client in pieces, workers/model_pieces.py).
- The private names DCP's ``.metadata`` pickle refers to, which the restricted unpickler of
  ``workers/checkpoint.py`` must admit by name: :data:`DCP_PRIVATE_CLASSES`, :data:`GET_LAYOUT`.
"""

import contextlib
import hashlib
import importlib
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch

from workers.compat import constructor_sets

RUN_WITH = "torch 2.13.0 and 2.14.1 have it"


def _needed(path: str) -> Any:
    """The object at ``module:attribute.attribute``, or the one-line ImportError."""
    module_name, _, attributes = path.partition(":")
    try:
        found: Any = importlib.import_module(module_name)
        for attribute in filter(None, attributes.split(".")):
            found = getattr(found, attribute)
    except (ImportError, AttributeError):
        name = path.replace(":", ".")
        raise ImportError(
            f"dask-train needs {name} ({RUN_WITH}; this is torch {torch.__version__})"
        ) from None
    return found


# -- DTensor's caches ----------------------------------------------------------------------

_redistribute = _needed("torch.distributed.tensor._redistribute")
_clear_sharding_prop_cache: Callable[[], None] = _needed(
    "torch.distributed.tensor.debug:_clear_sharding_prop_cache"
)
_needed("torch.distributed.tensor._redistribute:clear_redistribute_planner_cache")
_needed("torch.distributed.tensor._redistribute:_gen_transform_infos.cache_clear")
_MeshTopoInfo = _needed("torch.distributed.tensor._collective_utils:MeshTopoInfo")
_needed("torch.distributed.tensor._collective_utils:MeshTopoInfo.build_from_mesh.cache_clear")


def forget_dtensor_caches() -> None:
    """Empty DTensor's sharding-propagation cache (this thread's and the process's), its
    redistribution planners and transforms, and its mesh topologies."""
    _clear_sharding_prop_cache()
    _redistribute.clear_redistribute_planner_cache()
    _redistribute._gen_transform_infos.cache_clear()
    _MeshTopoInfo.build_from_mesh.cache_clear()


# -- DeviceMesh ----------------------------------------------------------------------------

_needed("torch.distributed.device_mesh:DeviceMesh._flatten")


def flatten_mesh(mesh: Any, name: str) -> Any:
    """``mesh`` (a sub-mesh of several dimensions) as one dimension called ``name``."""
    return mesh._flatten(name)


# -- foreach -------------------------------------------------------------------------------

_needed("torch:_foreach_copy_")


def foreach_copy_(destinations: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """Copy each of ``sources`` into the destination of the same index."""
    torch._foreach_copy_(destinations, sources)


# -- DCP over fsspec ----------------------------------------------------------------------

# torch.distributed.checkpoint does not re-export them (2.14); the module imports fsspec.
FSSPEC_WRITER: type = _needed("torch.distributed.checkpoint._fsspec_filesystem:FsspecWriter")
FSSPEC_READER: type = _needed("torch.distributed.checkpoint._fsspec_filesystem:FsspecReader")


# -- DCP's writers' filesystem -------------------------------------------------------------

_FILE_SYSTEM_WRITER = _needed("torch.distributed.checkpoint.filesystem:_FileSystemWriter")
for _writer in (_FILE_SYSTEM_WRITER, FSSPEC_WRITER):
    if not constructor_sets(_writer.__init__, "fs"):
        raise ImportError(
            f"dask-train needs {_writer.__module__}.{_writer.__qualname__}().fs ({RUN_WITH}; "
            f"this is torch {torch.__version__})"
        )
del _writer
_needed("torch.distributed.checkpoint.filesystem:FileSystemBase.create_stream")
_needed("torch.distributed.checkpoint.filesystem:FileSystemBase.rename")


class _HashedStream:
    """A stream that hashes and counts what is written through it, the rest its own."""

    def __init__(self, raw: Any) -> None:
        self._raw, self._digest, self.size = raw, hashlib.sha256(), 0

    def write(self, data: Any) -> Any:
        written = self._raw.write(data)
        view = memoryview(data).cast("B")  # a buffered file takes every byte it is given
        self._digest.update(view)
        self.size += view.nbytes
        return written

    def hexdigest(self) -> str:
        return self._digest.hexdigest()

    def __getattr__(self, name: str) -> Any:  # tell, flush, fileno, close, ...
        return getattr(self._raw, name)


class _HashingFileSystem:
    """A DCP writer's filesystem whose every written file is hashed on its way out: name ->
    (SHA-256, bytes) in ``written``, under the name it has once renamed into place."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.written: dict[str, tuple[str, int]] = {}

    @contextlib.contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
        with self._inner.create_stream(path, mode) as raw:
            if "r" in mode:
                yield raw
                return
            stream = _HashedStream(raw)
            yield stream
        self.written[_file_name(path)] = (stream.hexdigest(), stream.size)

    def rename(self, path: Any, new_path: Any) -> None:
        self._inner.rename(path, new_path)  # DCP's .metadata.tmp -> .metadata
        self.written[_file_name(new_path)] = self.written.pop(_file_name(path))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _file_name(path: Any) -> str:
    return os.fspath(path).rstrip("/").rsplit("/", 1)[-1]


def hash_as_written(writer: Any) -> dict[str, tuple[str, int]]:
    """Make DCP's file or fsspec ``writer`` hash every file it writes as it writes it; returns
    the dict that then holds name -> (SHA-256, bytes) of each (this process's files only)."""
    hashing = _HashingFileSystem(writer.fs)
    writer.fs = hashing
    return hashing.written


# -- the names DCP's metadata pickle refers to ---------------------------------------------

MEM_FORMAT_ENCODING: type = _needed("torch.distributed.checkpoint.metadata:_MEM_FORMAT_ENCODING")
STORAGE_INFO: type = _needed("torch.distributed.checkpoint.filesystem:_StorageInfo")
# DCP's classes that are private, as the pickle names them (module, name): the unpickler may
# create them and set their state.
DCP_PRIVATE_CLASSES: dict[tuple[str, str], type] = {
    ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"): MEM_FORMAT_ENCODING,
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): STORAGE_INFO,
}
# torch's layout lookup, which a pickled TensorProperties calls to name its layout.
GET_LAYOUT_NAME = ("torch.serialization", "_get_layout")
GET_LAYOUT: Callable[..., Any] = _needed("torch.serialization:_get_layout")


# -- A DTensor's local piece ---------------------------------------------------------------

_needed("torch.distributed.tensor:DTensor.__create_chunk_list__")


def local_offsets(tensor: Any) -> tuple[int, ...]:
    """Where a DTensor's local piece begins in the whole tensor: DCP's chunk protocol (a
    dunder that DCP's planners call on any tensor it saves), one chunk per rank."""
    (chunk,) = tensor.__create_chunk_list__()
    return tuple(int(offset) for offset in chunk.offsets)
