"""Beyond one machine: clusters started with the stock ``dask scheduler`` / ``dask worker``,
workers in two network namespaces standing in for two hosts, and TLS. Real processes only."""

import contextlib
import json
import logging
import math
import os
import re
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import dask
import pytest
import torch
import torch.distributed as dist
from distributed import Client
from distributed.comm.core import CommClosedError, FatalCommClosedError
from distributed.security import Security
from tornado.iostream import StreamClosedError

from tests.commands import CONFIGS, dask_train
from tests.reference import train_in_one_process
from workers.process_group import current_membership
from workflows.benchmarks.local_s3 import s3_server
from workflows.cluster.security import write_pem_files
from workflows.cluster.training_cluster import live_workers, start_cluster
from workflows.jobs.launcher import (
    LaunchConfig,
    LaunchError,
    ProcessGroup,
    WorkerSelection,
    select_workers,
)
from workflows.runs.config import ConfigError, load_config
from workflows.runs.driver import train

ROOT = Path(__file__).parents[1]
DASK = str(Path(sys.executable).with_name("dask"))  # the stock CLI of this environment


# -- processes this module starts --------------------------------------------------------------


def _environment() -> dict[str, str]:
    # Stock workers unpickle this module's functions and the project's code: they need the tree
    # on their path, and the recipe's worker settings (README, "Beyond one machine").
    return os.environ | {
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        "DASK_CONFIG": str(ROOT / "workflows" / "dask"),
    }


def _spawn(command: list[str], log: Path, cwd: Path = ROOT) -> subprocess.Popen:
    with log.open("w") as out:
        # A session of its own, so that the nanny and its worker can be stopped together.
        return subprocess.Popen(
            command,
            cwd=cwd,
            env=_environment(),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def _stop(processes: list[subprocess.Popen]) -> None:
    """Kill the sessions started here (each a nanny and its worker, or the scheduler). Nothing
    here tests how stock processes shut down, and a SIGTERMed stock cluster took ~8 s to."""
    for process in reversed(processes):  # workers first, the scheduler last
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)  # the session we started: nanny and worker
    for process in processes:
        process.wait(timeout=30)


