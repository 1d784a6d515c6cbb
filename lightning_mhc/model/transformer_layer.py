"""One transformer layer: attention and MLP sub-layers, each wrapped by its own
hyper-connection and followed by a bias-dropout-add (the block-recompute design's method split).

Without hyper-connections the layer is megatron's pre-norm layer::

    x = x + dropout(attn(norm(x)));  x = x + dropout(mlp(norm(x)))

With them, the hidden state is the ``[s, b, n*C]`` residual stream and each
sub-layer computes ``H_res @ x + H_post^T * F(H_pre @ x)``.

Recompute (megatron's selective granularity, and block recompute: one hook per block):

- ``"core_attn"`` / ``"mlp"`` in ``recompute_modules``: SDPA / the MLP run under
  ``torch.utils.checkpoint`` (they are re-run in backward).
- ``"layernorm"``: the norms' outputs are discarded by ``CheckpointWithoutOutput``
  and recomputed from a hook on the sub-layer output, or, with a manager,
  together with the block.
- an ``mhc_recompute_manager`` (its recompute group's, ``lightning_mhc.recompute.groups``):
  two checkpoints per sub-layer go into the manager: the hyper-connection
  (mappings, aggregate, ``H_res @ x``) with the norm (with ``"layernorm"``;
  without it the norm output is kept), and the bias-dropout-add with
  ``H_post``, except the MLP bias-dropout-add of the block's last layer, whose
  output is the hook tensor. Attention and MLP are not re-run.
"""
from __future__ import annotations

import torch
from torch import Tensor

from lightning_mhc.distributed.layout import ParallelLayout, single_process_layout
from lightning_mhc.layers.bda import bias_dropout_add, h_res_h_post_bias_dropout_add
from lightning_mhc.model.config import MHCTransformerConfig
from lightning_mhc.model.attention import SelfAttention
from lightning_mhc.layers.hyper_connection import HyperConnectionModule
from lightning_mhc.layers.init import ParamInit
from lightning_mhc.model.mlp import MLP
from lightning_mhc.model.moe_mlp import MoEMLP
from lightning_mhc.model.sizes import is_moe_layer
from lightning_mhc.model.norm import RMSNorm
from lightning_mhc.recompute.without_output import CheckpointWithoutOutput, checkpoint
from lightning_mhc.roles import roles_of


