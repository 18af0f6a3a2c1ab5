"""TLS for the cluster: the ``cluster.security`` section and the ``Security`` it builds.

Either certificate files (one CA, one certificate and key used by every role, as the stock
``dask scheduler/worker --tls-ca-file --tls-cert --tls-key`` options take them) or a temporary
self-signed set made in memory, which only a cluster started here can share.

TLS covers Dask's own traffic (client, scheduler, workers: tasks, results, events). It does not
cover torch.distributed: gloo and NCCL have no encryption, so keep the rendezvous port and the
ranks' traffic on a private network (``launch.socket_ifname``).
"""

from pathlib import Path
from typing import Self

from distributed.security import Security
from pydantic import BaseModel, ConfigDict, Field, model_validator


class SecurityConfig(BaseModel):
    """How Dask's connections are secured; all empty (the default) means plain TCP."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tls_ca_file: str | None = Field(
        default=None, description="CA certificate that signed every peer's certificate"
    )
    tls_cert: str | None = Field(
        default=None, description="this client's (and local workers') cert"
    )
    tls_key: str | None = Field(default=None, description="its private key; none: in tls_cert")
    temporary: bool = Field(
        default=False, description="a self-signed set made in memory (local clusters only)"
    )
    require_encryption: bool = Field(
        default=True, description="refuse plain tcp:// connections once TLS is on"
    )

    @model_validator(mode="after")
    def _files_or_temporary(self) -> Self:
        files = {
            "tls_ca_file": self.tls_ca_file,
            "tls_cert": self.tls_cert,
            "tls_key": self.tls_key,
        }
        given = [name for name, value in files.items() if value]
        if self.temporary and given:
            raise ValueError(
                f"cluster.security.temporary: a temporary certificate set replaces files; "
                f"drop temporary or {', '.join(given)}"
            )
        if given:
            for name in ("tls_ca_file", "tls_cert"):
                if not files[name]:
                    raise ValueError(
                        f"cluster.security.{name}: TLS with certificate files needs tls_ca_file "
                        "and tls_cert (and tls_key unless the key is inside tls_cert)"
                    )
        for name in given:
            path = Path(str(files[name])).expanduser()
            if not path.is_file():
                raise ValueError(f"cluster.security.{name}: {path}: no such file")
        return self

    @property
    def enabled(self) -> bool:
        return self.temporary or self.tls_ca_file is not None

    def build(self) -> Security | None:
        """The ``Security`` for client, scheduler and workers; ``None`` when TLS is off (Dask's
        own ``distributed.comm.tls`` configuration, if any, then applies)."""
        if self.temporary:
            return _temporary(self.require_encryption)
        if self.tls_ca_file is None:
            return None
        cert = str(Path(str(self.tls_cert)).expanduser())
        key = str(Path(self.tls_key).expanduser()) if self.tls_key else None
        return Security(
            require_encryption=self.require_encryption,
            tls_ca_file=str(Path(self.tls_ca_file).expanduser()),
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
