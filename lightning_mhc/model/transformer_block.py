"""The decoder layers one pipeline stage holds, with stream expansion on the
first stage and stream contraction plus the final norm on the last (as in Megatron-LM's mHC)."""
from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from lightning_mhc.distributed.layout import ParallelLayout
from lightning_mhc.model.config import MHCTransformerConfig
from lightning_mhc.layers.hyper_connection import HyperConnectionModule
from lightning_mhc.layers.init import ParamInit
from lightning_mhc.model.norm import RMSNorm
from lightning_mhc.model.transformer_layer import TransformerLayer
from lightning_mhc.recompute.groups import block_ranges
from lightning_mhc.recompute.without_output import checkpoint


class TransformerBlock(torch.nn.Module):
    """``layer_numbers`` are the global, 1-based numbers of the layers built here, on ``layout``
    (the EP group of MoE layers; None: the one-process layout)."""

    def __init__(
        self,
        config: MHCTransformerConfig,
        layer_numbers: Sequence[int],
        init: ParamInit,
        pre_process: bool = True,
        post_process: bool = True,
        layout: ParallelLayout | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.pre_process = pre_process
        self.post_process = post_process
        self.num_residual_streams = config.num_residual_streams
        self.layers = torch.nn.ModuleList(
            TransformerLayer(config, number, init.child(f"layers.{number - 1}"), layout)
            for number in layer_numbers
        )
        self.final_layernorm = (
            RMSNorm(config.hidden_size, config.layernorm_epsilon) if post_process else None
        )

        # Set by lightning_mhc.recompute.attach_recompute when it hooks managers onto the layers.
        self.mhc_recompute_attached = False

    def recompute_block_ranges(self) -> list[tuple[int, int]]:
        """Local ``[start, end)`` layer ranges of the mHC recompute blocks: ``L_r`` layers
        each (``mhc_recompute_layer_num``; None: the paper's default for this stage's layers),
        never crossing the stage."""
        return block_ranges(len(self.layers), self.config.num_residual_streams, self.config.mhc_recompute_layer_num)

    def _full_recompute_layers(self) -> set[int]:
        """Layers run under torch.utils.checkpoint with recompute_granularity='full'."""
        cfg = self.config
        if cfg.recompute_granularity != "full":
            return set()
        if cfg.recompute_method == "block":
            return set(range(min(cfg.recompute_num_layers, len(self.layers))))
        return set(range(len(self.layers)))

    def forward(self, hidden_states: Tensor, rotary_freqs: Tensor | None = None) -> Tensor:
        hc = self.config.enable_hyper_connections
        training = self.training and torch.is_grad_enabled()
        if training and self.config.recompute_hyper_connections and not self.mhc_recompute_attached:
            raise RuntimeError(
                "recompute_hyper_connections=True but no recompute manager is attached to the "
                "decoder layers. Call lightning_mhc.recompute.attach_recompute(model) after "
                "building the model (MHCRecomputeCallback does this for Lightning)."
            )
        if hc and self.pre_process:
            hidden_states = HyperConnectionModule.input_expand(hidden_states, self.num_residual_streams)
        full = self._full_recompute_layers() if training else set()
        chunk = self.config.recompute_num_layers or 1
        i = 0
        while i < len(self.layers):
            if i in full:
                group = self.layers[i:i + (chunk if self.config.recompute_method == "uniform" else 1)]
                hidden_states = checkpoint(_run_layers, group, hidden_states, rotary_freqs)
                i += len(group)
            else:
                hidden_states, _ = self.layers[i](hidden_states, rotary_freqs)
                i += 1
        if self.post_process:
            if hc:
                hidden_states = HyperConnectionModule.output_contract(
                    hidden_states, self.num_residual_streams
                )
            hidden_states = self.final_layernorm(hidden_states)
        return hidden_states


def _run_layers(layers, hidden_states: Tensor, rotary_freqs: Tensor | None) -> Tensor:
    for layer in layers:
        hidden_states, _ = layer(hidden_states, rotary_freqs)
    return hidden_states
