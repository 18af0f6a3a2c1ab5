"""An Optuna journal kept in object storage (``--storage s3://bucket/sweeps/study.log``).

Optuna's journal file appends lines to one file under a lock, which an object store can do
neither of. Here each append is one new object, named by the number of its first log
(``<url>.d/000000000042.jsonl``): objects are written whole or not at all, so a sweep killed
mid-append leaves the journal as it was, and the logs read back in the order they were
appended. One writer at a time: the sweep's client, which is the only process that writes its
study (trials report to it through their events). A second sweep of the same study appending
at the same moment would name its object alike: the object is created only where none is
(S3's conditional write), and the loser is told, never merged or overwritten.
"""

import json
from collections.abc import Iterable
from typing import Any

import fsspec
from optuna.storages.journal import BaseJournalBackend


class ObjectJournalBackend(BaseJournalBackend):
    """Optuna's journal as numbered objects under ``<url>.d/``."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        self.url = url
        self.fs, path = fsspec.core.url_to_fs(url, **(storage_options or {}))
        self.folder = f"{path}.d"
        self._logs: list[dict[str, Any]] = []  # read so far, in order
        self._read: set[str] = set()  # the objects they came from

    def _objects(self) -> list[str]:
        self.fs.invalidate_cache(self.folder)
        if not self.fs.exists(self.folder):
            return []
        return sorted(p for p in self.fs.ls(self.folder, detail=False) if p.endswith(".jsonl"))

    def _catch_up(self) -> None:
        for name in self._objects():
            if name in self._read:
                continue
            first = int(name.rsplit("/", 1)[-1].removesuffix(".jsonl"))
            if first != len(self._logs):
                raise ValueError(
                    f"storage: {self.url}: the journal's object {name} starts at log {first}, "
                    f"after {len(self._logs)}: written by two sweeps at once, or damaged"
                )
            lines = self.fs.cat_file(name).decode().splitlines()
            self._logs.extend(json.loads(line) for line in lines if line)
            self._read.add(name)

    def read_logs(self, log_number_from: int) -> Iterable[dict[str, Any]]:
        self._catch_up()
        return list(self._logs[log_number_from:])

    def append_logs(self, logs: list[dict[str, Any]]) -> None:
        self._catch_up()
        name = f"{self.folder}/{len(self._logs):012d}.jsonl"
        data = "".join(json.dumps(log) + "\n" for log in logs).encode()
        try:
            self.fs.pipe_file(name, data, mode="create")
        except FileExistsError:
            raise ValueError(
                f"storage: {self.url}: another sweep appended to this study at the same moment "
                f"(log {len(self._logs)}); run one sweep of a study at a time"
            ) from None
        self._logs.extend(logs)
        self._read.add(name)
