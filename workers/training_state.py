"""A user's training state as a checkpoint: what ``ctx.save`` writes and ``ctx.restore`` reads.

The state is a dict whose values may be modules (plain, DDP or FSDP-wrapped), optimizers, any
object with ``state_dict``/``load_state_dict`` (an LR scheduler, a GradScaler), tensors, and
numbers, strings, lists and dicts of them. It is stored in the same checkpoints as the built-in
trainer's (``workers.checkpoint``): tensors through ``torch.distributed.checkpoint``, every other
value as JSON in the manifest, so loading never unpickles anything. Each rank's RNG state (torch,
CUDA, ``random``, NumPy) is saved under its rank and restored, so a resumed run draws the same
numbers as an uninterrupted one.

Keys under which every rank stores a tensor mean one replicated value (rank 0's is written);
store per-rank tensors under per-rank keys. Non-tensor values are rank 0's.
"""

import random
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from workers.checkpoint import (
    CheckpointDestination,
    read_metadata,
    safe_reader,
    tensors_only_planner,
    verify_checkpoint_together,
    write_checkpoint,
)

RNG_KEY = "_rng"
_TENSOR = "__tensor__"  # where a tensor stood in a value stored as JSON


def save_state(destination: CheckpointDestination, state: Mapping[str, Any], *, step: int) -> None:
    """Write ``state`` as the checkpoint of ``step`` into ``destination`` (a local folder or an
    fsspec URL; collective: every rank calls it)."""
    tensors, values = capture_state(state)
    tensors[RNG_KEY] = {f"rank{dist.get_rank()}": _rng_state()}
    write_checkpoint(destination, tensors, step=step, fields={"values": values})


