"""Rotary position embedding (RoPE) on ``[s, b, heads, head_dim]`` tensors."""
from __future__ import annotations

import torch
from torch import Tensor


def rotary_freqs(seq_len: int, head_dim: int, base: int, device: torch.device) -> Tensor:
    """Angles ``[s, 1, 1, head_dim]`` in fp32 (megatron's non-interleaved layout)."""
    return rotary_freqs_at(torch.arange(seq_len, device=device), head_dim, base)


def rotary_freqs_at(positions: Tensor, head_dim: int, base: int) -> Tensor:
    """Angles ``[len(positions), 1, 1, head_dim]`` of the given global token positions (under
    context parallelism a rank's tokens are two chunks of the sequence: ``chunk_positions``);
    each row is the one ``rotary_freqs`` computes at that position, bit for bit."""
    device = positions.device
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    angles = torch.outer(positions.to(torch.float32), inv_freq)
    return torch.cat([angles, angles], dim=-1)[:, None, None, :]


def _rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rotary(x: Tensor, freqs: Tensor) -> Tensor:
    cos, sin = freqs.cos().to(x.dtype), freqs.sin().to(x.dtype)
    return x * cos + _rotate_half(x) * sin
