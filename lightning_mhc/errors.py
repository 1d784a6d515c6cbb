"""Exceptions raised for invalid user input. Each message names the keys, their values and the fix."""
from __future__ import annotations

from typing import Any, Callable, Mapping


class ConfigError(ValueError):
    """An invalid or inconsistent configuration."""


class KeyNames:
    """How a rule's error names each value, so that one check serves every door: by default the
    Python argument names (``tensor_model_parallel_size=2``); the CLI passes its config keys
    (``parallel.tensor_model_parallel_size=2``) and its way of writing values (``true``, ``null``).

    A label may hold ``{}`` (the value goes there instead of after ``=``) or be a function of the
    value giving the whole term.
    """

    def __init__(self, labels: Mapping[str, str | Callable[[Any], str]] | None = None,
                 show: Callable[[Any], str] = str, keys: Mapping[str, str] | None = None) -> None:
        self.labels = dict(labels or {})
        self.show = show
        self.keys = dict(keys or {})
        """How to name a key without its value, where its label cannot say (a function)."""

    def key(self, name: str) -> str:
        label = self.labels.get(name, name)
        if name in self.keys or callable(label):
            return self.keys.get(name, name)
        return label.replace(" {}", "")

    def term(self, name: str, value: Any) -> str:
        label = self.labels.get(name, name)
        if callable(label):
            return label(value)
        return label.format(self.show(value)) if "{}" in label else f"{label}={self.show(value)}"
