"""Recompute for a model split by ``parallelize``: the policy's checks in ``parallelize``'s words,
and the recompute pass (:func:`apply_recompute`) on this rank's built chunks (Hugging Face's own
gradient checkpointing replays the randomizer's streams instead, ``recompute/rng.py``).
"""
from __future__ import annotations

import fnmatch
import functools
from typing import TYPE_CHECKING

import torch
from torch import nn

from lightning_mhc.errors import ConfigError, Label, term
from lightning_mhc.recompute.groups import attach_block_recompute
from lightning_mhc.recompute.policy import RecomputePolicy
from lightning_mhc.recompute.without_output import checkpoint
from lightning_mhc.wrapping import wrap

if TYPE_CHECKING:
    from lightning_mhc.any_model.pipeline import StageChunk
    from lightning_mhc.any_model.plan import TPPlan

PARALLELIZE_LABELS = {
    "policy": Label("recompute"),
    "hyper_connections": Label("hyper_connections", lambda _: (
        "a model with hyper-connections (parallelize(..., hyper_connections=n), add_hyper_connections(model), or "
        "MHCGPTModule)")),
}
"""How ``parallelize`` names a recompute policy's fields in its errors: by its arguments (a model it
splits has hyper-connections or not, whichever way they were added)."""


def check_recompute(policy: RecomputePolicy, hyper_connections: bool | None = None, native_streams: int = 1,
                    native_block_recompute: bool = False) -> None:
    """What ``parallelize`` runs of a recompute policy: no named ``modules`` (it checkpoints the
    modules its plan or ``recompute_modules`` name by pattern), and the block recompute only for a
    model with hyper-connections (``hyper_connections``; None: not known yet, checked when the
    model is split): ours, or a family's own (``native_streams`` > 1) where its record builds the
    block recompute of them (``native_block_recompute``: DeepSeek-V4's); on another family's own it
    is said to be not built, rather than "needs hyper-connections". Its errors name
    ``parallelize``'s arguments (``PARALLELIZE_LABELS``)."""
    if policy.block and native_streams > 1 and not native_block_recompute:
        raise ConfigError(f"recompute='mhc_block' on the model's own hyper-connections ({native_streams} streams of "
                          "its family's design) is not built for its family yet: use recompute='full' (or "
                          "'selective' with recompute_modules) for the memory.")
    try:
        if policy.modules is not None and not (policy.block and policy.modules == ("layernorm",)):
            raise ConfigError(term("policy", policy.name), " with ", term("recompute_modules", list(policy.modules)),
                              ": a model split by parallelize() names the selectively recomputed modules by "
                              "pattern, parallelize(recompute_modules=[patterns]) (default: the plan's selective "
                              "list).")
        if hyper_connections is not None:
            policy.check_model(hyper_connections or native_streams > 1, model_field="hyper_connections")
    except ConfigError as error:
        raise error.relabel(PARALLELIZE_LABELS) from None


def check_selective(policy: RecomputePolicy, plan: TPPlan) -> None:
    """``selective`` only where the model's TP plan (or ``recompute_modules``) names modules to
    checkpoint."""
    if policy.selective and not plan.selective:
        raise ConfigError("recompute='selective' needs the modules to checkpoint: pass recompute_modules=[patterns] "
                          "(e.g. ['*.mlp']) or use a plan with a selective list.")


def apply_recompute(chunks: list[StageChunk], policy: RecomputePolicy, plan: TPPlan, streams: int = 1,
                    block_path: str | None = None) -> None:
    """The recompute pass: ``policy`` on this rank's built chunks: ``selective``, the modules the
    plan's ``selective`` patterns name; ``full``, every block; the mHC block recompute, groups of
    blocks within each stage (their sizes from the ``streams`` the blocks carry, ours or the
    family's own: the blocks then checkpoint their hyper-connections into their group; named by
    their first and last block, ``block_path.i..block_path.j``)."""
    seen: set[int] = set()  # a part every stage runs is in each chunk's builds: checkpointed once
    for chunk in chunks:
        for name, module, _ in chunk.builds if policy.selective else ():
            for sub_name, sub in module.named_modules(prefix=name):
                if id(sub) not in seen and any(fnmatch.fnmatchcase(sub_name, p) for p in plan.selective):
                    seen.add(id(sub))
                    _checkpointed(sub)
        local = list(chunk.blocks.values())
        if policy.full:
            for block in local:
                _checkpointed(block)
        if policy.block and local:
            name = {id(block): f"{block_path}.{i}" for i, block in chunk.blocks.items()}
            attach_block_recompute(local, policy.block_ranges(streams, len(local)),
                                   lambda first, last: f"{name[id(first)]}..{name[id(last)]}")


def _checkpointed(module: nn.Module) -> None:
    wrap(module, "checkpointed", _checkpointed_forward)


def _checkpointed_forward(module: nn.Module, forward):
    @functools.wraps(forward)
    def run(*args, **kwargs):
        if module.training and torch.is_grad_enabled():
            return checkpoint(forward, *args, **kwargs)
        return forward(*args, **kwargs)

    return run