def _wait_for_file(path: Path, processes: list[subprocess.Popen], timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(FileNotFoundError, ValueError, KeyError):
            return json.loads(path.read_text())["address"]
        assert all(p.poll() is None for p in processes), "a process exited while starting"
        time.sleep(0.1)
    raise TimeoutError(f"no scheduler file {path} after {timeout_s:g} s")


def _wait_for_workers(scheduler_file: Path, names: set[str], timeout_s: float) -> None:
    with Client(scheduler_file=str(scheduler_file), timeout=timeout_s) as client:
        deadline = time.monotonic() + timeout_s
        while {w.get("name") for w in live_workers(client).values()} != names:
            assert time.monotonic() < deadline, f"workers {names} did not all arrive"
            time.sleep(0.2)


@contextlib.contextmanager
def _stock_cluster(
    folder: Path,
    workers: dict[str, list[str]],
    prefix: tuple[str, ...] = (),
    scheduler_host: str = "127.0.0.1",
    worker_hosts: dict[str, tuple[str, ...]] | None = None,
    cwd: Path = ROOT,
) -> Iterator[tuple[str, Path]]:
    """``dask scheduler`` and one ``dask worker`` per name (extra CLI arguments as given), each
    a separate process started in ``cwd``; ``prefix`` runs a worker inside a namespace
    (``ip netns exec NAME``)."""
    scheduler_file = folder / "scheduler.json"
    worker_hosts = worker_hosts or {}
    processes: list[subprocess.Popen] = []
    try:
        processes.append(
            _spawn(
                [
                    *worker_hosts.get("scheduler", prefix),
                    *(DASK, "scheduler", "--host", scheduler_host, "--port", "0"),
                    *("--dashboard-address", "127.0.0.1:0", "--scheduler-file", scheduler_file),
                ],
                folder / "scheduler.log",
            )
        )
        address = _wait_for_file(scheduler_file, processes, timeout_s=60)
        for name, arguments in workers.items():
            processes.append(
                _spawn(
                    [
                        *worker_hosts.get(name, prefix),
                        *(DASK, "worker", "--scheduler-file", scheduler_file),
                        *("--name", name, "--nthreads", "1", *arguments),
                    ],
                    folder / f"{name}.log",
                    cwd,
                )
            )
        if not worker_hosts:
            _wait_for_workers(scheduler_file, set(workers), timeout_s=90)
        yield address, scheduler_file
    finally:
        _stop(processes)


# -- an existing cluster, started with the stock CLIs ------------------------------------------


@pytest.fixture(scope="module")
def stock(tmp_path_factory):
    """Two workers offering TRAIN=1 and a helper without it, all on this host."""
    folder = tmp_path_factory.mktemp("stock")
    workers = {
        "trainer-1": ["--host", "127.0.0.1", "--resources", "TRAIN=1"],
        "trainer-2": ["--host", "127.0.0.1", "--resources", "TRAIN=1"],
        "helper-1": ["--host", "127.0.0.1"],
    }
    with _stock_cluster(folder, workers) as (address, scheduler_file):
        yield address, scheduler_file


def _process_facts() -> dict[str, object]:
    import multiprocessing

    return {
        "daemon": multiprocessing.current_process().daemon,
        "malloc_trim": os.environ.get("MALLOC_TRIM_THRESHOLD_"),
    }


def _probe(generation: str) -> dict[str, object]:
    membership = current_membership(generation)
    value = torch.tensor([float(membership.rank + 1)])
    dist.all_reduce(value)
    return {
        "rank": membership.rank,
        "local_rank": membership.local_rank,
        "sum": value.item(),
        "gloo_ifname": os.environ.get("GLOO_SOCKET_IFNAME"),
    }


def _ifname_variable() -> str | None:
    return os.environ.get("GLOO_SOCKET_IFNAME")


def test_stock_workers_started_with_the_recipes_settings_can_fork_and_keep_memory(stock):
    _, scheduler_file = stock
    with start_cluster(scheduler_file=str(scheduler_file)) as cluster:
        facts = cluster.client.run(_process_facts)
    assert len(facts) == 3
    assert all(f["daemon"] is False for f in facts.values())
    assert all(f["malloc_trim"] == str(256 * 2**20) for f in facts.values())


def test_choose_workers_by_resource_or_name_pattern_one_host_consecutive_local_ranks(stock):
    _, scheduler_file = stock
    with start_cluster(scheduler_file=str(scheduler_file)) as cluster:
        client = cluster.client
        names = {a: w["name"] for a, w in live_workers(client).items()}
        by_resource = LaunchConfig(workers=WorkerSelection(resources={"TRAIN": 1}))
        with ProcessGroup(client, by_resource) as group:
            assert [names[a] for a in group.workers] == ["trainer-1", "trainer-2"]
            assert group.spec.master_addr == "127.0.0.1"
            results = group.run(_probe, group.spec.generation)
        assert [(r["rank"], r["local_rank"], r["sum"]) for r in results] == [(0, 0, 3), (1, 1, 3)]
        by_name = LaunchConfig(workers=WorkerSelection(name_pattern="helper-*"))
        with ProcessGroup(client, by_name) as group:
            assert [names[a] for a in group.workers] == ["helper-1"]


def test_socket_ifname_reaches_gloo_for_the_groups_life_then_is_restored(stock):
    _, scheduler_file = stock
    config = LaunchConfig(world_size=2, socket_ifname="lo", master_addr=None)
    with start_cluster(scheduler_file=str(scheduler_file)) as cluster:
        client = cluster.client
        with ProcessGroup(client, config) as group:
            results = group.run(_probe, group.spec.generation)
            workers = group.workers
        assert group.spec is None
        assert [r["gloo_ifname"] for r in results] == ["lo", "lo"]
        assert set(client.run(_ifname_variable, workers=workers).values()) == {None}


def test_a_missing_interface_or_too_few_matching_workers_fail_fast_naming_the_field(stock):
    _, scheduler_file = stock
    with start_cluster(scheduler_file=str(scheduler_file)) as cluster:
        # Both fail in the checks before a group is made: no rendezvous, nothing to time out.
        missing = ProcessGroup(cluster.client, LaunchConfig(world_size=1, socket_ifname="nosuch0"))
        with pytest.raises(LaunchError, match=r"launch\.socket_ifname: worker .* no interface"):
            missing.start()
        assert missing.spec is None
        too_many = ProcessGroup(
            cluster.client,
            LaunchConfig(
                world_size=3, worker_wait_s=1, workers=WorkerSelection(resources={"TRAIN": 1})
            ),
        )
        with pytest.raises(
            LaunchError,
            match=r"launch\.workers: 3 workers with resources .* 2 of .* after waiting 1 s",
        ):
            too_many.start()
        assert too_many.spec is None


def _cli(
    *args: str, prefix: tuple[str, ...] = (), env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    command = [*prefix, *dask_train(*args)]
    return subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
        env=_environment() | (env or {}),
    )


@pytest.mark.slow
def test_ddp_run_through_scheduler_on_stock_workers_selected_by_resource(
    stock, store_dir, tmp_path
):
    address, _ = stock
    done = _cli(
        *("run", str(CONFIGS / "digits_ddp.toml"), "--scheduler", address),
        *("--set", f"data.store='{store_dir / 'digits'}'", "--set", "training.epochs=1"),
        *("--set", "launch.workers.resources={TRAIN=1}", "--output", str(tmp_path / "run")),
    )
    assert done.returncode == 0, done.stderr
    assert "done: ddp on 2 ranks" in done.stdout
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["world_size"] == 2


def test_cli_refuses_address_and_scheduler_file_together_and_names_a_missing_file(tmp_path):
    both = _cli(
        *("validate", str(CONFIGS / "digits_ddp.toml")),
        *("--set", "cluster.scheduler='tcp://127.0.0.1:8786'"),
        *("--set", f"cluster.scheduler_file='{tmp_path / 's.json'}'"),
    )
    assert both.returncode == 2
    assert "cluster.scheduler_file: give the scheduler's address or its file" in both.stderr
    missing = _cli(
        *("run", str(CONFIGS / "digits_ddp.toml"), "--scheduler-file", str(tmp_path / "s.json")),
        *("--set", "cluster.connect_timeout_s=1", "--output", str(tmp_path / "run")),
    )
    assert missing.returncode == 2, missing.stderr
    assert f"cluster.scheduler_file: {tmp_path / 's.json'}: no such file" in missing.stderr
    assert "Traceback" not in missing.stderr


# -- configuration -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (
            {"cluster": {"scheduler": "tls://h:8786", "security": {"temporary": True}}},
            "cluster.security.temporary: a temporary certificate set exists only in this process",
        ),
        (
            {"cluster": {"security": {"tls_ca_file": "/nonexistent/ca.pem"}}},
            "cluster.security.tls_cert: TLS with certificate files needs",
        ),
        (
            {"cluster": {"security": {"tls_ca_file": __file__, "tls_cert": "/nonexistent.pem"}}},
            "cluster.security.tls_cert: /nonexistent.pem: no such file",
        ),
        (
            {
                "cluster": {
                    "scheduler": "tcp://h:8786",
                    "security": {"tls_ca_file": __file__, "tls_cert": __file__},
                }
            },
            "cluster.scheduler: tcp://h:8786 is plain tcp://, but cluster.security requires TLS",
        ),
        ({"launch": {"master_addr": "tcp://10.0.0.1:1234"}}, "launch.master_addr: 'tcp://"),
        ({"launch": {"socket_ifname": "eth 0"}}, "launch.socket_ifname: 'eth 0' is not"),
        (
            {"launch": {"workers": {"resources": {"GPU": 0}}}},
            "launch.workers.resources.GPU: 0 selects every worker",
        ),
        ({"launch": {"workers": {"name_patern": "x"}}}, "launch.workers.name_patern: unknown key"),
    ],
)
def test_config_errors_name_the_field(raw, message):
    with pytest.raises(ConfigError) as info:
        load_config(raw)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_master_addr_accepts_hosts_and_addresses():
    assert LaunchConfig(master_addr="10.0.0.5").master_addr == "10.0.0.5"
    assert LaunchConfig(master_addr="[fd00::2]").master_addr == "fd00::2"
    assert LaunchConfig(master_addr="node-7.cluster").master_addr == "node-7.cluster"


