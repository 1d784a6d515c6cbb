"""The row-parallel output projection that ends attention and the MLP."""
from __future__ import annotations

from megatron.core.tensor_parallel import RowParallelLinear

from lightning_mhc.model.config import MHCTransformerConfig
from lightning_mhc.model.init import ParamInit, scaled_std


def output_projection(config: MHCTransformerConfig, input_size: int, init: ParamInit, name: str) -> RowParallelLinear:
    """``input_size -> hidden_size``, input split across TP, bias returned separately for the
    bias-dropout-add, weights drawn with megatron's scaled output init."""
    return RowParallelLinear(
        input_size,
        config.hidden_size,
        config=config,
        init_method=init.normal(f"{name}.weight", scaled_std(config.init_method_std, config.num_layers)),
        bias=config.add_bias_linear,
        input_is_parallel=True,
        skip_bias_add=True,
    )
