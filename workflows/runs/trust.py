"""Code named in a file runs only when the user says so.

A run directory's config.json is data that travels: a run copied from a colleague's bucket is
as untrusted as any download. A model it names by import path (``package.module:factory``) is
code that building the model imports and calls, so ``predict`` refuses it, before importing
anything, unless the user vouches for it: by naming the same model in their own config, by
opting in (``--trust-config``, ``trust_config=True``: the convention of Hugging Face's
``trust_remote_code``), or by holding the signing key that signed the config.json
(``checkpoint.signing_key_file``: the run wrote ``config.json.hmac``, the HMAC-SHA256 its
checkpoints' manifests carry, over the same canonical JSON).

The built-in models and the ``torchvision:`` and ``timm:`` names import only those libraries'
own constructors, and stay allowed.
"""

import hmac
from typing import Any

from workers.spec.errors import ConfigError
from workers.spec.names import model_source

# The signature of a run's config.json, written beside it by a run with a signing key.
CONFIG_SIGNATURE = "config.json.hmac"


def imported_model(raw: dict[str, Any]) -> str | None:
    """The import path a raw config's ``model.name`` gives, if it gives one."""
    model = raw.get("model")
    name = model.get("name") if isinstance(model, dict) else None
    if isinstance(name, str) and model_source(name)[0] == "import_path":
        return name
    return None


def config_signature(raw: dict[str, Any], signing_key_file: str) -> str:
    """The signature of a config (its JSON, as read back) with ``signing_key_file``."""
    from workers.checkpoint import document_signature

    return document_signature(raw, signing_key_file)


def check_config_trusted(
    raw: dict[str, Any],
    source: str,
    *,
    own_model: str | None = None,
    trust_config: bool = False,
    signing_key_file: str | None = None,
    signature: str | None = None,
) -> None:
    """Refuse the config read from ``source`` (a run's config.json) when it names code the user
    has not vouched for. ``own_model``: the model.name of the user's own config;
    ``signing_key_file``: the user's key, with which ``signature`` (the run's
    config.json.hmac, None if absent) must verify: a config changed since it was signed is
    refused whatever it names."""
    if signing_key_file is not None:
        expected = config_signature(raw, signing_key_file)
        if signature is None or not hmac.compare_digest(signature.strip(), expected):
            state = "carries no signature" if signature is None else "has a wrong signature"
            raise ConfigError(
                f"{source} {state} for the key in {signing_key_file}: changed or not made by "
                "a run with that key; refusing to use it"
            )
        return
    imported = imported_model(raw)
    if imported is None or trust_config or imported == own_model:
        return
    raise ConfigError(
        f"{source}: model.name = {imported!r} is code that building the model would import "
        "and run; refused, since the file may come from anyone. If you trust this run, pass "
        "--trust-config (trust_config=True in Python), or name the same model.name in your "
        "own config"
    )