def test_selected_workers_are_ordered_by_host_then_natural_name():
    info = {
        "tcp://10.0.0.2:1": {"host": "10.0.0.2", "name": "gpu-10", "resources": {"GPU": 1}},
        "tcp://10.0.0.1:2": {"host": "10.0.0.1", "name": "gpu-2", "resources": {"GPU": 1}},
        "tcp://10.0.0.2:3": {"host": "10.0.0.2", "name": "gpu-9", "resources": {"GPU": 1}},
        "tcp://10.0.0.1:4": {"host": "10.0.0.1", "name": "cpu-1", "resources": {}},
    }
    gpus = select_workers(info, WorkerSelection(resources={"GPU": 1}))
    assert gpus == ["tcp://10.0.0.1:2", "tcp://10.0.0.2:3", "tcp://10.0.0.2:1"]
    assert select_workers(info, WorkerSelection(name_pattern="cpu-*")) == ["tcp://10.0.0.1:4"]
    assert len(select_workers(info, WorkerSelection())) == 4


# -- two hosts: one worker in each of two network namespaces -----------------------------------


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


@pytest.fixture
def two_hosts() -> Iterator[dict[str, str]]:
    """Namespaces A and B joined by a veth pair named ``dt0`` on both sides, with addresses in
    a private test range; nothing else is reachable from them (their ``lo`` aside)."""
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    tag = str(os.getpid())[-6:]
    subnet = f"10.213.{1 + os.getpid() % 250}"
    hosts = {"a": f"dt-{tag}-a", "b": f"dt-{tag}-b"}
    made: list[str] = []
    try:
        for namespace in hosts.values():
            try:
                _ip("netns", "add", namespace)
            except (subprocess.CalledProcessError, OSError) as error:
                pytest.skip(f"cannot make a network namespace here: {error}")
            made.append(namespace)
        _ip("link", "add", f"dta{tag}", "type", "veth", "peer", "name", f"dtb{tag}")
        for side, address in (("a", f"{subnet}.1"), ("b", f"{subnet}.2")):
            namespace = hosts[side]
            _ip("link", "set", f"dt{side}{tag}", "netns", namespace)
            _ip("-n", namespace, "link", "set", f"dt{side}{tag}", "name", "dt0")
            _ip("-n", namespace, "addr", "add", f"{address}/24", "dev", "dt0")
            _ip("-n", namespace, "link", "set", "dt0", "up")
            _ip("-n", namespace, "link", "set", "lo", "up")
        yield {"ns_a": hosts["a"], "ns_b": hosts["b"], "a": f"{subnet}.1", "b": f"{subnet}.2"}
    finally:
        # Deleting a namespace deletes its end of the veth pair, and with it the other end.
        for namespace in made:
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True, timeout=30)
        with contextlib.suppress(subprocess.CalledProcessError):
            _ip("link", "del", f"dta{tag}")  # only left when moving it failed


