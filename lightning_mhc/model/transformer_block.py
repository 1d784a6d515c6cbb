"""The decoder layers one pipeline stage holds, with stream expansion on the
first stage and stream contraction plus the final norm on the last (seed 000)."""
from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from lightning_mhc.model.config import MHCTransformerConfig
from lightning_mhc.model.hyper_connection import HyperConnectionModule
from lightning_mhc.model.init import ParamInit
from lightning_mhc.model.norm import RMSNorm
from lightning_mhc.model.transformer_layer import TransformerLayer


class TransformerBlock(torch.nn.Module):
    """``layer_numbers`` are the global, 1-based numbers of the layers built here."""

    def __init__(
        self,
        config: MHCTransformerConfig,
        layer_numbers: Sequence[int],
        init: ParamInit,
        pre_process: bool = True,
        post_process: bool = True,
    ) -> None:
        super().__init__()
        self.config = config
        self.pre_process = pre_process
        self.post_process = post_process
        self.num_residual_streams = config.num_residual_streams
        self.layers = torch.nn.ModuleList(
            TransformerLayer(config, number, init.child(f"layers.{number - 1}"))
            for number in layer_numbers
        )
        self.final_layernorm = (
            RMSNorm(config.hidden_size, config.layernorm_epsilon) if post_process else None
        )

    def forward(self, hidden_states: Tensor, rotary_freqs: Tensor | None = None) -> Tensor:
        hc = self.config.enable_hyper_connections
        if hc and self.pre_process:
            hidden_states = HyperConnectionModule.input_expand(hidden_states, self.num_residual_streams)
        for layer in self.layers:
            hidden_states, _ = layer(hidden_states, rotary_freqs)
        if self.post_process:
            if hc:
                hidden_states = HyperConnectionModule.output_contract(
                    hidden_states, self.num_residual_streams
                )
            hidden_states = self.final_layernorm(hidden_states)
        return hidden_states
