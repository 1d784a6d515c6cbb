"""The mHC transformer on megatron-core tensor-parallel layers (no Lightning import)."""
import warnings

# megatron-core warns at import that Transformer Engine / Apex are absent (this package uses
# neither), and on every TransformerConfig about its own default cuda_graph_scope.
warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
warnings.filterwarnings("ignore", message="full scope is deprecated")

from lightning_mhc.model.config import MHCTransformerConfig
from lightning_mhc.model.gpt import GPTModel
from lightning_mhc.model.hyper_connection import HyperConnectionModule, sinkhorn_knopp
from lightning_mhc.model.transformer_block import TransformerBlock
from lightning_mhc.model.transformer_layer import TransformerLayer

__all__ = [
    "GPTModel",
    "HyperConnectionModule",
    "MHCTransformerConfig",
    "TransformerBlock",
    "TransformerLayer",
    "sinkhorn_knopp",
]