def load_state(
    path: str | Path,
    state: dict[str, Any],
    *,
    signing_key_file: str | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> int:
    """Load the verified checkpoint at ``path`` into ``state`` (collective) and return its step.

    Modules, optimizers and stateful objects are loaded in place; tensors are copied into the
    ones in ``state``; other values are replaced in the dict.
    """
    # Verified again here, on the rank that loads it: the folder may have changed since the
    # client chose it.
    manifest = verify_checkpoint_together(path, signing_key_file, storage_options)
    saved = set(read_metadata(path, storage_options).state_dict_metadata)
    template, _ = capture_state(state)
    rank = f"rank{dist.get_rank()}"
    # Another world size has other ranks: a rank with no saved RNG keeps its own.
    rng = {k: v for k, v in _rng_state().items() if f"{RNG_KEY}.{rank}.{k}" in saved}
    if rng:
        template[RNG_KEY] = {rank: rng}
    missing = sorted(key for key in state if key not in manifest["values"])
    if missing:
        raise KeyError(
            f"{path}: the checkpoint has no {missing}; it holds {sorted(manifest['values'])}"
        )
    import torch.distributed.checkpoint as dcp

    dcp.load(
        template,
        storage_reader=safe_reader(path, storage_options),
        planner=tensors_only_planner(),
    )
    apply_state(state, template, manifest["values"])
    if rng:
        _set_rng_state(rng)
    return int(manifest["step"])


def apply_state(
    state: dict[str, Any], tensors: Mapping[str, Any], values: Mapping[str, Any]
) -> None:
    """Load what :func:`capture_state` made of a state (``tensors`` loaded or received,
    ``values`` as kept) into ``state``: modules, optimizers and stateful objects in place,
    tensors copied into the ones in ``state``, other values replaced in the dict."""
    from torch.distributed.checkpoint.state_dict import (
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    model = _optimizer_model(state)
    for key, value in state.items():
        stored = values[key]
        if isinstance(value, nn.Module):
            set_model_state_dict(value, tensors[key])
        elif isinstance(value, torch.optim.Optimizer):
            assert model is not None
            set_optimizer_state_dict(
                model,
                value,
                {"state": tensors.get(key, {}), "param_groups": _join(stored["param_groups"], {})},
            )
        elif _stateful(value):
            value.load_state_dict(_join(stored, tensors.get(key, {})))
        else:
            state[key] = _join(stored, tensors.get(key, {}))


def capture_state(state: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split ``state`` into its tensors (what DCP stores) and JSON values (what the manifest
    keeps); the tensors are the state's own, not copies."""
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    model = _optimizer_model(state)
    tensors: dict[str, Any] = {}
    values: dict[str, Any] = {}
    for key, value in state.items():
        if not isinstance(key, str) or key == RNG_KEY:
            raise TypeError(f"ctx.save: state key {key!r}: keys are strings other than {RNG_KEY}")
        if isinstance(value, nn.Module):
            tensors[key], values[key] = get_model_state_dict(value), {_TENSOR: "module"}
        elif isinstance(value, torch.optim.Optimizer):
            if model is None:
                raise TypeError(
                    f"ctx.save: optimizer {key!r} is stored by parameter name, so its model must "
                    "be in the same state (e.g. {'model': model, 'optimizer': optimizer})"
                )
            whole = get_optimizer_state_dict(model, value)
            groups_tensors, groups = _split(whole["param_groups"], f"{key}.param_groups")
            if groups_tensors:
                raise TypeError(f"ctx.save: optimizer {key!r} has tensors in its param_groups")
            tensors[key], values[key] = whole["state"], {"param_groups": groups}
        else:
            found, values[key] = _split(value.state_dict() if _stateful(value) else value, key)
            if _holds_tensors(found):
                tensors[key] = found
    return tensors, values


def _optimizer_model(state: Mapping[str, Any]) -> nn.Module | None:
    # Optimizer state is keyed by parameter name: the names come from the state's modules.
    modules = {k: v for k, v in state.items() if isinstance(v, nn.Module)}
    if len(modules) <= 1:
        return next(iter(modules.values()), None)
    return nn.ModuleDict(modules)


def _stateful(value: Any) -> bool:
    return callable(getattr(value, "state_dict", None)) and callable(
        getattr(value, "load_state_dict", None)
    )


def _holds_tensors(found: Any) -> bool:
    """Whether what :func:`_split` found is a tensor or a non-empty dict of them (never a
    tensor's truth value: a zero is a tensor to keep, and a tensor of several values has
    none)."""
    return found is not None and (not isinstance(found, dict) or bool(found))


def _split(value: Any, where: str) -> tuple[Any, Any]:
    """(the tensors in ``value`` keyed by position, ``value`` as JSON with placeholders)."""
    if isinstance(value, torch.Tensor):
        return value, {_TENSOR: True}
    if isinstance(value, Mapping):
        tensors, values = {}, {}
        for k, v in value.items():
            if not isinstance(k, str | int) or isinstance(k, bool):
                raise TypeError(f"ctx.save: {where}: key {k!r} is not a string or an integer")
            found, values[str(k)] = _split(v, f"{where}.{k}")
            if _holds_tensors(found):
                tensors[str(k)] = found
        return tensors, {
            "__dict__": values,
            "__int_keys__": [str(k) for k in value if isinstance(k, int)],
        }
    if isinstance(value, list | tuple):
        tensors, values = {}, []
        for i, v in enumerate(value):
            found, stored = _split(v, f"{where}[{i}]")
            values.append(stored)
            if _holds_tensors(found):
                tensors[str(i)] = found
        return tensors, {"__list__": values, "__tuple__": isinstance(value, tuple)}
    if value is None or isinstance(value, bool | int | float | str):
        return None, value
    raise TypeError(
        f"ctx.save: {where} is a {type(value).__name__}; a state holds modules, optimizers, "
        "objects with state_dict(), tensors, and numbers, strings, lists and dicts of them"
    )


def _join(stored: Any, tensors: Any) -> Any:
    """Undo :func:`_split`: ``stored`` from the manifest, ``tensors`` as DCP loaded them."""
    if isinstance(stored, dict) and _TENSOR in stored:
        return tensors
    if isinstance(stored, dict) and "__dict__" in stored:
        int_keys = set(stored["__int_keys__"])
        return {
            (int(k) if k in int_keys else k): _join(v, tensors.get(k, {}))
            for k, v in stored["__dict__"].items()
        }
    if isinstance(stored, dict) and "__list__" in stored:
        items = [_join(v, tensors.get(str(i), {})) for i, v in enumerate(stored["__list__"])]
        return tuple(items) if stored["__tuple__"] else items
    return stored


def _rng_state() -> dict[str, torch.Tensor]:
    version, words, gauss = random.getstate()
    _, keys, position, has_gauss, cached = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "python": torch.tensor([version, *words], dtype=torch.int64),
        "python_gauss": torch.tensor([gauss is not None, gauss or 0.0], dtype=torch.float64),
        "numpy": torch.from_numpy(keys.astype(np.int64)),
        "numpy_rest": torch.tensor([position, has_gauss, cached], dtype=torch.float64),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["torch"])
    if "python" in state:
        python = state["python"].tolist()
        has_gauss, gauss = state["python_gauss"].tolist()
        random.setstate((python[0], tuple(python[1:]), gauss if has_gauss else None))
    if "numpy" in state:
        position, has_np_gauss, cached = state["numpy_rest"].tolist()
        keys = state["numpy"].numpy().astype(np.uint32)
        np.random.set_state(("MT19937", keys, int(position), int(has_np_gauss), cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