class TransformerLayer(torch.nn.Module):
    """A layer of the decoder; ``layer_number`` is global and 1-based, as in megatron."""

    def __init__(self, config: MHCTransformerConfig, layer_number: int, init: ParamInit,
                 layout: ParallelLayout | None = None) -> None:
        super().__init__()
        self.config = config
        self.layer_number = layer_number
        self.hidden_dropout = config.hidden_dropout
        hc = config.enable_hyper_connections
        self.self_attention_hyper_connection = (
            HyperConnectionModule(config.hyper_connection, init.child("self_attention_hyper_connection")) if hc else None
        )
        self.input_layernorm = RMSNorm(config.hidden_size, config.layernorm_epsilon)
        self.self_attention = SelfAttention(config, init.child("self_attention"))
        self.mlp_hyper_connection = (
            HyperConnectionModule(config.hyper_connection, init.child("mlp_hyper_connection")) if hc else None
        )
        self.pre_mlp_layernorm = RMSNorm(config.hidden_size, config.layernorm_epsilon)
        self.mlp = self._build_mlp(config, layer_number, init.child("mlp"), layout)
        self.label = init.prefix

        selective = config.recompute_granularity == "selective"
        modules = (config.recompute_modules or []) if selective else []
        self.self_attention.recompute_core_attention = "core_attn" in modules
        self.recompute_input_layernorm = "layernorm" in modules
        self.recompute_pre_mlp_layernorm = "layernorm" in modules
        self.recompute_mlp = "mlp" in modules

    @staticmethod
    def _build_mlp(config: MHCTransformerConfig, layer_number: int, init: ParamInit,
                   layout: ParallelLayout | None) -> torch.nn.Module:
        """The dense MLP, or an MoE MLP on the EP group of ``layout`` (``moe_layer_freq``; no layout:
        a layer built outside any run, on the one-process one)."""
        if not is_moe_layer(config, layer_number):
            return MLP(config, init)
        layout = layout if layout is not None else single_process_layout()
        return MoEMLP(config, init, ep_group=layout.ep_group, token_group=layout.dp_cp_group)

    # ------------------------------------------------------------ forward
    def forward(
        self,
        hidden_states: Tensor,
        rotary_freqs: Tensor | None = None,
        mhc_recompute_manager=None,
        is_last_layer_in_block: bool | None = None,
    ) -> tuple[Tensor, None]:
        """``hidden_states [s, b, n*C]`` -> ``(hidden_states, context=None)``, like megatron.

        The manager and ``is_last_layer_in_block`` default to the recompute group this layer is
        in (``lightning_mhc.recompute.groups``); the group's last layer hands it its output.
        """
        roles = roles_of(self)  # given by the block recompute's attacher (lightning_mhc.recompute.groups)
        group = roles.recompute_group if mhc_recompute_manager is None else None  # a caller's manager is theirs
        manager = group.manager if group is not None else mhc_recompute_manager
        is_last = roles.last_in_recompute_group if is_last_layer_in_block is None else is_last_layer_in_block
        hidden_states = self._forward_attention(hidden_states, rotary_freqs, manager)
        hidden_states = self._forward_mlp(hidden_states, manager, is_last)
        if group is not None and is_last:
            group.finish(hidden_states)
        return hidden_states, None

    # ------------------------------------------------------------ helpers
    def _recomputing(self) -> bool:
        """Recompute only applies to training forwards that build a graph."""
        return self.training and torch.is_grad_enabled()

    def _bda(self, x_with_bias, residual: Tensor, mappings: tuple[Tensor, Tensor] | None = None) -> Tensor:
        """Bias-dropout-add; with hyper-connections ``mappings`` is ``(H_res, H_post)``: ``H_res``
        mixes the streams of ``residual`` and ``H_post`` spreads the sub-layer output over them."""
        sp, exact = self.config.sequence_parallel, self.config.exact_hidden_dropout
        if mappings is None:
            return bias_dropout_add(x_with_bias, residual, self.hidden_dropout, self.training, sp, exact)
        h_res, h_post = mappings
        return h_res_h_post_bias_dropout_add(x_with_bias, residual, h_res, h_post, self.hidden_dropout, self.training,
                                             self.config.mhc_implementation, sequence_parallel=sp, exact_dropout=exact)

    def _checkpointed(self, manager, op: str, fn, *args):
        """``fn(*args)`` as a CheckpointWithoutOutput registered with ``manager``."""
        ckpt = CheckpointWithoutOutput(ckpt_manager=manager, name=f"{self.label}.{op}")
        return ckpt, ckpt.checkpoint(fn, *args)

    def _sublayer(self, hc, norm: RMSNorm, recompute_norm: bool, norm_name: str, run, hidden_states, manager):
        """Hyper-connection, norm, sub-layer: returns ``(output_with_bias, residual, mappings)``.

        ``residual`` is the layer's stream; with hyper-connections ``mappings`` is ``(H_res,
        H_post)`` for the bias-dropout-add, else None. With a manager the hyper-connection
        (mappings, aggregate) is one checkpoint in it, together with the norm under
        ``recompute_norm``. Without a manager, ``recompute_norm`` discards the norm output by a
        checkpoint recomputed from a hook on the sub-layer output.
        """
        residual, mappings = hidden_states, None
        if hc is not None and manager is not None and recompute_norm:
            # one checkpoint for the hyper-connection and the norm (fewer, larger checkpoints:
            # each costs a nested backward and a copy back into the freed storage)
            def hyper_connection_and_norm(x):
                aggregated, h_res, h_post = hc(x)
                return norm(aggregated), h_res, h_post

            normed, h_res, h_post = manager.checkpoint(
                hyper_connection_and_norm, hidden_states, name=f"{hc.label}.pre+{norm_name}"
            )
            return run(normed), residual, (h_res, h_post)
        if hc is not None:
            if manager is not None:
                hidden_states, h_res, h_post = manager.checkpoint(hc, hidden_states, name=f"{hc.label}.pre")
            else:
                hidden_states, h_res, h_post = hc(hidden_states)
            mappings = (h_res, h_post)
        norm_ckpt = None
        if recompute_norm and self._recomputing():  # no manager here: the branch above took it
            norm_ckpt, normed = self._checkpointed(None, norm_name, norm, hidden_states)
        else:
            normed = norm(hidden_states)
        output_with_bias = run(normed)
        if norm_ckpt is not None:
            norm_ckpt.discard_output_and_register_recompute(output_with_bias[0])
        return output_with_bias, residual, mappings

    def _forward_attention(
        self, hidden_states: Tensor, rotary_freqs: Tensor | None, mhc_recompute_manager=None
    ) -> Tensor:
        attention_output_with_bias, residual, mappings = self._sublayer(
            self.self_attention_hyper_connection, self.input_layernorm,
            self.recompute_input_layernorm, "input_layernorm",
            lambda normed: self.self_attention(normed, rotary_freqs),
            hidden_states, mhc_recompute_manager,
        )
        if mhc_recompute_manager is not None:
            _, out = self._checkpointed(
                mhc_recompute_manager, "self_attn_bda", self._bda, attention_output_with_bias, residual, mappings
            )
            return out
        return self._bda(attention_output_with_bias, residual, mappings)

    def _forward_mlp(
        self, hidden_states: Tensor, mhc_recompute_manager=None, is_last_layer_in_block: bool = False
    ) -> Tensor:
        mlp_output_with_bias, residual, mappings = self._sublayer(
            self.mlp_hyper_connection, self.pre_mlp_layernorm,
            self.recompute_pre_mlp_layernorm, "pre_mlp_layernorm", self._run_mlp,
            hidden_states, mhc_recompute_manager,
        )
        return self._forward_post_mlp(
            mlp_output_with_bias, residual, mappings, mhc_recompute_manager, is_last_layer_in_block
        )

    def _run_mlp(self, normed: Tensor):
        if self.recompute_mlp and self._recomputing():
            return checkpoint(self.mlp, normed)
        return self.mlp(normed)

    def _forward_post_mlp(
        self,
        mlp_output_with_bias: tuple[Tensor, Tensor | None],
        residual: Tensor,
        mappings: tuple[Tensor, Tensor] | None = None,
        mhc_recompute_manager=None,
        is_last_layer_in_block: bool = False,
    ) -> Tensor:
        if mhc_recompute_manager is not None and not is_last_layer_in_block:
            _, out = self._checkpointed(
                mhc_recompute_manager, "mlp_bda", self._bda, mlp_output_with_bias, residual, mappings
            )
            return out
        # No manager, or the block's last layer: this output is the manager's hook tensor.
        return self._bda(mlp_output_with_bias, residual, mappings)