def _read_from(namespace: tuple[str, ...], options: dict[str, str], *paths: str) -> list[str]:
    read = _cli_python(
        f"import json, s3fs, sys; fs = s3fs.S3FileSystem(**{options!r}); "
        f"sys.stdout.write(json.dumps([fs.cat_file(p).decode() for p in {list(paths)!r}]))",
        prefix=namespace,
    )
    assert read.returncode == 0, read.stderr
    return json.loads(read.stdout)


RUN_FILES = ("run.log", "summary.json", "config.json")


@pytest.mark.slow
def test_ddp_across_two_namespace_hosts_rendezvous_at_rank0s_namespace_address(two_hosts, tmp_path):
    in_a = ("ip", "netns", "exec", two_hosts["ns_a"])
    in_b = ("ip", "netns", "exec", two_hosts["ns_b"])
    a, b = two_hosts["a"], two_hosts["b"]
    workers = {"host-a": ["--host", a], "host-b": ["--host", b]}
    placement = {"scheduler": in_a, "host-a": in_a, "host-b": in_b}
    # The scheduler listens on A's address only: B reaches it over the veth pair. The hosts
    # share no folder: the store, the checkpoints and the run directory are in a bucket that
    # both reach over the same pair (moto's S3 server on A's address).
    with (
        s3_server(tmp_path / "moto.log", host=a, prefix=in_a) as bucket_server,
        _stock_cluster(tmp_path, workers, scheduler_host=a, worker_hosts=placement) as (
            address,
            _,
        ),
    ):
        options = bucket_server.storage_options
        assert address.startswith(f"tcp://{a}:")
        made = _cli_python(
            f"import s3fs; s3fs.S3FileSystem(**{options!r}).mkdir('shared')", prefix=in_a
        )
        assert made.returncode == 0, made.stderr

        # Credentials in the config, for the workers (never written out); the client's own
        # (its run directory's copy) in its environment.
        table = "{" + ", ".join(f"{k} = '{v}'" for k, v in options.items()) + "}"
        run = _cli(
            *("-v", "run", str(CONFIGS / "digits_ddp.toml"), "--scheduler", address),
            *("--set", "data.store='s3://shared/stores/digits'", "--set", "training.epochs=1"),
            *("--set", f"data.storage_options={table}"),
            *("--set", f"checkpoint.storage_options={table}"),
            *("--set", "launch.socket_ifname='dt0'", "--set", "launch.world_size=2"),
            *("--output", "s3://shared/runs/digits"),
            prefix=in_a,
            env=bucket_server.environment,
        )
        assert run.returncode == 0, run.stderr
        assert "done: ddp on 2 ranks" in run.stdout
        log, summary, config = _read_from(
            in_a, options, *(f"shared/runs/digits/{name}" for name in RUN_FILES)
        )
        # Rank 0's namespace address, never 127.0.0.1; and the ranks, in two namespaces whose
        # only route is the veth pair, trained together: their gloo pair connected over it.
        assert f"master {a}:" in log
        summary = json.loads(summary)
        assert summary["world_size"] == 2 and summary["store"]["url"].startswith("s3://shared/")
        assert options["secret"] not in config
        # Nothing of the run landed in a folder: only the cluster's own logs are here.
        assert {p.name for p in tmp_path.iterdir()} <= {"moto.log", "scheduler.json"} | {
            p.name for p in tmp_path.glob("*.log")
        }


