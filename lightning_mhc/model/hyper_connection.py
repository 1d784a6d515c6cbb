"""Manifold-constrained hyper-connections (mHC, arXiv 2512.24880, eq. 7-9).

The residual stream ``x`` is ``n`` streams of width ``C``, stored as
``[s, b, n*C]``. Around a sub-layer ``F``::

    x' = RMSNorm(flatten(x))                                  # over n*C, per token
    H_pre  = sigmoid(a_pre  * (x' @ phi_pre)  + b_pre)        # [s, b, n]
    H_post = 2 * sigmoid(a_post * (x' @ phi_post) + b_post)   # [s, b, n]
    H_res  = SinkhornKnopp(a_res * mat(x' @ phi_res) + b_res) # [s, b, n, n]
    x_next = H_res @ x + H_post^T * F(H_pre @ x)

The mappings are computed in fp32 whatever the training dtype.
"""
from __future__ import annotations

import math

import torch
from megatron.core.transformer.module import MegatronModule
from torch import Tensor

from lightning_mhc.model.config import MHCTransformerConfig
from lightning_mhc.model.init import ParamInit
from lightning_mhc.model.norm import rms_normalize


def sinkhorn_knopp(logits: Tensor, iterations: int) -> Tensor:
    """Project ``[..., n, n]`` logits onto (close to) the doubly stochastic matrices.

    Starts from ``exp`` of the max-subtracted logits and alternates column and
    row normalisation, in fp32.
    """
    logits = logits.float()
    p = torch.exp(logits - logits.amax(dim=(-2, -1), keepdim=True))
    for _ in range(iterations):
        p = p / p.sum(dim=-2, keepdim=True)  # columns sum to 1
        p = p / p.sum(dim=-1, keepdim=True)  # rows sum to 1
    return p


def _no_autocast(device_type: str):
    return torch.autocast(device_type=device_type, enabled=False)


