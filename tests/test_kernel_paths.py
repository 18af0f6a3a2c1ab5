"""The strategies on the CPU kernel paths of other CPUs: the same parameters as one process.

Each CPU rounds its own way. ATen picks its vectorized kernels by the CPU
(``ATEN_CPU_CAPABILITY``: plain C, AVX2, AVX-512), oneDNN its convolutions by the instruction
set it finds (``ONEDNN_MAX_CPU_ISA``), and a reduction blocked for 16 lanes sums in another order
than one blocked for 8. A tolerance measured on the developers' machine failed on three other
CPUs in a row; here the workers run each path this CPU can take, crossed.

What a path computes is held against the float64 reference within the rounding float32 makes
on that same path: the one-process float32 reference is computed on a worker of the path (a
process whose kernels were picked under the path's variables, with the ranks' own thread
settings), and the float64 one, which no path changes, once in this process. An allowance taken
from another path's rounding measures the paths, not the strategy: on an AMD EPYC whose native
float32 rounds unusually close to float64, every path with more rounding failed (DDP and FSDP
at the same distance), and a path with less rounding would hide a strategy's error.

One small cluster per kernel path (forked workers start in about half a second), a few
strategies each; the float32 references are computed once per path on its workers (the memo in
train_in_one_process), the float64 ones once for every path. The main pass runs every
equivalence test on the native path. The worst fraction of the allowance per path is printed
at the end of the suite (tests/conftest.py).
"""

import os
import platform

import dask
import pytest
import torch

from tests.reference import SGD_FEW_STEPS, assert_matches_one_process, train_in_one_process
from workflows.cluster.training_cluster import start_cluster
from workflows.runs.driver import train

STEPS = 5
# A one-process reference of 5 steps takes about a second on the plain-C path here; the bound
# is for a worker that never answers.
REFERENCE_TIMEOUT_S = 120
BASE = SGD_FEW_STEPS | {"batch_size": 32, "epochs": 1, "seed": 3, "max_steps": STEPS}


def _kernel_paths() -> list[tuple[str, str]]:
    """(ATen capability, oneDNN ISA cap) pairs for this CPU, ``native`` for the CPU's own,
    without the (native, native) pair that the main pass runs."""
    native = torch.backends.cpu.get_cpu_capability().lower()
    ladder = ["default", "avx2", "avx512"]
    aten = ladder[: ladder.index(native) + 1] if native in ladder else ["default", "native"]
    aten = ["native" if capability == native else capability for capability in aten]
    # oneDNN's ISA names are x86's; elsewhere it runs its own.
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    onednn = ["SSE41", "AVX2", "native"] if x86 else ["native"]
    return [(a, o) for a in aten for o in onednn if (a, o) != ("native", "native")]


KERNEL_PATHS = _kernel_paths()
# A run whose whole process is put on one path (the variables set for pytest) holds every
# equivalence test there already, and its workers' fork server keeps that path whatever a
# cluster asks for: nothing to cross.
FORCED = [name for name in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA") if name in os.environ]
pytestmark = pytest.mark.skipif(
    bool(FORCED), reason=f"{' and '.join(FORCED)} set: this run is on one kernel path"
)


def _kernels_seen() -> tuple[str, str | None]:
    return torch.backends.cpu.get_cpu_capability(), os.environ.get("ONEDNN_MAX_CPU_ISA")


@pytest.fixture(scope="module", params=KERNEL_PATHS, ids=lambda p: f"aten-{p[0]}-onednn-{p[1]}")
def path_cluster(request):
    """Two workers on one kernel path: the variables reach each worker process before torch
    picks its kernels (Dask's nanny sets them in the worker, the fork server never ran one)."""
    aten, onednn = request.param
    environ = {}
    if aten != "native":
        environ["ATEN_CPU_CAPABILITY"] = aten
    if onednn != "native":
        environ["ONEDNN_MAX_CPU_ISA"] = onednn
    with (
        dask.config.set({"distributed.nanny.environ": environ}),
        start_cluster(n_workers=2, dashboard_port=0) as cluster,
    ):
        seen = set(cluster.client.run(_kernels_seen).values())
        expected_aten = torch.backends.cpu.get_cpu_capability() if aten == "native" else aten
        expected = {(expected_aten.upper(), None if onednn == "native" else onednn)}
        assert seen == expected, f"workers asked for {request.param} run {seen}"
        yield cluster


CASES = {
    "ddp": ({}, {}),
    "fsdp": ({}, {"strategy": "fsdp"}),
    "pipeline-1f1b": (
        {"pipeline": {"schedule": "1f1b", "n_microbatches": 4}},
        {"strategy": "pipeline"},
    ),
}


@pytest.mark.equivalence
@pytest.mark.parametrize("case", list(CASES))
def test_a_strategy_on_another_cpus_kernels_matches_one_process(path_cluster, make_config, case):
    sections, training = CASES[case]
    config = make_config({"name": f"kernels-{case}", **sections}, **(BASE | training))
    result = train(config, cluster=path_cluster, on_event=None)
    replicas = config.layout(result.world_size).dp
    on_this_path = path_cluster.client.submit(
        train_in_one_process, config, world_size=replicas, steps=STEPS, pure=False
    ).result(timeout=REFERENCE_TIMEOUT_S)
    assert_matches_one_process(
        result.state_dict, config, world_size=replicas, steps=STEPS, float32=on_this_path
    )
