"""Exceptions raised for invalid user input. Each message names the fields, their values and the fix.

A :class:`ConfigError` is plain text and the fields it names, kept as data
(``ConfigError(term("tensor_model_parallel_size", 2), " does not divide ...")``): a value (a layout,
the strategy settings, a recompute policy, a model config) names them in its own terms
(``tensor_model_parallel_size=2``). A door that names them otherwise (the CLI's config keys,
``parallel.tensor_model_parallel_size=2``) relabels the error once, where it catches it
(:meth:`ConfigError.relabel`), from one table of :class:`Label`. No template language: the text is
never parsed, so braces in it are text, and an error sent back from another process keeps its fields.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping


class Label:
    """How a door names one field: its ``key`` (a field written as its key alone), and the field with a
    value: ``term`` holds ``{key}`` and ``{value}`` (default ``{key}={value}``), or is a function of
    the value giving the whole term; ``convert`` turns the value into the door's own first (a
    ``timedelta`` into the seconds of ``parallel.timeout_s``)."""

    def __init__(self, key: str, term: str | Callable[[Any], str] = "{key}={value}",
                 convert: Callable[[Any], Any] | None = None) -> None:
        self.key, self.term, self.convert = key, term, convert

    def write(self, value: Any, show: Callable[[Any], str]) -> str:
        if self.convert is not None:
            value = self.convert(value)
        if callable(self.term):
            return self.term(value)
        return self.term.format(key=self.key, value=show(value))


_NO_VALUE = object()


@dataclass(frozen=True)
class Field:
    """One field an error names, as data: its ``name`` in the raiser's terms and a ``value`` (the
    run's, or the one a fix asks for), written as the term (``name=value``); without a value, the
    key alone. ``written``: how a door in another process wrote it (an error that crossed processes
    keeps its text there, and a door here may still relabel it)."""

    name: str
    value: Any = _NO_VALUE
    written: str | None = None

    def write(self, label: Label | None, show: Callable[[Any], str]) -> str:
        if label is None and self.written is not None:
            return self.written
        label = label or Label(self.name)
        return label.key if self.value is _NO_VALUE else label.write(self.value, show)

    def __reduce__(self):
        value = () if self.value is _NO_VALUE else (self.value,)
        return _field, (self.name, self.written, *value)


def _field(name: str, written: str | None, *value: Any) -> Field:
    return Field(name, *value, written=written)


def term(name: str, value: Any) -> Field:
    """The field ``name`` with ``value``, written ``name=value`` (or as a door labels it)."""
    return Field(name, value)


def key(name: str) -> Field:
    """The field ``name`` written as its key alone (``name``, or the door's key for it)."""
    return Field(name)


class ConfigError(ValueError):
    """An invalid or inconsistent configuration: ``parts``, text and :class:`Field`, joined as they
    are (``ConfigError("a finished message")`` is one part).

    ``relabel`` names the fields as a door names them; ``within`` says where; ``fields`` lists the
    names it holds. Pickled (a spawned rank's error sent back), each field keeps its name and value
    and the text its labels gave it, since labels may hold functions."""

    def __init__(self, *parts: str | Field, labels: Mapping[str, Label] | None = None,
                 show: Callable[[Any], str] = repr) -> None:
        if not all(isinstance(part, (str, Field)) for part in parts):
            raise TypeError(f"ConfigError parts are text or Field, got {[type(p).__name__ for p in parts]}")
        self.parts, self.labels, self.show = parts, dict(labels or {}), show
        super().__init__(self._message())

    def __reduce__(self):
        written = tuple(replace(part, written=part.write(self.labels.get(part.name), self.show))
                        if isinstance(part, Field) else part for part in self.parts)
        return _config_error, written

    @property
    def fields(self) -> tuple[str, ...]:
        """The names of the fields this error names (its own terms), each once, in order."""
        return tuple(dict.fromkeys(part.name for part in self.parts if isinstance(part, Field)))

    def _message(self) -> str:
        return "".join(part.write(self.labels.get(part.name), self.show) if isinstance(part, Field) else part
                       for part in self.parts).strip()

    def relabel(self, labels: Mapping[str, Label | str], show: Callable[[Any], str] | None = None) -> ConfigError:
        """This error with its fields named as a door names them: ``labels`` field -> a
        :class:`Label` or a key (a field without one keeps its name), ``show`` how the door writes
        a value. A later door's label replaces an earlier one's."""
        mine = {name: label if isinstance(label, Label) else Label(label)
                for name, label in labels.items() if name in self.fields}
        return ConfigError(*self.parts, labels={**self.labels, **mine}, show=show or self.show)

    def within(self, where: str) -> ConfigError:
        """This error said of ``where`` (``'<where>: <message>'``), its fields still relabellable."""
        return ConfigError(f"{where}: ", *self.parts, labels=self.labels, show=self.show)


def _config_error(*parts: str | Field) -> ConfigError:
    return ConfigError(*parts)
