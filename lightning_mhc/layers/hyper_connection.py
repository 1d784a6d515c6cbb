"""Manifold-constrained hyper-connections (mHC, arXiv 2512.24880, eq. 7-9): the module.

The residual stream ``x`` is ``n`` streams of width ``C``, stored as
``[s, b, n*C]``. Around a sub-layer ``F``::

    x' = RMSNorm(flatten(x))                                  # over n*C, per token
    H_pre  = sigmoid(a_pre  * (x' @ phi_pre)  + b_pre)        # [s, b, n]
    H_post = 2 * sigmoid(a_post * (x' @ phi_post) + b_post)   # [s, b, n]
    H_res  = SinkhornKnopp(a_res * mat(x' @ phi_res) + b_res) # [s, b, n, n]
    x_next = H_res @ x + H_post^T * F(H_pre @ x)

The math lives in ``lightning_mhc.ops.hyper_connection`` (a readable reference
and a fused, memory-lean version, chosen by ``mhc_implementation``); this
module holds the parameters and picks the implementation. The mappings are
computed in fp32 whatever the training dtype.

Both model wings build it: the GPT (``model/transformer_layer.py``) from its
``MHCTransformerConfig``, the Hugging Face wing (``any_model/hyper_connections.py``)
from its ``HyperConnectionSettings`` and the model's width; each hands it a
:class:`HyperConnectionConfig`, what one module needs and nothing of megatron's
``TransformerConfig``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_mhc.errors import ConfigError, term
from lightning_mhc.layers.init import ParamInit
from lightning_mhc.ops import MHC_IMPLEMENTATIONS, fused_kernels, is_fused, triton_available
from lightning_mhc.ops.hyper_connection import (
    compiled,
    fused_pre_packed,
    reference_aggregate,
    reference_apply_h_post,
    reference_apply_h_res,
    reference_mappings,
    reference_pre,
)
from lightning_mhc.ops.sinkhorn import sinkhorn_knopp

__all__ = ["HyperConnectionConfig", "HyperConnectionModule", "check_hyper_connection_values", "sinkhorn_knopp"]


def check_hyper_connection_values(sinkhorn_iterations: int, implementation: str, init_gating_factor: float) -> None:
    """Each setting's own range, under megatron's field names (``mhc_*``), which both wings'
    errors name: the GPT's config spells them so, and the Hugging Face wing's settings have
    always answered with them."""
    if sinkhorn_iterations < 1:
        raise ConfigError(term("mhc_sinkhorn_iterations", sinkhorn_iterations),
                          ": need at least 1 Sinkhorn-Knopp iteration (default 20).")
    if implementation not in MHC_IMPLEMENTATIONS:
        raise ConfigError(
            term("mhc_implementation", implementation), f": choose one of {', '.join(MHC_IMPLEMENTATIONS)} ('auto' "
            "picks the fused ops; 'reference' forces the op-by-op path).")
    if implementation == "triton" and not triton_available():
        raise ConfigError(term("mhc_implementation", "triton"), " needs Triton, which does not import here: "
                          "pip install 'lightning_mhc[triton]', or choose 'auto', 'fused' or 'compile'.")
    gating = init_gating_factor
    if isinstance(gating, bool) or not isinstance(gating, (int, float)) or not 0 <= gating < math.inf:
        raise ConfigError(
            term("mhc_init_gating_factor", gating), ": the initial value of the gating scalars a_pre, a_post, a_res "
            "must be a finite number >= 0 (Megatron-LM refuses negative values). Use e.g. 0.01, the paper's value.")


@dataclass(frozen=True)
class HyperConnectionConfig:
    """What one :class:`HyperConnectionModule` is built with: its streams and width, its norm's
    epsilon, its initialisation and its ops. Its makers check the values (the GPT's config, the
    Hugging Face wing's settings: :func:`check_hyper_connection_values`); a setting of the math
    itself (a convention of the mappings, say) is one more field here, read by the ops."""

    num_residual_streams: int
    hidden_size: int
    eps: float = 1e-5
    init_std: float = 0.02
    init_gating_factor: float = 0.01
    implementation: str = "auto"
    sinkhorn_iterations: int = 20

    @property
    def residual_width(self) -> int:
        """``n * C``: the width of the residual stream ``[..., n*C]``."""
        return self.num_residual_streams * self.hidden_size

    @classmethod
    def of(cls, config: Any) -> "HyperConnectionConfig":
        """``config`` itself, or read off a transformer config under megatron's names
        (``MHCTransformerConfig``: ``num_residual_streams``, ``hidden_size``, ``layernorm_epsilon``,
        ``init_method_std`` and the ``mhc_*`` fields)."""
        if isinstance(config, cls):
            return config
        return cls(num_residual_streams=config.num_residual_streams, hidden_size=config.hidden_size,
                   eps=config.layernorm_epsilon, init_std=config.init_method_std,
                   init_gating_factor=config.mhc_init_gating_factor, implementation=config.mhc_implementation,
                   sinkhorn_iterations=config.mhc_sinkhorn_iterations)


class HyperConnectionModule(torch.nn.Module):
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

    def __init__(self, config: HyperConnectionConfig | Any, init: ParamInit) -> None:
        """``config``: a :class:`HyperConnectionConfig`, or a transformer config it is read off
        (:meth:`HyperConnectionConfig.of`)."""
        super().__init__()
        config = HyperConnectionConfig.of(config)
        self.config = config
        self.label = init.prefix  # names its checkpoints in a recompute plan
        n, width = config.num_residual_streams, config.residual_width
        self.n = n
        self.hidden_size = config.hidden_size
        self.eps = config.eps
        self.sinkhorn_iterations = config.sinkhorn_iterations

        m = n * n + 2 * n
        # Packed, as three parameters (one projection, one gate vector, one bias): the fused op
        # takes them as they are, and the optimizer steps 3 tensors per hyper-connection, not 9.
        # The named pieces (phi_pre, a_res, b_res, ...) are views, below.
        self.phi = torch.nn.Parameter(torch.empty(width, m, dtype=torch.float32))  # [phi_pre | phi_post | phi_res]
        self.alpha = torch.nn.Parameter(torch.empty(3, dtype=torch.float32))  # [a_pre, a_post, a_res]
        self.bias = torch.nn.Parameter(torch.empty(m, dtype=torch.float32))  # [b_pre | b_post | b_res (row-major)]
        self._initialize(init)

    def _initialize(self, init: ParamInit) -> None:
        std = self.config.init_std
        with torch.no_grad():
            for name in ("phi_pre", "phi_post", "phi_res"):  # each block from its own generator
                init.normal(name, std)(getattr(self, name))
            self.alpha.fill_(self.config.init_gating_factor)
            self.bias.zero_()
            self.b_pre.fill_(-math.log(self.n - 1) if self.n > 1 else 0.0)

    # the named pieces of the packed parameters (views: writing them writes the parameters)
    phi_pre = property(lambda self: self.phi[:, :self.n])
    phi_post = property(lambda self: self.phi[:, self.n:2 * self.n])
    phi_res = property(lambda self: self.phi[:, 2 * self.n:])
    a_pre = property(lambda self: self.alpha[0])
    a_post = property(lambda self: self.alpha[1])
    a_res = property(lambda self: self.alpha[2])
    b_pre = property(lambda self: self.bias[:self.n])
    b_post = property(lambda self: self.bias[self.n:2 * self.n])
    b_res = property(lambda self: self.bias[2 * self.n:].view(self.n, self.n))

    # ----------------------------------------------------------- the math
    @property
    def params(self) -> tuple[Tensor, ...]:
        """The nine named pieces, in the order the reference ops take them."""
        return (self.phi_pre, self.phi_post, self.phi_res, self.a_pre, self.a_post, self.a_res,
                self.b_pre, self.b_post, self.b_res)

    @property
    def fused(self) -> bool:
        return is_fused(self.config.implementation)

    def compute_mappings(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``x [s, b, n*C]`` -> ``(H_pre [s,b,n], H_post [s,b,n], H_res [s,b,n,n])``, all fp32 (reference)."""
        return reference_mappings(x, *self.params, n=self.n, eps=self.eps, iterations=self.sinkhorn_iterations)

    def aggregate(self, x: Tensor, h_pre: Tensor) -> Tensor:
        """``H_pre @ x``: ``[s,b,n*C]`` -> the sub-layer input ``[s,b,C]`` (reference)."""
        return reference_aggregate(x, h_pre, self.n)

    def apply_h_res(self, h_res: Tensor, residual: Tensor) -> Tensor:
        """``H_res @ x``: stream ``i`` becomes ``sum_j H_res[i, j] * x_j`` (reference)."""
        return reference_apply_h_res(h_res, residual, self.n)

    def apply_h_post(
        self, x_with_bias: tuple[Tensor, Tensor | None], h_post: Tensor
    ) -> tuple[Tensor, None]:
        """``H_post^T * F``: stream ``i`` receives ``H_post[i] * (out + bias)``.

        The bias is folded in (it becomes per-token after scaling), so the
        returned pair has no bias.
        """
        out, bias = x_with_bias
        with torch.autocast(device_type=out.device.type, enabled=False):
            if bias is not None:
                out = out + bias
            return reference_apply_h_post(out, h_post), None

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
    def forward(self, hidden_states: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``[s,b,n*C]`` -> ``(aggregated [s,b,C], H_res [s,b,n,n], H_post [s,b,n])`` (as Megatron-LM's).

        Mappings and aggregate together: one fused autograd node (``mhc_implementation``
        'auto'/'fused'/'triton', its kernels chosen by ``fused_kernels``) or the reference ops,
        compiled by ``torch.compile`` under 'compile'. The layer checkpoints this call as one unit
        under block recompute; ``H_res @ x`` is applied with ``H_post`` by the bias-dropout-add
        (``lightning_mhc.layers.bda.h_res_h_post_bias_dropout_add``).
        """
        if self.fused:
            kernels = fused_kernels(self.config.implementation, hidden_states.device.type)
            return fused_pre_packed(hidden_states, self.phi, self.alpha, self.bias, self.n, self.eps,
                                    self.sinkhorn_iterations, kernels)
        pre = compiled(reference_pre) if self.config.implementation == "compile" else reference_pre
        return pre(hidden_states, self.params, self.n, self.eps, self.sinkhorn_iterations)
