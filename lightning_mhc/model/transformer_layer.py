"""One transformer layer: attention and MLP sub-layers, each wrapped by its own
hyper-connection and followed by a bias-dropout-add (seed 000's method split).

Without hyper-connections the layer is megatron's pre-norm layer::

    x = x + dropout(attn(norm(x)));  x = x + dropout(mlp(norm(x)))

With them, the hidden state is the ``[s, b, n*C]`` residual stream and each
sub-layer computes ``H_res @ x + H_post^T * F(H_pre @ x)``.
"""
from __future__ import annotations

import torch
from torch import Tensor

from lightning_mhc.model.bda import bias_dropout_add
from lightning_mhc.model.config import MHCTransformerConfig
from lightning_mhc.model.attention import SelfAttention
from lightning_mhc.model.hyper_connection import HyperConnectionModule
from lightning_mhc.model.init import ParamInit
from lightning_mhc.model.mlp import MLP
from lightning_mhc.model.norm import RMSNorm


class TransformerLayer(torch.nn.Module):
    """A layer of the decoder; ``layer_number`` is global and 1-based, as in megatron."""

    def __init__(self, config: MHCTransformerConfig, layer_number: int, init: ParamInit) -> None:
        super().__init__()
        self.config = config
        self.layer_number = layer_number
        self.hidden_dropout = config.hidden_dropout
        hc = config.enable_hyper_connections
        self.self_attention_hyper_connection = (
            HyperConnectionModule(config, init.child("self_attention_hyper_connection")) if hc else None
        )
        self.input_layernorm = RMSNorm(config.hidden_size, config.layernorm_epsilon)
        self.self_attention = SelfAttention(config, init.child("self_attention"))
        self.mlp_hyper_connection = (
            HyperConnectionModule(config, init.child("mlp_hyper_connection")) if hc else None
        )
        self.pre_mlp_layernorm = RMSNorm(config.hidden_size, config.layernorm_epsilon)
        self.mlp = MLP(config, init.child("mlp"))

    # ------------------------------------------------------------ forward
    def forward(
        self,
        hidden_states: Tensor,
        rotary_freqs: Tensor | None = None,
        mhc_recompute_manager=None,
        is_last_layer_in_block: bool = False,
    ) -> tuple[Tensor, None]:
        """``hidden_states [s, b, n*C]`` -> ``(hidden_states, context=None)``, like megatron."""
        hidden_states = self._forward_attention(hidden_states, rotary_freqs, mhc_recompute_manager)
        hidden_states = self._forward_mlp(hidden_states, mhc_recompute_manager, is_last_layer_in_block)
        return hidden_states, None

    def _forward_attention(
        self, hidden_states: Tensor, rotary_freqs: Tensor | None, mhc_recompute_manager=None
    ) -> Tensor:
        residual = hidden_states
        hc = self.self_attention_hyper_connection
        if hc is not None:
            hidden_states, residual, h_post = hc(hidden_states, residual, mhc_recompute_manager)
        attention_output_with_bias = self.self_attention(
            self.input_layernorm(hidden_states), rotary_freqs
        )
        if hc is not None:
            attention_output_with_bias = hc.apply_h_post_with_checkpoint(
                attention_output_with_bias, h_post, mhc_recompute_manager
            )
        return bias_dropout_add(
            attention_output_with_bias, residual, self.hidden_dropout, self.training
        )

    def _forward_mlp(
        self, hidden_states: Tensor, mhc_recompute_manager=None, is_last_layer_in_block: bool = False
    ) -> Tensor:
        residual = hidden_states
        hc = self.mlp_hyper_connection
        if hc is not None:
            hidden_states, residual, h_post = hc(hidden_states, residual, mhc_recompute_manager)
        mlp_output_with_bias = self.mlp(self.pre_mlp_layernorm(hidden_states))
        if hc is not None:
            mlp_output_with_bias = hc.apply_h_post_with_checkpoint(
                mlp_output_with_bias, h_post, mhc_recompute_manager
            )
        return self._forward_post_mlp(
            mlp_output_with_bias, residual, mhc_recompute_manager, is_last_layer_in_block
        )

    def _forward_post_mlp(
        self,
        mlp_output_with_bias: tuple[Tensor, Tensor | None],
        residual: Tensor,
        mhc_recompute_manager=None,
        is_last_layer_in_block: bool = False,
    ) -> Tensor:
        return bias_dropout_add(mlp_output_with_bias, residual, self.hidden_dropout, self.training)
