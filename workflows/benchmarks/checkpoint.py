"""Checkpoints that do not stop training: synchronous against asynchronous saves, on local disk
and on a local S3 server, and DCP's fsspec writer and reader against s3torchconnector's.

    python -m workflows.benchmarks.checkpoint [--width 4096] [--layers 6] [--steps 45]
        [--every 10] [--batch 16] [--rounds 2]

One run, on a local cluster of 2 workers (2 ranks, DDP on gloo): the linear stack of
``make bench-fsdp`` (6 x 4096: 101 M parameters, 0.8 GB of checkpoint with SGD's momentum),
trained ``--steps`` steps on random batches under each variant in turn, the variants
interleaved ``--rounds`` times so that the machine's noise hits all alike:

- ``none``: no checkpoint;
- ``sync`` and ``async`` (``checkpoint.async_save``), into a local folder and into a bucket of
  moto's S3 server (``workflows/benchmarks/local_s3.py``: a process on loopback, through
  s3fs), every ``--every`` steps.

Each save goes through the built-in trainer's own path (``workers.train.Checkpoints``, what a
``[checkpoint]`` section builds: DCP, the manifest last, retention). Measured on every rank:

- blocked: the seconds each save call held the step loop (a synchronous save: the whole write
  and commit; an asynchronous one: the copy into its buffers, plus any wait for the upload
  before), the job's first save apart from the later ones (an asynchronous first save also
  allocates the buffers the later ones reuse); "vs sync" compares the later ones;
- samples/s over the steps after the first ``WARM`` (the saves' blocking included), against
  ``none`` of the same round;
- save MB/s: the checkpoint's bytes over a synchronous save's blocked time; load MB/s: over the
  time ``load_checkpoint`` (what a resumed run calls) takes to read the newest one back.

Then, on the same server, DCP alone (no manifest, no hashes): ``dcp.save``/``dcp.load`` of the
same state through torch's ``FsspecWriter``/``FsspecReader`` (s3fs) and through
s3torchconnector's ``S3StorageWriter``/``S3StorageReader`` (its Rust client), if installed.
"""

import argparse
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

WARM = 5  # steps left out of samples/s: the first ones pay one-off costs
REGION = "us-east-1"


def _model(width: int, layers: int) -> Any:
    import torch

    from workflows.benchmarks.wide_mlp import wide_mlp

    torch.manual_seed(0)
    return wide_mlp(3 * 32 * 32, 10, width=width, layers=layers)


def _bytes_under(url: str, storage_options: dict[str, Any]) -> int:
    from fsspec.core import url_to_fs

    fs, path = url_to_fs(url, **storage_options)
    fs.invalidate_cache()
    return sum(fs.du(path, total=False).values()) if fs.exists(path) else 0


def train_and_save(ctx: Any, spec: dict[str, Any]) -> dict[str, Any]:
    """One rank: ``spec["steps"]`` DDP steps of the wide MLP, a checkpoint every
    ``spec["every"]`` steps through the built-in trainer's path (none if 0)."""
    import torch
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    from workers.checkpoint import CheckpointConfig, Progress
    from workers.train import Checkpoints, CheckpointState

    model = DistributedDataParallel(_model(spec["width"], spec["layers"]))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    state = CheckpointState([model], optimizer, scaler)
    checkpoints = None
    if spec["every"]:
        config = CheckpointConfig(
            directory=spec["directory"],
            storage_options=spec["storage_options"],
            keep=2,
            async_save=spec["async"],
        )
        checkpoints = Checkpoints.in_directory(config)
    generator = torch.Generator().manual_seed(ctx.rank)
    x = torch.randn(spec["batch"], 3, 32, 32, generator=generator)
    y = torch.randint(0, 10, (spec["batch"],), generator=generator)
    loss_fn = nn.CrossEntropyLoss()
    blocked: list[float] = []
    started = 0.0
    for step in range(1, spec["steps"] + 1):
        optimizer.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        optimizer.step()
        if step == WARM:
            started = time.perf_counter()
        if checkpoints is not None and step % spec["every"] == 0 and step < spec["steps"]:
            before = time.perf_counter()
            checkpoints.save(state, Progress(step=step))
            blocked.append(time.perf_counter() - before)
        ctx.heartbeat(samples=spec["batch"])
    seconds = time.perf_counter() - started
    result: dict[str, Any] = {
        # The job's: both ranks' samples.
        "samples_per_s": 2 * spec["batch"] * (spec["steps"] - WARM) / seconds,
        "blocked_s": blocked,
    }
    if checkpoints is None:
        return result
    return result | _finish_and_load(checkpoints, state, spec)