def _cli_python(code: str, prefix: tuple[str, ...]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*prefix, sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=ROOT,
        env=_environment(),
    )


# -- TLS ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def certificates(tmp_path_factory) -> dict[str, str]:
    """A self-signed CA, certificate and key written to files, as an operator would have."""
    folder = tmp_path_factory.mktemp("tls")
    return {k: str(v) for k, v in write_pem_files(Security.temporary(), folder).items()}


# Steps the TLS run takes: enough that DDP syncs over the TLS cluster's ranks more than once.
TLS_STEPS = 3


def _refused(address: str, security: Security | None) -> CommClosedError | None:
    """None when a client with ``security`` connects; the error when the connection is closed on
    it in the TLS handshake: a certificate one side rejects, or plain tcp:// meeting the TLS
    listener. Anything else, a timeout (OSError "Timed out trying to connect") or a bug, is
    raised: it is no refusal."""
    try:
        with Client(address, timeout=5, security=security):
            return None
    except CommClosedError as error:
        if _closed_by_the_handshake(error):
            return error
        raise


def _closed_by_the_handshake(error: BaseException) -> bool:
    """What the client's socket saw below distributed's CommClosedError: a TLS error or alert,
    a reset or broken pipe, or the stream ended by the other side (tornado's StreamClosedError,
    the socket's error if any as its real_error)."""
    cause: BaseException | None = error
    while cause is not None:
        if isinstance(cause, ssl.SSLError | ConnectionResetError | BrokenPipeError):
            return True
        if isinstance(cause, StreamClosedError) and cause.real_error is None:
            return True  # an end of stream, no error of this side's own
        cause = cause.__cause__ or getattr(cause, "real_error", None) or cause.__context__
    return False


