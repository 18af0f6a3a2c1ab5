"""Where a config or an option points: a plain path, or a URL of a protocol fsspec knows.

Checked before anything starts, so that a typo never becomes a local folder (``s3:/bucket/run``
is a relative path to the OS) and an unknown protocol (``foo://``) is not found out at run time
on a worker. ``file:///tmp/x`` means the path ``/tmp/x``.
"""

import re

import fsspec

# "s3:", "gs:" ... at the start: what a URL's protocol looks like (a drive letter is one letter).
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+):(?!//)")
_LOCAL = ("file", "local")


def checked_location(field: str, value: str) -> str:
    """``value`` as a path or a URL, or a ValueError naming ``field`` in one line. A
    ``file://`` or ``local://`` URL comes back as its path."""
    known = set(fsspec.available_protocols())
    for part in value.split("::"):  # chained: simplecache::s3://bucket/x
        protocol, separator, _ = part.partition("://")
        if separator and protocol not in known:
            raise ValueError(
                f"{field}: {value}: unknown protocol {protocol!r}; give a path or a URL of a "
                "protocol fsspec knows (s3://, gs://, abfs://, file:// ...)"
            )
        typo = _SCHEME.match(part)
        if not separator and typo and (typo.group(1) in known or part[typo.end() :][:1] == "/"):
            raise ValueError(
                f"{field}: {value}: not a URL ({typo.group(1)}:// takes two slashes) and not "
                f"meant as a local path; write {typo.group(1)}://{part[typo.end() :].lstrip('/')}"
                " or a plain path"
            )
    protocol, separator, path = value.partition("://")
    if separator and protocol in _LOCAL:
        return path
    return value


def bucket_of(location: str) -> tuple[str, str] | None:
    """(protocol, bucket) of a URL, None for a path: what one set of storage options serves."""
    protocol, separator, path = location.partition("://")
    if not separator or protocol in _LOCAL:
        return None
    return protocol, path.split("/", 1)[0]
