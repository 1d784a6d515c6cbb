"""Bias-dropout-add: ``residual + dropout(out + bias)``."""
from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from lightning_mhc.recompute.rng import rng_fork


def bias_dropout_add(
    x_with_bias: tuple[Tensor, Tensor | None], residual: Tensor, prob: float, training: bool
) -> Tensor:
    out, bias = x_with_bias
    if bias is not None:
        out = out + bias
    with rng_fork("tensor"):  # the residual stream is replicated across TP: same mask there
        dropped = F.dropout(out, p=prob, training=training)
    return residual + dropped