def _the_client_rejected_the_scheduler(error: CommClosedError | None) -> bool:
    # The client checks the scheduler's certificate against its own CA, before anything else.
    return (
        isinstance(error, FatalCommClosedError)
        and "TLS certificate does not match" in str(error)
        and isinstance(error.__cause__, ssl.SSLCertVerificationError)
    )


def _client_port(error: CommClosedError) -> int:
    # The closed comm names its ends: "in <TCP (closed)  local=tcp://127.0.0.1:52428 ...".
    found = re.search(r"local=\w+://\S+:(\d+) ", str(error))
    assert found, f"no local address in {error!r}"
    return int(found[1])


def _scheduler_refused(caplog, port: int, reason: str, timeout_s: float = 30) -> None:
    """The scheduler's listener (in this process) logged that it refused the connection from
    ``port``, for ``reason`` (OpenSSL's). It logs from its event loop, so the record may trail
    the client's error a little."""
    wanted = f":{port}': [SSL: {reason}]"
    deadline = time.monotonic() + timeout_s
    while not any(
        "TLS handshake failed with remote" in r.getMessage() and wanted in r.getMessage()
        for r in caplog.records
    ):
        assert time.monotonic() < deadline, f"no {wanted} in the scheduler's log: {caplog.text}"
        time.sleep(0.05)


def _handshake_without_a_certificate(
    address: str, ca_file: str, *, cert: str | None = None, key: str | None = None
) -> tuple[int, Exception | None]:
    """A TLS client that trusts the cluster's CA but has no certificate of its own (or
    presents ``cert``): the scheduler must refuse it (TLS 1.3 reports that on the first read).
    Its local port, and the error that ended its connection (None: it got in); a timeout is
    raised, it is no refusal."""
    host, port = address.removeprefix("tls://").rsplit(":", 1)
    context = ssl.create_default_context(cafile=ca_file)
    context.check_hostname = False  # Dask's certificates name roles, not hosts
    if cert is not None:
        context.load_cert_chain(cert, key)
    with socket.create_connection((host, int(port)), timeout=5) as raw:
        local_port = raw.getsockname()[1]
        try:
            with context.wrap_socket(raw) as secured:
                secured.sendall(b"\0" * 8)
                if secured.recv(1) == b"":
                    return local_port, ConnectionResetError("closed by the scheduler")
                return local_port, None
        except TimeoutError:
            raise
        except (ssl.SSLError, ConnectionResetError, BrokenPipeError) as error:
            return local_port, error


