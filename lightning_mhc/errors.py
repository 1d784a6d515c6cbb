"""Exceptions raised for invalid user input. Each message names the keys, their values and the fix."""
from __future__ import annotations


class ConfigError(ValueError):
    """An invalid or inconsistent configuration."""
