"""The mHC transformer on megatron-core tensor-parallel layers (no Lightning import)."""
from lightning_mhc.model.config import MHCTransformerConfig
from lightning_mhc.model.config_dict import model_config_from_dict, model_config_to_dict
from lightning_mhc.model.gpt import GPTModel
from lightning_mhc.layers.hyper_connection import HyperConnectionModule, sinkhorn_knopp
from lightning_mhc.model.transformer_block import TransformerBlock
from lightning_mhc.model.transformer_layer import TransformerLayer

__all__ = [
    "GPTModel",
    "HyperConnectionModule",
    "MHCTransformerConfig",
    "TransformerBlock",
    "TransformerLayer",
    "model_config_from_dict",
    "model_config_to_dict",
    "sinkhorn_knopp",
]