@pytest.mark.slow
def test_training_over_tls_and_clients_without_the_certificate_are_refused(
    make_config, certificates, caplog
):
    caplog.set_level(logging.WARNING, logger="distributed.comm.tcp")
    config = make_config(
        {"cluster": {"n_workers": 2, "dashboard_port": 0, "security": certificates}},
        epochs=1,
        max_steps=TLS_STEPS,
    )
    with start_cluster(config.cluster) as cluster:
        address = cluster.cluster.scheduler_address
        assert address.startswith("tls://")
        assert cluster.dashboard_link.startswith("http://127.0.0.1:")
        assert all(w.startswith("tls://") for w in cluster.worker_addresses)
        result = train(config, cluster=cluster, on_event=None)
        # Both ranks trained, over the TLS cluster: every step taken, the parameters moved.
        # (That the steps are right is test_ddp's: here only TLS is new.)
        assert result.world_size == 2 and result.history[-1]["step"] == TLS_STEPS
        assert all(math.isfinite(r["loss"]) for r in result.history), result.history
        untrained = train_in_one_process(config, world_size=2, steps=0)
        for name, value in untrained.items():
            if value.is_floating_point():
                assert not torch.equal(result.state_dict[name], value), f"{name} did not move"

        port, refusal = _handshake_without_a_certificate(address, certificates["tls_ca_file"])
        assert refusal is not None
        _scheduler_refused(caplog, port, "PEER_DID_NOT_RETURN_A_CERTIFICATE")
        with dask.config.set({"distributed.comm.timeouts.connect": "3s"}):
            # A certificate the cluster's CA never signed: the client rejects the scheduler's.
            other_ca = _refused(address, Security.temporary())
            assert _the_client_rejected_the_scheduler(other_ca), repr(other_ca)
            # No TLS at all: the scheduler's listener finds no TLS handshake and drops it.
            plain = _refused(address.replace("tls://", "tcp://"), None)
            assert plain is not None
            _scheduler_refused(caplog, _client_port(plain), "WRONG_VERSION_NUMBER")


def test_the_scheduler_refuses_a_client_certificate_from_another_ca(certificates, tmp_path, caplog):
    # The client trusts the cluster's CA, so its own side of the handshake succeeds: a refusal
    # is the scheduler's verdict on the certificate, signed by a CA the cluster never trusted.
    foreign = {k: str(v) for k, v in write_pem_files(Security.temporary(), tmp_path).items()}
    caplog.set_level(logging.WARNING, logger="distributed.comm.tcp")
    cluster_config = {"n_workers": 1, "dashboard_port": 0, "security": certificates}
    with start_cluster(**cluster_config) as cluster:
        address = cluster.cluster.scheduler_address
        scheduler = cluster.cluster.scheduler
        clients_before = set(scheduler.clients)

        port, refusal = _handshake_without_a_certificate(
            address, certificates["tls_ca_file"], cert=foreign["tls_cert"], key=foreign["tls_key"]
        )
        assert refusal is not None
        _scheduler_refused(caplog, port, "CERTIFICATE_VERIFY_FAILED")
        mixed = Security(
            tls_ca_file=certificates["tls_ca_file"],
            tls_client_cert=foreign["tls_cert"],
            tls_client_key=foreign["tls_key"],
            require_encryption=True,
        )
        with dask.config.set({"distributed.comm.timeouts.connect": "3s"}):
            refused = _refused(address, mixed)
        # The client saw an alert or the end of the stream, whichever came first (TLS 1.3);
        # the scheduler's listener (in this process) says why it dropped the connection.
        assert refused is not None
        _scheduler_refused(caplog, _client_port(refused), "CERTIFICATE_VERIFY_FAILED")
        # It never registered either client; its own certificate still gets in.
        assert set(scheduler.clients) == clients_before
        assert _refused(address, cluster.client.security) is None


def test_a_temporary_certificate_set_secures_a_local_cluster():
    with start_cluster(n_workers=1, dashboard_port=0, security={"temporary": True}) as cluster:
        assert cluster.cluster.scheduler_address.startswith("tls://")
        assert cluster.client.submit(sum, [1, 2], pure=False).result(timeout=30) == 3
        with dask.config.set({"distributed.comm.timeouts.connect": "3s"}):
            other_ca = _refused(cluster.cluster.scheduler_address, Security.temporary())
        assert _the_client_rejected_the_scheduler(other_ca), repr(other_ca)
        with pytest.raises(ConnectionError, match=r"cluster\.security: the scheduler at tls://"):
            start_cluster(scheduler=cluster.cluster.scheduler_address)
