"""Recompute policies: a :class:`RecomputePolicy` value, made from a name (and its options) and
checked once, then passed down (callback -> module -> model config; CLI; ``parallelize``).

| policy      | what is recomputed in backward                                           |
|-------------|--------------------------------------------------------------------------|
| ``none``      | nothing                                                                  |
| ``selective`` | megatron's selective recompute: ``recompute_modules`` (default ``layernorm``, ``mlp``); each checkpoint has its own hook |
| ``mhc_block`` | block recompute: per sub-layer the hyper-connection (with the norm under ``layernorm``) and the bias-dropout-add with ``H_res`` and ``H_post``, one checkpoint each, block by block from one hook per block of ``L_r`` layers |
| ``full``      | every layer under ``torch.utils.checkpoint`` (the classic reference)       |

``RecomputePolicy.of(value)`` makes the policy where it enters (a policy, a name, a mapping, None);
``policy.full`` / ``.selective`` / ``.block`` say what it recomputes and ``policy.block_ranges(n, L)``
its recompute groups. ``RecomputePolicy(name).apply(config)`` selects the policy on a model config
(megatron's ``recompute_*`` fields); ``attach_recompute(model)`` hooks one ``MHCBlockRecomputeManager``
per recompute group onto our GPT's decoder layers (``groups.py``, which ``parallelize`` uses for
any model's blocks; only ``mhc_block`` needs it).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from lightning_mhc.errors import ConfigError, key, term
from lightning_mhc.recompute.groups import attach_block_recompute, block_ranges, detach_block_recompute
from lightning_mhc.recompute.manager import MHCBlockRecomputeManager

POLICIES = ("none", "selective", "mhc_block", "full")
"""The one list of recompute policies."""
SUPPORTED_MODULES = ("core_attn", "layernorm", "mlp")
"""What ``recompute_modules`` may name (megatron's names for the GPT's sub-modules)."""
DEFAULT_MODULES = {"selective": ("layernorm", "mlp"), "mhc_block": ("layernorm",)}
"""What each policy that names modules recomputes when none are given (the planner counts it too)."""


def _is_layer_count(value: Any) -> bool:
    return value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 1)


@dataclass(frozen=True)
class RecomputePolicy:
    """A recompute policy and its options, checked when made: a known name, ``modules`` only where
    the policy reads them and only modules the model has, no ``'mlp'`` under ``mhc_block`` (it
    would recompute the MLP inside the block recompute), a whole positive ``layer_num``.

    Args:
        name: one of ``POLICIES``.
        modules: ``selective`` / ``mhc_block``: what to recompute (``SUPPORTED_MODULES``; None:
            the policy's default, ``layernorm`` + ``mlp`` / ``layernorm``).
        layer_num: ``mhc_block``: layers per recompute block (None: the paper's
            ``max(1, int(sqrt(n L / (n + 2))))`` of the stage's ``L`` layers).

    Errors name the values by megatron's fields (``policy``, ``recompute_modules``,
    ``mhc_recompute_layer_num``, ``enable_hyper_connections``); a door relabels them
    (``ConfigError.relabel``).
    """

    name: str = "none"
    modules: tuple[str, ...] | None = None
    layer_num: int | None = None

    def __post_init__(self) -> None:
        if self.modules is not None and not isinstance(self.modules, tuple):
            object.__setattr__(self, "modules", tuple(self.modules))
        modules = self.modules
        if self.name not in POLICIES:
            raise ConfigError(term("policy", self.name), f" is not a recompute policy: choose one of "
                              f"{', '.join(POLICIES)}.")
        if not _is_layer_count(self.layer_num):
            raise ConfigError(
                term("mhc_recompute_layer_num", self.layer_num), ": a recompute block holds a whole, positive number "
                "of layers (Megatron-LM refuses other values too). Use a positive integer, or None for the paper's "
                "default.")
        if modules is None:
            return
        policy, given = term("policy", self.name), term("recompute_modules", list(modules))
        if self.name not in DEFAULT_MODULES:
            raise ConfigError(given, " is only used by the 'selective' and 'mhc_block' policies, not ", policy,
                              ". Drop ", key("recompute_modules"), " or change the policy.")
        unknown = sorted(set(modules) - set(SUPPORTED_MODULES))
        if unknown:
            raise ConfigError(given, f": {unknown} not supported by this model; choose from "
                              f"{', '.join(SUPPORTED_MODULES)}.")
        if self.block and "mlp" in modules:
            raise ConfigError(
                policy, " cannot be combined with 'mlp' in ", given, " (recompute_mlp): the two checkpoint "
                "mechanisms conflict (Megatron-LM refuses it too). Remove 'mlp' from ", key("recompute_modules"),
                ", or use the 'selective' policy.")

    @classmethod
    def of(cls, policy: str | Mapping[str, Any] | RecomputePolicy | None = None) -> RecomputePolicy:
        """The policy a user gave, made and checked once where it enters (the CLI, the callback, a
        module, ``parallelize``): a policy, a name, a mapping of the fields (``to_plain``'s form),
        or None (``none``)."""
        if isinstance(policy, RecomputePolicy):
            return policy
        if policy is None:
            return cls()
        if isinstance(policy, Mapping):
            return cls(**policy)
        return cls(policy)

    def to_plain(self) -> str | dict[str, Any]:
        """The name, or a dict of the fields with options (hyperparameters; :meth:`of` reads it back)."""
        if self.modules is None and self.layer_num is None:
            return self.name
        return dict(name=self.name, modules=None if self.modules is None else list(self.modules),
                    layer_num=self.layer_num)

    @property
    def full(self) -> bool:
        """Every layer (every block of a model split by ``parallelize``) is checkpointed whole."""
        return self.name == "full"

    @property
    def selective(self) -> bool:
        """Chosen modules are checkpointed (``modules``; ``parallelize``: its patterns)."""
        return self.name == "selective"

    @property
    def block(self) -> bool:
        """The hyper-connections are recomputed block by block (one manager per group of layers)."""
        return self.name == "mhc_block"

    def block_ranges(self, n: int, layers: int) -> list[tuple[int, int]]:
        """The ``[start, end)`` ranges of the recompute groups of a stage of ``layers`` layers with
        ``n`` residual streams (``layer_num`` each; None: the paper's ``max(1, int(sqrt(n L / (n + 2))))``)."""
        return block_ranges(layers, n, self.layer_num)

    def check_model(self, hyper_connections: bool, model_field: str = "enable_hyper_connections") -> None:
        """What the policy asks of the model: ``mhc_block`` recomputes hyper-connections, which
        the model must have (``hyper_connections``: whether it has them, the value of the model's
        ``model_field``, which the error names: a GPT's ``enable_hyper_connections``, a model split by
        ``parallelize`` its ``hyper_connections``)."""
        _check_hyper_connections(self.name, hyper_connections, model_field)

    # ---------------------------------------------------------------- megatron's fields
    def transformer_fields(self) -> dict[str, Any]:
        """The ``TransformerConfig`` fields that select this policy."""
        fields: dict[str, Any] = dict(
            recompute_granularity=None,
            recompute_method=None,
            recompute_num_layers=None,
            recompute_modules=["core_attn"],  # megatron's default, inert without 'selective'
            recompute_hyper_connections=False,
            mhc_recompute_layer_num=self.layer_num,
        )
        if self.name in DEFAULT_MODULES:
            modules = self.modules if self.modules is not None else DEFAULT_MODULES[self.name]
            fields.update(recompute_granularity="selective", recompute_modules=list(modules))
        if self.block:
            fields.update(recompute_hyper_connections=True)
        if self.full:
            fields.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
        return fields

    def apply(self, config):
        """A copy of ``config`` (an ``MHCTransformerConfig``) that selects this policy; the copy
        checks itself (``of_config``), the model's hyper-connections included."""
        return dataclasses.replace(config, **self.transformer_fields())

    @classmethod
    def of_config(cls, config) -> RecomputePolicy:
        """The policy a config's ``recompute_*`` fields select (megatron's encoding), checked, the
        model's hyper-connections included. Its errors name the policy ``policy`` (the config
        relabels it as the fields that selected it)."""
        granularity = config.recompute_granularity
        name = "mhc_block" if config.recompute_hyper_connections else {"full": "full", "selective": "selective"}.get(
            granularity, "none")
        _check_hyper_connections(name, config.enable_hyper_connections)
        if name == "mhc_block" and granularity != "selective":
            raise ConfigError(term("policy", name), " needs ", term("recompute_granularity", "selective"),
                              f" (got {granularity!r}). Set ", term("recompute_granularity", "selective"), ".")
        modules = tuple(config.recompute_modules or ()) if granularity == "selective" else None
        return cls(name, modules, config.mhc_recompute_layer_num)


def _check_hyper_connections(policy: str, hyper_connections: bool,
                             model_field: str = "enable_hyper_connections") -> None:
    if policy == "mhc_block" and not hyper_connections:
        raise ConfigError(
            term("policy", policy), " needs ", term(model_field, True), ": it recomputes hyper-connection "
            "activations, which this model does not have. Enable hyper-connections or choose the 'selective' or "
            "'full' policy.")


# ----------------------------------------------------------- attaching managers
def _decoder_blocks(model: torch.nn.Module):
    return [m for m in model.modules() if hasattr(m, "recompute_block_ranges")]


def attach_recompute(model: torch.nn.Module, keep_managers: bool = False) -> list[MHCBlockRecomputeManager]:
    """Group the decoder layers of every decoder block of our GPT ``model`` whose config asks for
    block recompute (``mhc_block``: ``recompute_hyper_connections``) into recompute groups
    (``groups.py``: one manager per group per training forward, made by a pre-hook on its first
    layer and handed the output of its last). Idempotent. With ``keep_managers`` the returned list
    collects every manager created (one per group per training forward: for inspection and tests,
    not for long runs)."""
    detach_recompute(model)
    created: list[MHCBlockRecomputeManager] = []
    for block in _decoder_blocks(model):
        if not block.config.recompute_hyper_connections:
            continue
        attach_block_recompute(
            block.layers, block.recompute_block_ranges(),
            lambda first, last: f"layers {first.layer_number}-{last.layer_number}",
            created if keep_managers else None)
        block.mhc_recompute_attached = True
    return created


def detach_recompute(model: torch.nn.Module) -> None:
    for block in _decoder_blocks(model):
        detach_block_recompute(block.layers)
        block.mhc_recompute_attached = False