def _finish_and_load(checkpoints: Any, state: Any, spec: dict[str, Any]) -> dict[str, Any]:
    """The run's end: the wait for the upload in flight and its commit, the newest checkpoint's
    size, and the time every rank takes to load it."""
    import torch

    from workers.checkpoint import list_checkpoints, load_checkpoint

    before = time.perf_counter()
    if checkpoints.finish is not None:
        checkpoints.finish()
    result: dict[str, Any] = {"end_wait_s": time.perf_counter() - before}
    newest = list_checkpoints(spec["directory"], spec["storage_options"])[0]
    result["bytes"] = _bytes_under(str(newest), spec["storage_options"])
    torch.distributed.barrier()
    before = time.perf_counter()
    load_checkpoint(
        newest,
        modules=state.modules,
        optimizer=state.optimizer,
        scaler=state.scaler,
        storage_options=spec["storage_options"],
    )
    torch.distributed.barrier()
    result["load_s"] = time.perf_counter() - before
    return result


def _s3_client(endpoint: str) -> Any:
    """s3torchconnector's client for ``endpoint``: its DCP classes take a region, not an
    endpoint, so theirs is replaced by one that has it (moto wants path-style addressing)."""
    from s3torchconnector import S3ClientConfig
    from s3torchconnector._s3client import S3Client

    return S3Client(
        REGION, endpoint=endpoint, s3client_config=S3ClientConfig(force_path_style=True)
    )


