"""Exceptions raised for invalid user input. Each message names the fields, their values and the fix.

A :class:`ConfigError` raised by a value (a layout, the strategy settings, a recompute policy, a
model config) names its fields in the value's own terms (``tensor_model_parallel_size=2``). A door
that names them otherwise (the CLI's config keys, ``parallel.tensor_model_parallel_size=2``) relabels
the error once, where it catches it (:meth:`ConfigError.relabel`), from one table of :class:`Label`.
"""
from __future__ import annotations

import ast
from typing import Any, Callable, Mapping


def literal(text: str) -> str:
    """``text`` as literal text in a ConfigError template (its braces doubled)."""
    return text.replace("{", "{{").replace("}", "}}")


class Label:
    """How a door names one field: its ``key`` (``{field.key}`` in a message), and the field with a
    value (``{field}``): ``term`` holds ``{key}`` and ``{value}`` (default ``{key}={value}``), or is a
    function of the value giving the whole term; ``convert`` turns the value into the door's own
    first (a ``timedelta`` into the seconds of ``parallel.timeout_s``)."""

    def __init__(self, key: str, term: str | Callable[[Any], str] = "{key}={value}",
                 convert: Callable[[Any], Any] | None = None) -> None:
        self.key, self.term, self.convert = key, term, convert

    def write(self, value: Any, show: Callable[[Any], str]) -> str:
        if self.convert is not None:
            value = self.convert(value)
        if callable(self.term):
            return self.term(value)
        return self.term.format(key=self.key, value=show(value))


class _Term:
    """One field of an error as a message template writes it: ``{field}`` the term (``key=value``),
    ``{field.key}`` the key alone, ``{field:LITERAL}`` the term with another value (the one a fix
    asks for, a Python literal such as ``True`` or ``'selective'``)."""

    def __init__(self, label: Label, value: Any, show: Callable[[Any], str]) -> None:
        self.label, self.value, self.show = label, value, show

    @property
    def key(self) -> str:
        return self.label.key

    def __format__(self, spec: str) -> str:
        return self.label.write(ast.literal_eval(spec) if spec else self.value, self.show)

    def __str__(self) -> str:
        return self.__format__("")


class ConfigError(ValueError):
    """An invalid or inconsistent configuration.

    ``ConfigError(message)``: a finished message. ``ConfigError(rule, fix, values={field: value})``:
    the structured form, whose ``rule`` (what is wrong) and ``fix`` (what to do) are templates
    naming the fields of ``values`` (``{field}``, ``{field.key}``, ``{field:LITERAL}``, see
    ``_Term``) in the raising value's own terms, until a door relabels them (:meth:`relabel`).
    """

    def __init__(self, rule: str, fix: str = "", *, values: Mapping[str, Any] | None = None,
                 labels: Mapping[str, Label] | None = None, show: Callable[[Any], str] = repr) -> None:
        self.rule, self.fix, self.values = rule, fix, dict(values or {})
        self.labels, self.show = dict(labels or {}), show
        super().__init__(self._message())

    def __reduce__(self):
        # another process (a spawned rank's error) receives the finished message: a door's labels may
        # hold functions, which do not pickle
        return ConfigError, (str(self),)

    @property
    def fields(self) -> tuple[str, ...]:
        """The fields this error names (its own terms)."""
        return tuple(self.values)

    def _message(self) -> str:
        if not self.values:  # a finished message: its braces are text
            return f"{self.rule} {self.fix}".strip()
        terms = {name: _Term(self.labels.get(name, Label(name)), value, self.show)
                 for name, value in self.values.items()}
        return f"{self.rule.format_map(terms)} {self.fix.format_map(terms)}".strip()

    def relabel(self, labels: Mapping[str, Label | str], show: Callable[[Any], str] | None = None) -> ConfigError:
        """This error with its fields named as a door names them: ``labels`` field -> a
        :class:`Label` or a key (a field without one keeps its name), ``show`` how the door writes
        a value. A later door's label replaces an earlier one's."""
        mine = {name: label if isinstance(label, Label) else Label(label)
                for name, label in labels.items() if name in self.values}
        return ConfigError(self.rule, self.fix, values=self.values, labels={**self.labels, **mine},
                           show=show or self.show)

    def within(self, where: str) -> ConfigError:
        """This error said of ``where`` (``'<where>: <message>'``), its fields still relabellable."""
        where = literal(where) if self.values else where
        return ConfigError(f"{where}: {self.rule}", self.fix, values=self.values, labels=self.labels, show=self.show)
