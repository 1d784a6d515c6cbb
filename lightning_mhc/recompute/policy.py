"""Recompute policies, chosen by name.

| policy      | what is recomputed in backward                                           |
|-------------|--------------------------------------------------------------------------|
| ``none``      | nothing                                                                  |
| ``selective`` | megatron's selective recompute: ``recompute_modules`` (default ``layernorm``, ``mlp``); each checkpoint has its own hook |
| ``mhc_block`` | block recompute: per sub-layer the hyper-connection (with the norm under ``layernorm``) and the bias-dropout-add with ``H_res`` and ``H_post``, one checkpoint each, block by block from one hook per block of ``L_r`` layers |
| ``full``      | every layer under ``torch.utils.checkpoint`` (the classic reference)       |

``configure_recompute(config, policy)`` returns a validated config;
``attach_recompute(model)`` hooks one ``MHCBlockRecomputeManager`` per
recompute block onto the decoder layers (only ``mhc_block`` needs it).
"""
from __future__ import annotations

import dataclasses

import torch

from lightning_mhc.errors import ConfigError, KeyNames
from lightning_mhc.recompute.manager import MHCBlockRecomputeManager

POLICIES = ("none", "selective", "mhc_block", "full")
"""The one list of recompute policies; :func:`check_policy` is the one check against it."""
SUPPORTED_MODULES = ("core_attn", "layernorm", "mlp")
_DEFAULT_MODULES = {"selective": ["layernorm", "mlp"], "mhc_block": ["layernorm"]}
POLICY_NAMES = KeyNames({"policy": "recompute policy {}", "recompute_modules": "recompute_modules",
                         "enable_hyper_connections": "enable_hyper_connections"}, show=repr)
"""How policy errors name values by default (the Python arguments)."""
WITHOUT_HYPER_CONNECTIONS = KeyNames({"policy": "recompute={}", "enable_hyper_connections": lambda _: (
    "a model with hyper-connections (MHCGPTModule; a model split by parallelize() has none)")}, show=repr)
"""How policy errors name values for a model without hyper-connections (``parallelize``)."""


def check_policy(
    policy: str,
    recompute_modules: list[str] | None = None,
    *,
    hyper_connections: bool | None = None,
    names: KeyNames = POLICY_NAMES,
) -> None:
    """Every rule of a recompute policy, in one place: a known name, ``recompute_modules`` only
    where the policy reads them and only modules the model has, no ``'mlp'`` under ``mhc_block``
    (it would recompute the MLP inside the block recompute), and ``mhc_block`` only for a model
    with hyper-connections (``hyper_connections=None``: not known here)."""
    term, key = names.term, names.key
    if policy not in POLICIES:
        raise ConfigError(f"unknown {term('policy', policy)}: choose one of {', '.join(POLICIES)}.")
    if policy == "mhc_block" and hyper_connections is False:
        raise ConfigError(
            f"{term('policy', policy)} needs {term('enable_hyper_connections', True)}: it recomputes "
            "hyper-connection activations, which this model does not have. Enable hyper-connections or choose "
            "the 'selective' or 'full' policy."
        )
    if recompute_modules is None:
        return
    if policy not in _DEFAULT_MODULES:
        raise ConfigError(
            f"{term('recompute_modules', recompute_modules)} is only used by the 'selective' and "
            f"'mhc_block' policies, not {policy!r}. Drop {key('recompute_modules')} or change the policy."
        )
    unknown = sorted(set(recompute_modules) - set(SUPPORTED_MODULES))
    if unknown:
        raise ConfigError(f"{term('recompute_modules', recompute_modules)}: {unknown} not supported by this model; "
                          f"choose from {', '.join(SUPPORTED_MODULES)}.")
    if policy == "mhc_block" and "mlp" in recompute_modules:
        raise ConfigError(
            f"{term('policy', policy)} with {term('recompute_modules', recompute_modules)}: 'mlp' (recompute_mlp) "
            f"conflicts with the block recompute. Remove 'mlp' from {key('recompute_modules')}, or use policy "
            "'selective'."
        )