class HyperConnectionModule(MegatronModule):
    """One hyper-connection around one sub-layer (attention or MLP).

    Parameters are replicated on every tensor-parallel rank (the residual
    stream is not split by TP), so their gradients are identical there.

    Initialisation makes a fresh layer a plain pre-norm residual layer on each
    stream, up to the small dynamic terms (``a_* = mhc_init_gating_factor``):
    ``b_pre = logit(1/n)`` so ``H_pre @ x`` averages the streams, ``b_post = 0``
    so every stream receives the full sub-layer output (``H_post = 1``), and
    ``b_res = 0`` so ``H_res = J/n``, which maps the identical streams made by
    :meth:`input_expand` onto themselves.
    """

    def __init__(self, config: MHCTransformerConfig, init: ParamInit) -> None:
        super().__init__(config=config)
        self.label = init.prefix  # names its checkpoints in a recompute plan
        n, width = config.num_residual_streams, config.residual_width
        self.n = n
        self.hidden_size = config.hidden_size
        self.eps = config.layernorm_epsilon
        self.sinkhorn_iterations = config.mhc_sinkhorn_iterations

        def param(*shape: int) -> torch.nn.Parameter:
            return torch.nn.Parameter(torch.empty(shape, dtype=torch.float32))

        self.phi_pre, self.phi_post, self.phi_res = param(width, n), param(width, n), param(width, n * n)
        self.a_pre, self.a_post, self.a_res = param(), param(), param()
        self.b_pre, self.b_post, self.b_res = param(n), param(n), param(n, n)
        self._initialize(init)

    def _initialize(self, init: ParamInit) -> None:
        std = self.config.init_method_std
        with torch.no_grad():
            for name in ("phi_pre", "phi_post", "phi_res"):
                init.normal(name, std)(getattr(self, name))
            for name in ("a_pre", "a_post", "a_res"):
                getattr(self, name).fill_(self.config.mhc_init_gating_factor)
            self.b_pre.fill_(-math.log(self.n - 1) if self.n > 1 else 0.0)
            self.b_post.zero_()
            self.b_res.zero_()

    # ----------------------------------------------------------- the math
    def compute_mappings(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``x [s, b, n*C]`` -> ``(H_pre [s,b,n], H_post [s,b,n], H_res [s,b,n,n])``, all fp32."""
        n = self.n
        with _no_autocast(x.device.type):
            xn = rms_normalize(x, self.eps)
            phi = torch.cat([self.phi_pre, self.phi_post, self.phi_res], dim=1).float()
            proj = xn @ phi
            p_pre, p_post, p_res = proj.split([n, n, n * n], dim=-1)
            h_pre = torch.sigmoid(self.a_pre * p_pre + self.b_pre)
            h_post = 2.0 * torch.sigmoid(self.a_post * p_post + self.b_post)
            res_logits = self.a_res * p_res.unflatten(-1, (n, n)) + self.b_res
            h_res = sinkhorn_knopp(res_logits, self.sinkhorn_iterations)
        return h_pre, h_post, h_res

    def aggregate(self, x: Tensor, h_pre: Tensor) -> Tensor:
        """``H_pre @ x``: ``[s,b,n*C]`` -> the sub-layer input ``[s,b,C]``."""
        with _no_autocast(x.device.type):
            streams = x.unflatten(-1, (self.n, self.hidden_size))
            return (h_pre.to(x.dtype).unsqueeze(-1) * streams).sum(dim=-2)

    def apply_h_res(self, h_res: Tensor, residual: Tensor) -> Tensor:
        """``H_res @ x``: stream ``i`` becomes ``sum_j H_res[i, j] * x_j``."""
        with _no_autocast(residual.device.type):
            streams = residual.unflatten(-1, (self.n, self.hidden_size))
            mixed = torch.matmul(h_res.to(residual.dtype), streams)
            return mixed.flatten(-2)

    def apply_h_post(
        self, x_with_bias: tuple[Tensor, Tensor | None], h_post: Tensor
    ) -> tuple[Tensor, None]:
        """``H_post^T * F``: stream ``i`` receives ``H_post[i] * (out + bias)``.

        The bias is folded in (it becomes per-token after scaling), so the
        returned pair has no bias.
        """
        out, bias = x_with_bias
        with _no_autocast(out.device.type):
            if bias is not None:
                out = out + bias
            spread = h_post.to(out.dtype).unsqueeze(-1) * out.unsqueeze(-2)
            return spread.flatten(-2), None

    # ---------------------------------------------------------- expansion
    @staticmethod
    def input_expand(x: Tensor, num_streams: int) -> Tensor:
        """``[s, b, C]`` -> ``[s, b, n*C]``: every stream starts as a copy of the embedding."""
        return x.unsqueeze(-2).expand(*x.shape[:-1], num_streams, x.shape[-1]).flatten(-2)

    @staticmethod
    def output_contract(x: Tensor, num_streams: int) -> Tensor:
        """``[s, b, n*C]`` -> ``[s, b, C]``: the mean of the streams."""
        return x.unflatten(-1, (num_streams, x.shape[-1] // num_streams)).mean(dim=-2)

    # ------------------------------------------------------------ forward
    def forward(
        self, hidden_states: Tensor, residual: Tensor, mhc_recompute_manager=None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Returns ``(aggregated [s,b,C], mixed residual [s,b,n*C], H_post)``.

        With a recompute manager each op is a checkpoint registered with it
        (seed 000): its output is freed after the block and recomputed in backward.
        """
        if mhc_recompute_manager is None:
            h_pre, h_post, h_res = self.compute_mappings(hidden_states)
            aggregated = self.aggregate(hidden_states, h_pre)
            mixed = self.apply_h_res(h_res, residual)
            return aggregated, mixed, h_post
        m, label = mhc_recompute_manager, self.label
        h_pre, h_post, h_res = m.checkpoint(self.compute_mappings, hidden_states, name=f"{label}.compute_mappings")
        aggregated = m.checkpoint(self.aggregate, hidden_states, h_pre, name=f"{label}.aggregate")
        mixed = m.checkpoint(self.apply_h_res, h_res, residual, name=f"{label}.apply_h_res")
        return aggregated, mixed, h_post

    def apply_h_post_with_checkpoint(
        self, x_with_bias: tuple[Tensor, Tensor | None], h_post: Tensor, manager=None
    ) -> tuple[Tensor, None]:
        if manager is None:
            return self.apply_h_post(x_with_bias, h_post)
        return manager.checkpoint(self.apply_h_post, x_with_bias, h_post, name=f"{self.label}.apply_h_post")
