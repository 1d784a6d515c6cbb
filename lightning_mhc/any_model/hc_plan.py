"""Where hyper-connections go in a block: its branches by module names (:class:`Branch`), one
list for every block of the model (:class:`HyperConnectionPlan`), and a plan written as a plain
mapping read into them with every key checked. The plans of the built-in families are in
``families.py``; ``hyper_connections.py`` wires a model by one."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from lightning_mhc.errors import ConfigError


@dataclass(frozen=True)
class Branch:
    """One residual branch of a block, by module names relative to the block.

    Args:
        entry: the module that reads the residual stream (the branch's first norm).
        exit: the module whose output the block adds to the residual stream (the attention, the
            MLP, or what ends the branch: a post-norm, a dropout).
        parallel: the branch reads the block's input, not the previous branch's result (GPT-NeoX's
            parallel attention and MLP); its result still adds onto the previous branch's.
        dropout: the block's attribute holding the probability of a dropout the block applies to
            the exit's output before adding it (OPT's ``self.dropout``); None: the exit's output
            is what is added.
    """

    entry: str
    exit: str
    parallel: bool = False
    dropout: str | None = None

    def __post_init__(self) -> None:
        for field in ("entry", "exit"):
            value = getattr(self, field)
            if not isinstance(value, str) or not value:
                raise ConfigError(f"hyper-connection Branch {field}={value!r}: the name of a module of the block "
                                  "(relative to it), such as 'input_layernorm'.")
        if not isinstance(self.parallel, bool):
            raise ConfigError(f"hyper-connection Branch parallel={self.parallel!r}: True or False.")
        if self.dropout is not None and (not isinstance(self.dropout, str) or not self.dropout):
            raise ConfigError(f"hyper-connection Branch dropout={self.dropout!r}: the name of the block's attribute "
                              "holding the dropout probability, or None.")


@dataclass(frozen=True)
class HyperConnectionPlan:
    """Where the hyper-connections go: the branches of every block of the block list ``blocks``
    (found as ``parallelize`` finds it when None)."""

    branches: tuple[Branch, ...]
    blocks: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "branches", tuple(self.branches))
        if not self.branches or not all(isinstance(b, Branch) for b in self.branches):
            raise ConfigError("a HyperConnectionPlan needs at least one Branch(entry=..., exit=...) per block.")
        if self.branches[0].parallel:
            raise ConfigError(f"the first branch ({self.branches[0].entry}) cannot be parallel: nothing runs before it.")


def plan_from_mapping(plan: Mapping[str, Any]) -> HyperConnectionPlan:
    """A plan written as ``{"branches": [{"entry": ..., "exit": ...}, ...], "blocks": ...}``."""
    fields = dict(plan)
    _check_keys("plan", fields, PLAN_KEYS, required=("branches",))
    branches = fields.pop("branches")
    if isinstance(branches, (str, Mapping)) or not isinstance(branches, (list, tuple)):
        raise ConfigError(f"hyper-connection plan branches={branches!r}: a list of branches, each "
                          "{'entry': ..., 'exit': ...} or a Branch.")
    return HyperConnectionPlan(tuple(_branch(b, i) for i, b in enumerate(branches)), **fields)


PLAN_KEYS = ("branches", "blocks")
BRANCH_KEYS = ("entry", "exit", "parallel", "dropout")


def _check_keys(what: str, fields: Mapping[str, Any], known: tuple[str, ...], required: tuple[str, ...]) -> None:
    """A mapping written for a plan or a branch: every key known, every required one there (a
    misspelt key would otherwise be a TypeError from the constructor, or silently dropped)."""
    unknown = [k for k in fields if k not in known]
    if unknown:
        raise ConfigError(f"hyper-connection {what} has the key(s) {', '.join(map(repr, unknown))}, which it does not "
                          f"know: its keys are {', '.join(known)}.")
    missing = [k for k in required if k not in fields]
    if missing:
        raise ConfigError(f"hyper-connection {what} {dict(fields)!r} lacks {', '.join(missing)}: a {what} needs "
                          f"{', '.join(required)}.")


def _branch(branch: Branch | Mapping[str, Any], index: int) -> Branch:
    if isinstance(branch, Branch):
        return branch
    if not isinstance(branch, Mapping):
        raise ConfigError(f"hyper-connection plan branch {index + 1} is {branch!r}: write it as "
                          "{'entry': ..., 'exit': ...} or Branch(entry=..., exit=...).")
    _check_keys(f"plan branch {index + 1}", branch, BRANCH_KEYS, required=("entry", "exit"))
    return Branch(**branch)


HYPER_CONNECTIONS = "hyper_connections"
"""The attribute of a block holding its hyper-connections (``<block>.hyper_connections.<branch>``)."""


def drawn_from_seed(name: str) -> bool:
    """A state-dict name of a hyper-connection tensor: pretrained weights of the base model lack
    them, and the build draws them from the seed."""
    return f".{HYPER_CONNECTIONS}." in f".{name}"
