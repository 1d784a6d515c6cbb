"""Rotary position embedding (RoPE) on ``[s, b, heads, head_dim]`` tensors."""
from __future__ import annotations

import torch
from torch import Tensor


def rotary_freqs(seq_len: int, head_dim: int, base: int, device: torch.device) -> Tensor:
    """Angles ``[s, 1, 1, head_dim]`` in fp32 (megatron's non-interleaved layout)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    positions = torch.arange(seq_len, device=device, dtype=torch.float32)
    angles = torch.outer(positions, inv_freq)
    return torch.cat([angles, angles], dim=-1)[:, None, None, :]


def _rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rotary(x: Tensor, freqs: Tensor) -> Tensor:
    cos, sin = freqs.cos().to(x.dtype), freqs.sin().to(x.dtype)
    return x * cos + _rotate_half(x) * sin
