"""Configs that must be refused before anything starts, as the tests write them."""

import pytest

from workflows.runs.config import ConfigError, load_config


def refusal(raw: dict, *, base: dict) -> str:
    """The one-line message ``load_config`` refuses ``base`` with, section by section
    overridden by ``raw``."""
    merged = {key: base.get(key, {}) | raw.get(key, {}) for key in base.keys() | raw.keys()}
    with pytest.raises(ConfigError) as error:
        load_config(merged)
    message = str(error.value)
    assert "\n" not in message, message
    return message
