"""Device choice rules, without a GPU: which GPU a rank takes, which GPUs a worker owns, and
which NVML failures mean "no GPU here"."""

import re
from pathlib import Path

import pynvml
import pytest
import torch

from workers.devices import owned_device_indices, rank_device_index
from workers.precision import slow_precision
from workflows.cluster.training_cluster import NvmlError, no_gpus_or_raise


def test_a_worker_that_sees_one_gpu_uses_cuda0_whatever_its_local_rank():
    assert [rank_device_index(r, 1, None) for r in range(4)] == [0, 0, 0, 0]
    assert [rank_device_index(r, 1, "3") for r in range(4)] == [0, 0, 0, 0]


def test_stock_workers_sharing_a_multi_gpu_host_take_the_gpu_their_local_rank_names():
    # Four `dask worker --resources GPU=1` on a 4-GPU host, no CUDA_VISIBLE_DEVICES: four
    # different devices, as NCCL requires.
    assert [rank_device_index(r, 4, None) for r in range(4)] == [0, 1, 2, 3]
    assert [rank_device_index(r, 4, "") for r in range(4)] == [0, 1, 2, 3]
    # More ranks than GPUs on a host wrap around rather than name a missing device.
    assert rank_device_index(5, 4, None) == 1


def test_dask_cuda_workers_use_their_own_gpu_listed_first():
    # LocalCUDACluster on 4 GPUs: worker i sees them all, rotated so that GPU i comes first;
    # its rank (local rank i) must use cuda:0, which is physical GPU i.
    rotated = ["0,1,2,3", "1,2,3,0", "2,3,0,1", "3,0,1,2"]
    chosen = [
        visible.split(",")[rank_device_index(i, 4, visible)] for i, visible in enumerate(rotated)
    ]
    assert chosen == ["0", "1", "2", "3"]


def test_bad_inputs_are_refused_with_the_value_named():
    with pytest.raises(ValueError, match="no visible GPU"):
        rank_device_index(0, 0, None)
    with pytest.raises(ValueError, match="local rank -1"):
        rank_device_index(-1, 2, None)
    with pytest.raises(ValueError, match="cuda:2 is not among the 2"):
        owned_device_indices(2, 2, None)


def test_a_worker_owns_what_its_gpu_resource_declares_and_one_without():
    assert owned_device_indices(0, 8, None) == [0]  # dask-cuda: sees 8, owns its first
    assert owned_device_indices(0, 8, 4.0) == [0, 1, 2, 3]
    assert owned_device_indices(0, 2, 4.0) == [0, 1]  # never more than it sees
    assert owned_device_indices(2, 4, 2.0) == [2, 3]  # from its rank's device on
    assert owned_device_indices(0, 4, 0.5) == [0]  # a fraction of a GPU is still one device


def test_nvml_without_its_library_means_no_gpu():
    missing = pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)
    assert isinstance(missing, pynvml.NVMLError_LibraryNotFound)
    assert no_gpus_or_raise(missing) == 0


@pytest.mark.parametrize(
    "code",
    [
        pynvml.NVML_ERROR_DRIVER_NOT_LOADED,
        pynvml.NVML_ERROR_NO_PERMISSION,
        pynvml.NVML_ERROR_GPU_IS_LOST,
        pynvml.NVML_ERROR_UNKNOWN,
    ],
)
def test_any_other_nvml_failure_is_an_error_naming_it(code):
    error = pynvml.NVMLError(code)
    with pytest.raises(NvmlError, match=rf"cluster\.kind: NVML .*{type(error).__name__}") as info:
        no_gpus_or_raise(error)
    assert str(error) in str(info.value)
    assert info.value.__cause__ is error


def test_bf16_on_a_cpu_without_bfloat16_instructions_is_said_to_be_slow():
    # --set training.precision=bf16 on such a CPU cluster ran the demo 8x slower, unsaid.
    cpuinfo = Path("/proc/cpuinfo").read_text()
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    without = re.sub(r"\b(avx512_bf16|amx_bf16)\b", "", cpuinfo)
    said = slow_precision("bf16", cpu, without)
    assert said is not None and said.startswith("training.precision = 'bf16' on a CPU without")
    native = "flags\t\t: fpu sse2 avx2 avx512f avx512_bf16\n"
    arm = "Features\t: fp asimd sve bf16\n"
    assert slow_precision("bf16", cpu, native) is None and slow_precision("bf16", cpu, arm) is None
    assert slow_precision("fp32", cpu, without) is None
    assert slow_precision("bf16", gpu, without) is None
    assert slow_precision("bf16", cpu, "") is None  # nothing known: nothing said


# Who may reach glibc's malloc and the collector's freezes: the device policy, what it wraps,
# and the benchmarks that measure them. Everything else asks workers.device_policy.
HOST_MEMORY_MODULES = {"workers.malloc", "workers.between_jobs"}
MAY_REACH_THEM = {"workers/device_policy.py"}


def test_only_the_device_policy_reaches_glibcs_malloc_and_the_collectors_freezes():
    import ast

    from tests.conftest import REPO

    reached = []
    for package in ("workers", "workflows"):
        for file in sorted((REPO / package).rglob("*.py")):
            path = file.relative_to(REPO).as_posix()
            if path.startswith("workflows/benchmarks/") or path in MAY_REACH_THEM:
                continue
            for node in ast.walk(ast.parse(file.read_text())):
                where = f"{path}:{getattr(node, 'lineno', 0)}"
                if isinstance(node, ast.ImportFrom) and node.module == "workers.between_jobs":
                    names = [alias.name for alias in node.names]
                    reached += [f"{where} {name}" for name in names if name.startswith("freeze")]
                elif isinstance(node, ast.ImportFrom) and node.module in HOST_MEMORY_MODULES:
                    reached.append(f"{where} {node.module}")
                elif (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "freeze"
                    and getattr(node.func.value, "id", None) == "gc"
                    and path not in ("workers/between_jobs.py", "workers/frozen_heap.py")
                ):
                    reached.append(f"{where} gc.freeze")
    assert not reached, f"ask workers.device_policy instead: {reached}"


def test_a_gpus_ranks_leave_freed_memory_to_its_allocator_and_a_cpus_return_it():
    import contextlib

    from workers.device_policy import CPU, CUDA, policy_for
    from workers.malloc import freed_memory_returned
    from workers.spec.layout import Layout
    from workers.strategies.fsdp.sharding import FSDP

    assert policy_for(torch.device("cuda", 1)) is CUDA and policy_for("cpu") is CPU
    assert CUDA.job_memory(True).__class__ is contextlib.nullcontext
    assert CPU.job_memory(True).__class__ is freed_memory_returned().__class__
    assert CPU.job_memory(False).__class__ is contextlib.nullcontext
    layout = Layout(world_size=2, pp=1, dp=2, batch_size=8, dp_shard=2)
    for device, returned in (("cpu", True), ("cuda", False)):
        got = FSDP.returns_freed_memory(None, layout=layout, device=torch.device(device))
        assert got is returned, device
