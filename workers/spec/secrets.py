"""Secrets redacted by value: what came from ``storage_options`` or a URL's password is masked
wherever this process writes or shows it (config.json, a sweep's request file, errors, log
lines, tracking, ``repr``).

A config's storage options are read as a whole: the settings fsspec's filesystems share that
say where and how to connect (``endpoint_url``, ``region_name``, ``anon`` ...) are plain, and
every other string in them is a secret, whatever its name (``key``, ``passphrase``,
``headers.Cookie``). A URL's password (``postgresql://user:PASSWORD@host/db``, an
``endpoint_url`` with user-info) is one too. Each secret is remembered when the config or the
option is read, and :func:`redact` masks every one it knows in any text; written configs leave
the secret options out (a config read back falls back on the environment's credentials).

Not covered: what a library prints on its own, outside our log handlers (botocore's debug
logging to its own handlers, a traceback Python prints for a bug), and secrets shorter than
``MIN_SECRET`` characters, which are left out of written configs but not searched for in text.
"""

import logging
import re
import threading
from typing import Any
from urllib.parse import urlsplit

MASK = "***"
MIN_SECRET = 8  # shorter values (gcsfs's token = "anon") would mask common words in every line

# Option names whose values are settings, not secrets: fsspec's own, and those s3fs, gcsfs and
# adlfs share (a table under one of them is read by the same rule).
PLAIN_OPTIONS = frozenset(
    {
        "endpoint_url",
        "region_name",
        "anon",
        "use_ssl",
        "verify",
        "requester_pays",
        "version_aware",
        "default_block_size",
        "default_cache_type",
        "default_fill_cache",
        "cache_regions",
        "skip_instance_cache",
        "use_listings_cache",
        "listings_expiry_time",
        "max_paths",
        "auto_mkdir",
        "asynchronous",
        "project",
        "account_name",
        "client_kwargs",
        "config_kwargs",
        "s3",
        "addressing_style",
        "signature_version",
        "connect_timeout",
        "read_timeout",
        "timeout",
        "retries",
        "max_attempts",
        "max_pool_connections",
        "fixed_upload_size",
        "location",
        "consistency",
    }
)

# scheme://user:PASSWORD@host: the password, in any text (a URL none registered included).
_URL_PASSWORD = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://[^\s:/@]*:)([^\s@/]+)(@)")

_known: set[str] = set()
_lock = threading.Lock()


def remember(value: str) -> None:
    """Mask ``value`` wherever :func:`redact` sees it from now on."""
    if len(value) >= MIN_SECRET:
        with _lock:
            _known.add(value)


def url_password(text: str) -> str | None:
    """The password of the URL ``text``, if it has one."""
    if "://" not in text or "@" not in text:
        return None
    try:
        return urlsplit(text).password
    except ValueError:
        return None


def remember_url(text: str) -> None:
    password = url_password(text)
    if password:
        remember(password)


def remember_options(options: Any, *, plain: bool = True) -> None:
    """Every secret in ``options`` (fsspec options, at any depth); ``plain``: whether the
    table's name says it holds settings."""
    if isinstance(options, dict):
        for key, value in options.items():
            remember_options(value, plain=plain and str(key) in PLAIN_OPTIONS)
    elif isinstance(options, list | tuple):
        for value in options:
            remember_options(value, plain=plain)
    elif isinstance(options, str):
        if plain:
            remember_url(options)
        else:
            remember(options)
    elif options is not None and not isinstance(options, bool | int | float) and not plain:
        remember(str(options))


def without_secrets(options: Any, *, plain: bool = True) -> Any:
    """``options`` as written out: the secret entries left out, URL passwords masked."""
    if isinstance(options, dict):
        kept = {}
        for key, value in options.items():
            written = without_secrets(value, plain=plain and str(key) in PLAIN_OPTIONS)
            if written is not _LEFT_OUT:
                kept[key] = written
        return kept
    if isinstance(options, list | tuple):
        written = (without_secrets(value, plain=plain) for value in options)
        return [value for value in written if value is not _LEFT_OUT]
    if not plain:
        return _LEFT_OUT
    return mask_url(options) if isinstance(options, str) else options


_LEFT_OUT = object()


def mask_url(text: str) -> str:
    """``text`` with every URL's password masked."""
    return _URL_PASSWORD.sub(lambda m: f"{m.group(1)}{MASK}{m.group(3)}", text)


def redact(text: str) -> str:
    """``text`` with every secret this process has seen, and every URL password, masked."""
    with _lock:
        known = sorted(_known, key=len, reverse=True)
    for secret in known:
        if secret in text:
            text = text.replace(secret, MASK)
    return mask_url(text)


def redact_value(value: Any) -> Any:
    """``value`` (JSON-like) with every string in it redacted."""
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, dict):
        return {k: redact_value(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [redact_value(v) for v in value]
    return value


class RedactingFilter(logging.Filter):
    """On a handler: each record's message, and its traceback, with the secrets masked."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        masked = redact(message)
        if masked != message:
            record.msg, record.args = masked, None
        if record.exc_info and not record.exc_text:
            record.exc_text = redact(logging.Formatter().formatException(record.exc_info))
        return True
