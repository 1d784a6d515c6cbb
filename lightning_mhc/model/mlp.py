"""The feed-forward sub-layer: column-parallel ``linear_fc1``, activation, row-parallel ``linear_fc2``.

With ``gated_linear_unit`` (SwiGLU when ``activation_func`` is SiLU),
``linear_fc1`` produces ``[gate; up]`` with stride 2, so each TP rank holds
matching slices of both halves.
"""
from __future__ import annotations

import torch
from torch import Tensor

from lightning_mhc.model.config import MHCTransformerConfig
from lightning_mhc.layers.init import ParamInit
from lightning_mhc.model.parallel_linear import SPColumnParallelLinear, output_projection


class MLP(torch.nn.Module):
    def __init__(self, config: MHCTransformerConfig, init: ParamInit) -> None:
        super().__init__()
        self.config = config
        gated = config.gated_linear_unit
        self.linear_fc1 = SPColumnParallelLinear(
            config.hidden_size,
            config.ffn_hidden_size * (2 if gated else 1),
            config=config,
            init_method=init.normal("linear_fc1.weight", config.init_method_std),
            bias=config.add_bias_linear,
            gather_output=False,
            stride=2 if gated else 1,
        )
        self.linear_fc2 = output_projection(config, config.ffn_hidden_size, init, "linear_fc2")

    def forward(self, hidden_states: Tensor) -> tuple[Tensor, Tensor | None]:
        intermediate, _ = self.linear_fc1(hidden_states)
        act = self.config.activation_func
        if self.config.gated_linear_unit:
            gate, up = intermediate.chunk(2, dim=-1)
            intermediate = act(gate) * up
        else:
            intermediate = act(intermediate)
        return self.linear_fc2(intermediate)
