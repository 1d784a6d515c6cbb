"""RMSNorm computed in fp32, as megatron's norms are under mixed precision."""
from __future__ import annotations

import torch
from torch import Tensor


class RMSNorm(torch.nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size))

    def forward(self, x: Tensor) -> Tensor:
        with torch.autocast(device_type=x.device.type, enabled=False):
            xf = x.float()
            out = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + self.eps)
            return (out * self.weight.float()).to(x.dtype)
