"""RMS normalisation in fp32, as megatron's norms are under mixed precision (fp64 stays fp64:
the tests' exact evaluation of the reference).

``rms_normalize`` is one autograd node (hand-written backward) so that its
input has a single consumer: with the input also feeding other ops, gradient
accumulation then happens in the same order whether or not the op sits inside
a recompute checkpoint, which keeps recomputed runs bit-identical.
"""
from __future__ import annotations

import torch
from torch import Tensor


def at_least_fp32(t: Tensor) -> Tensor:
    """``t`` in fp32, or as it is when fp64: the mappings' precision (the reference evaluated in
    fp64 is what the tests measure every implementation's error against)."""
    return t if t.dtype == torch.float64 else t.float()


class _RMSNormalize(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, eps: float) -> Tensor:
        xf = at_least_fp32(x)
        r = torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
        ctx.save_for_backward(x, r)
        return xf * r

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, r = ctx.saved_tensors
        y = at_least_fp32(x) * r
        grad = at_least_fp32(grad)
        grad_x = r * (grad - y * (grad * y).mean(dim=-1, keepdim=True))
        return grad_x.to(x.dtype), None


def rms_normalize(x: Tensor, eps: float) -> Tensor:
    """``x / sqrt(mean(x^2) + eps)`` over the last dimension, in fp32 (or fp64)."""
    with torch.autocast(device_type=x.device.type, enabled=False):
        return _RMSNormalize.apply(x, eps)
