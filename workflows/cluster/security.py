"""TLS for the cluster: the ``Security`` that the ``cluster.security`` section
(``workers/spec/security.py``) builds.

Either certificate files (one CA, one certificate and key used by every role, as the stock
``dask scheduler/worker --tls-ca-file --tls-cert --tls-key`` options take them) or a temporary
self-signed set made in memory, which only a cluster started here can share.

TLS covers Dask's own traffic (client, scheduler, workers: tasks, results, events). It does not
cover torch.distributed: gloo and NCCL have no encryption, so keep the rendezvous port and the
ranks' traffic on a private network (``launch.socket_ifname``).
"""

from pathlib import Path

from distributed.security import Security

from workers.spec.security import SecurityConfig


def build_security(config: SecurityConfig) -> Security | None:
    """The ``Security`` for client, scheduler and workers; ``None`` when TLS is off (Dask's
    own ``distributed.comm.tls`` configuration, if any, then applies)."""
    if config.temporary:
        return _temporary(config.require_encryption)
    if config.tls_ca_file is None:
        return None
    cert = str(Path(str(config.tls_cert)).expanduser())
    key = str(Path(config.tls_key).expanduser()) if config.tls_key else None
    return Security(
        require_encryption=config.require_encryption,
        tls_ca_file=str(Path(config.tls_ca_file).expanduser()),
        tls_client_cert=cert,
        tls_client_key=key,
        tls_scheduler_cert=cert,
        tls_scheduler_key=key,
        tls_worker_cert=cert,
        tls_worker_key=key,
    )


def _temporary(require_encryption: bool) -> Security:
    try:
        security = Security.temporary()
    except ImportError as error:
        raise RuntimeError(
            "cluster.security.temporary: needs the 'cryptography' package; install it, or give "
            "certificate files (tls_ca_file, tls_cert, tls_key)"
        ) from error
    security.require_encryption = require_encryption  # temporary() always sets it
    return security


def write_pem_files(security: Security, folder: Path) -> dict[str, Path]:
    """Write a temporary set's CA, certificate and key to ``folder`` (mode 0600), for stock
    ``dask scheduler/worker --tls-*`` processes that should share it: ca.pem, cert.pem, key.pem."""
    folder.mkdir(parents=True, exist_ok=True)
    contents = {
        "tls_ca_file": security.tls_ca_file,
        "tls_cert": security.tls_worker_cert,
        "tls_key": security.tls_worker_key,
    }
    paths = {}
    for field, name in (("tls_ca_file", "ca"), ("tls_cert", "cert"), ("tls_key", "key")):
        text = contents[field]
        if not text or "-----BEGIN" not in text:
            raise ValueError(f"{field}: not an in-memory PEM (a file path?): cannot write it")
        path = folder / f"{name}.pem"
        path.touch(mode=0o600)
        path.write_text(text)
        paths[field] = path
    return paths
