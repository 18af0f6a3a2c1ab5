"""The ``[cluster.security]`` section: TLS for Dask's connections, by certificate files or a
temporary self-signed set (``workflows/cluster/security.py`` builds Dask's ``Security`` from it).

TLS covers Dask's own traffic (client, scheduler, workers: tasks, results, events). It does not
cover torch.distributed: gloo and NCCL have no encryption, so keep the rendezvous port and the
ranks' traffic on a private network (``launch.socket_ifname``).
"""

from pathlib import Path
from typing import Self

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
