"""A configuration error and how pydantic's errors are told: one line that names the field.

Every section's check ends here, so a bad key or value reads the same wherever it is found
(``dask-train validate``, ``load_config``, a sweep's trial, ``predict``'s settings).
"""

from pydantic import ValidationError

from workers.spec.secrets import redact


class ConfigError(ValueError):
    """Invalid configuration; the message names the field and what to change, every secret in
    it masked (a URL's password, a storage option's value: workers/spec/secrets.py)."""

    def __init__(self, message: object = "", *rest: object) -> None:
        super().__init__(redact(str(message)), *rest)


# Keys an earlier release took, and what they are called now: told as such, not as unknown.
RENAMED_KEYS = {"training.grad_clip_norm": "training.max_grad_norm"}


def one_line(error: ValidationError) -> str:
    """A pydantic error as one line: each field named, with what to change."""
    messages = []
    for detail in error.errors():
        field = ".".join(str(part) for part in detail["loc"])
        message = detail["msg"].removeprefix("Value error, ")
        if detail["type"] == "extra_forbidden" and field in RENAMED_KEYS:
            message = f"now called {RENAMED_KEYS[field]} (the same setting); rename it"
        elif detail["type"] == "extra_forbidden":
            message = "unknown key (check the spelling)"
        elif detail["type"] == "literal_error":
            message = message.replace("Input should be", "must be")
        # A message naming its field already (``launch.world_size: ...`` for ``world_size``).
        named = message.split(":", 1)[0].endswith(field) if field else True
        if field and not named and not message.startswith(field.split(".")[0] + "."):
            messages.append(f"{field}: {message}")
        else:
            messages.append(message)
    return "; ".join(messages)
