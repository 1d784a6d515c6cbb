"""Activation names and the ``TransformerConfig`` fields they stand for (torch only).

Shared by the model config (``model_config_to_dict`` records the activation by name) and
the Hydra schema (``model.activation``); kept out of both layers so that neither imports
the other, and the schema stays free of megatron-core.
"""
from __future__ import annotations

from typing import Callable

import torch.nn.functional as F

ACTIVATIONS: dict[str, tuple[Callable, bool]] = {"gelu": (F.gelu, False), "swiglu": (F.silu, True)}
"""name -> (activation_func, gated_linear_unit)."""


def activation_name(activation_func: Callable, gated_linear_unit: bool) -> str | None:
    """The name of ``(activation_func, gated_linear_unit)`` in ``ACTIVATIONS``, or None."""
    for name, (func, gated) in ACTIVATIONS.items():
        if func is activation_func and gated == bool(gated_linear_unit):
            return name
    return None