def recompute_fields(
    policy: str,
    recompute_modules: list[str] | None = None,
    mhc_recompute_layer_num: int | None = None,
) -> dict:
    """The ``TransformerConfig`` fields that select ``policy``."""
    modules = recompute_modules if recompute_modules is not None else _DEFAULT_MODULES.get(policy)
    check_policy(policy, modules)
    fields = dict(
        recompute_granularity=None,
        recompute_method=None,
        recompute_num_layers=None,
        recompute_modules=["core_attn"],  # megatron's default, inert without 'selective'
        recompute_hyper_connections=False,
        mhc_recompute_layer_num=mhc_recompute_layer_num,
    )
    if policy in _DEFAULT_MODULES:
        fields.update(recompute_granularity="selective", recompute_modules=list(modules))
    if policy == "mhc_block":
        fields.update(recompute_hyper_connections=True)
    if policy == "full":
        fields.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    return fields


def configure_recompute(config, policy: str, **kwargs):
    """A copy of ``config`` with ``policy`` selected, validated (raises ConfigError)."""
    check_policy(policy, hyper_connections=config.enable_hyper_connections)
    fields = recompute_fields(policy, **kwargs)
    return dataclasses.replace(config, **fields)


def policy_of(config) -> str:
    """The policy name a config selects."""
    if config.recompute_hyper_connections:
        return "mhc_block"
    if config.recompute_granularity == "full":
        return "full"
    if config.recompute_granularity == "selective":
        return "selective"
    return "none"


# ----------------------------------------------------------- attaching managers
def _decoder_blocks(model: torch.nn.Module):
    return [m for m in model.modules() if hasattr(m, "recompute_block_ranges")]


def attach_recompute(model: torch.nn.Module, keep_managers: bool = False) -> list[MHCBlockRecomputeManager]:
    """Hook managers onto every decoder block of ``model`` whose config asks for
    ``recompute_hyper_connections``. Idempotent.

    For each recompute block, a forward pre-hook on its first layer creates a
    fresh manager (only when training with grad enabled) and hands it to the
    block's layers; a forward hook on its last layer discards the outputs and
    registers the unified recompute hook on that layer's output. With
    ``keep_managers`` the returned list collects every manager created (one per
    block per training forward: for inspection and tests, not for long runs).
    """
    detach_recompute(model)
    created: list[MHCBlockRecomputeManager] = []
    for block in _decoder_blocks(model):
        if not block.config.recompute_hyper_connections:
            continue
        handles = []
        for start, end in block.recompute_block_ranges():
            layers = [block.layers[i] for i in range(start, end)]
            for layer in layers:
                layer.is_last_layer_in_block = layer is layers[-1]
            handles.append(layers[0].register_forward_pre_hook(
                _make_pre_hook(layers, created if keep_managers else None)))
            handles.append(layers[-1].register_forward_hook(_make_post_hook(layers)))
        block._mhc_recompute_handles = handles
        block.mhc_recompute_attached = True
    return created


def detach_recompute(model: torch.nn.Module) -> None:
    for block in _decoder_blocks(model):
        for handle in getattr(block, "_mhc_recompute_handles", []):
            handle.remove()
        block._mhc_recompute_handles = []
        block.mhc_recompute_attached = False
        for layer in block.layers:
            layer.mhc_recompute_manager = None
            layer.is_last_layer_in_block = False


def _make_pre_hook(layers, created):
    def pre_hook(module, args):
        if not (module.training and torch.is_grad_enabled()):
            return
        first, last = layers[0].layer_number, layers[-1].layer_number
        manager = MHCBlockRecomputeManager(name=f"layers {first}-{last}")
        if created is not None:
            created.append(manager)
        for layer in layers:
            layer.mhc_recompute_manager = manager

    return pre_hook


def _make_post_hook(layers):
    def post_hook(module, args, output):
        manager = layers[-1].mhc_recompute_manager
        if manager is None:
            return
        for layer in layers:
            layer.mhc_recompute_manager = None
        manager.discard_all_outputs_and_register_unified_recompute(output[0])

    return post_hook
