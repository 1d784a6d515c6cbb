"""``RMSNorm``: the model's norm, in fp32 (``lightning_mhc.ops.rms_norm``)."""
from __future__ import annotations

import torch
from torch import Tensor

from lightning_mhc.ops.rms_norm import rms_normalize

__all__ = ["RMSNorm", "rms_normalize"]


class RMSNorm(torch.nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size))

    def forward(self, x: Tensor) -> Tensor:
        with torch.autocast(device_type=x.device.type, enabled=False):
            return (rms_normalize(x, self.eps) * self.weight.float()).to(x.dtype)
