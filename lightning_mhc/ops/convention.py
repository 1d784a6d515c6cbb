"""Which hyper-connection convention the ops compute: the one place the choice is named.

- ``"mhc"`` (this project's, the paper's eq. 7-9): ``H_pre = sigmoid(z_pre)``; ``H_res`` from
  ``P = exp(L - max L)`` with ``L = mat(z_res)`` row-major, then ``t`` rounds of columns, then rows,
  each sum clamped to ``>= eps``; the layer computes ``H_res x + H_post^T F``.
- ``"deepseek_v4"`` (DeepSeek-V4's ``DeepseekV4HyperConnection`` in transformers, which Megatron-LM
  main follows): ``pre = sigmoid(z_pre) + eps``; ``comb = softmax(mat(z_res), rows) + eps``, then
  columns, then ``t - 1`` rounds of rows and columns, each divided by ``sum + eps``; the layer
  computes ``post ⊗ F + comb^T x``. The ops hand ``comb^T`` on as ``H_res``, so the stream mixing
  (``H_res x + H_post^T F``) is one kernel for both.

``eps`` is the convention's floor: the clamp of the mHC Sinkhorn's sums, V4's ``hc_eps`` (added to
``pre``, to ``comb`` after the softmax, and to every Sinkhorn sum). ``post = 2 sigmoid(z_post)`` and
the projection ``z = alpha * (x @ phi) / rms(x) + bias`` are the same in both (V4's ``fn`` is
``phi^T``, its ``scale`` ``alpha``, its ``base`` ``bias``; docs/native_mhc.md has the mapping).
"""
from __future__ import annotations

from dataclasses import dataclass

CONVENTIONS = ("mhc", "deepseek_v4")


@dataclass(frozen=True)
class Convention:
    """A convention and its floor ``eps`` (see the module docstring)."""

    name: str = "mhc"
    eps: float = 1e-6

    def __post_init__(self) -> None:
        if self.name not in CONVENTIONS:
            raise ValueError(f"hyper-connection convention {self.name!r}: one of {CONVENTIONS}")
        if not self.eps > 0:
            raise ValueError(f"hyper-connection convention {self.name!r}: eps={self.eps!r} must be > 0")

    @property
    def deepseek_v4(self) -> bool:
        return self.name == "deepseek_v4"

    @property
    def pre_floor(self) -> float:
        """What is added to ``sigmoid(z_pre)``: V4's ``hc_eps``; nothing in mHC."""
        return self.eps if self.deepseek_v4 else 0.0


MHC = Convention()
"""The project's convention with the Sinkhorn clamp at 1e-6 (``SINKHORN_EPS``)."""


def deepseek_v4(eps: float = 1e-6) -> Convention:
    """DeepSeek-V4's convention with its ``hc_eps``."""
    return Convention("deepseek_v4", eps)