def dcp_io(ctx: Any, spec: dict[str, Any]) -> dict[str, Any]:
    """One rank: DCP alone into the bucket and back, through each writer and reader in turn."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.nn.parallel import DistributedDataParallel

    from workers.compat.torch_private import FSSPEC_READER, FSSPEC_WRITER

    model = DistributedDataParallel(_model(spec["width"], spec["layers"]))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
    model(torch.randn(2, 3, 32, 32)).sum().backward()
    optimizer.step()  # the momentum exists
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": {"state": optim_state["state"]}}
    options = spec["storage_options"]
    timings: dict[str, dict[str, list[float]]] = {}
    for round_ in range(spec["rounds"]):
        for name in spec["writers"]:
            url = f"{spec['bucket']}/dcp-{name}-{round_}"
            if name == "fsspec":
                writer = FSSPEC_WRITER(url, sync_files=False, **options)
                reader = FSSPEC_READER(url, **options)
            else:
                from s3torchconnector.dcp import S3StorageReader, S3StorageWriter

                writer = S3StorageWriter(REGION, url)
                writer.fs._client = _s3_client(options["endpoint_url"])
                reader = S3StorageReader(REGION, url)
                reader.fs._client = _s3_client(options["endpoint_url"])
            torch.distributed.barrier()
            before = time.perf_counter()
            dcp.save(state, storage_writer=writer)
            saved = time.perf_counter() - before
            torch.distributed.barrier()
            before = time.perf_counter()
            dcp.load(state, storage_reader=reader)
            loaded = time.perf_counter() - before
            found = timings.setdefault(name, {"save_s": [], "load_s": [], "bytes": []})
            found["save_s"].append(saved)
            found["load_s"].append(loaded)
            if ctx.rank == 0:
                found["bytes"].append(_bytes_under(url, options))
                from fsspec.core import url_to_fs

                fs, path = url_to_fs(url, **options)
                fs.rm(path, recursive=True)  # moto keeps every byte in its memory
            torch.distributed.barrier()
    return timings


def _slowest(per_rank: list[list[float]]) -> list[float]:
    """Each measure's slowest rank: the others wait for it at the next collective."""
    return [max(values) for values in zip(*per_rank, strict=True)]


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--steps", type=int, default=45)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--batch", type=int, default=16, help="per rank")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    # A SIGTERM ends the run as Ctrl-C does: the server and the cluster are closed on the way.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    # The tests' S3 server: moto's, a process on loopback, killed at the end.
    from workflows import launch
    from workflows.benchmarks.local_s3 import KEY, SECRET, s3_server
    from workflows.cluster.training_cluster import start_cluster

    # s3torchconnector's client reads credentials from the environment only; the workers
    # started below inherit them.
    os.environ.setdefault("AWS_ACCESS_KEY_ID", KEY)
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", SECRET)
    try:
        import s3torchconnector.dcp  # noqa: F401

        writers = ["fsspec", "s3torchconnector"]
    except ImportError as error:
        print(f"s3torchconnector left out: {error}", flush=True)
        writers = ["fsspec"]

    variants = [
        ("none", None, False),
        ("sync, local disk", "local", False),
        ("async, local disk", "local", True),
        ("sync, S3 (moto)", "s3", False),
        ("async, S3 (moto)", "s3", True),
    ]
    results: dict[str, list[dict[str, Any]]] = {name: [] for name, _, _ in variants}
    base = {"width": args.width, "layers": args.layers, "batch": args.batch}
    with (
        tempfile.TemporaryDirectory() as tmp,
        s3_server(Path(tmp) / "moto.log") as server,
        start_cluster(n_workers=2, dashboard_port=0) as cluster,
    ):
        options = server.storage_options
        bucket = server.bucket("bench")
        for round_ in range(args.rounds):
            for name, where, asynchronous in variants:
                directory = (
                    f"{tmp}/ckpt-{round_}-{asynchronous}"
                    if where == "local"
                    else f"{bucket}/ckpt-{round_}-{asynchronous}"
                )
                spec = base | {
                    "steps": args.steps,
                    "every": args.every if where else 0,
                    "async": asynchronous,
                    "directory": directory,
                    "storage_options": options if where == "s3" else {},
                }
                run = launch(train_and_save, spec, cluster=cluster, world_size=2, name="ckpt")
                ranks = run.results
                row = {
                    "samples_per_s": ranks[0]["samples_per_s"],
                    "blocked_s": _slowest([r["blocked_s"] for r in ranks]),
                }
                if where:
                    row |= {
                        "end_wait_s": max(r["end_wait_s"] for r in ranks),
                        "bytes": ranks[0]["bytes"],
                        "load_s": max(r["load_s"] for r in ranks),
                    }
                    if where == "s3":
                        fs = server.filesystem()
                        fs.rm(directory.removeprefix("s3://"), recursive=True)
                results[name].append(row)
                print(
                    f"round {round_ + 1}, {name}: {row['samples_per_s']:.1f} samples/s, "
                    f"blocked {', '.join(f'{b:.2f}' for b in row['blocked_s']) or '-'} s"
                    + (f", end wait {row['end_wait_s']:.2f} s" if where else ""),
                    flush=True,
                )
        io_spec = base | {
            "bucket": bucket,
            "storage_options": options,
            "writers": writers,
            "rounds": args.rounds,
        }
        io = launch(dcp_io, io_spec, cluster=cluster, world_size=2, name="dcp-io").results

    print(
        f"\n{args.width}x{args.layers} linear stack, 2 ranks (DDP, gloo), batch {args.batch} "
        f"per rank, a checkpoint every {args.every} steps of {args.steps}, medians of "
        f"{args.rounds} rounds:\n"
    )
    none = [r["samples_per_s"] for r in results["none"]]
    sync_blocked = {}
    # The first save of a job apart: an asynchronous one allocates its buffers then (fresh pages
    # of the rank's share of the state), which the saves after it reuse.
    print(
        "| variant | blocked, first checkpoint | blocked, each later one | vs sync | "
        "samples/s vs none | save MB/s | load MB/s |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, where, asynchronous in variants:
        rows = results[name]
        ratio = _median([r["samples_per_s"] / n for r, n in zip(rows, none, strict=True)])
        if where is None:
            print(f"| {name} | - | - | - | 1.00 ({_median(none):.1f} samples/s) | - | - |")
            continue
        first = _median([r["blocked_s"][0] for r in rows])
        blocked = _median([b for r in rows for b in r["blocked_s"][1:]])
        mb = _median([r["bytes"] for r in rows]) / 1e6
        load = f"{mb / _median([r['load_s'] for r in rows]):.0f}"
        if asynchronous:
            versus = f"{blocked / sync_blocked[where]:.1%}"
            save = f"(end wait {_median([r['end_wait_s'] for r in rows]):.2f} s)"
        else:
            sync_blocked[where] = blocked
            versus, save = "-", f"{mb / blocked:.0f}"
        print(
            f"| {name} | {first:.2f} s | {blocked:.2f} s | {versus} | {ratio:.2f} | {save} "
            f"| {load} |",
            flush=True,
        )
    size = _median([r["bytes"] for r in results["sync, S3 (moto)"]])
    print(f"\ncheckpoint size: {size / 1e6:.0f} MB")
    print("\nDCP alone into moto's bucket and back (both ranks' parts, medians):\n")
    print("| writer / reader | save s | save MB/s | load s | load MB/s |")
    print("| --- | --- | --- | --- | --- |")
    for name in writers:
        save = _median(_slowest([r[name]["save_s"] for r in io]))
        load = _median(_slowest([r[name]["load_s"] for r in io]))
        mb = _median(io[0][name]["bytes"]) / 1e6
        print(f"| {name} | {save:.2f} | {mb / save:.0f} | {load:.2f} | {mb / load:.0f} |")


if __name__ == "__main__":
    main()
