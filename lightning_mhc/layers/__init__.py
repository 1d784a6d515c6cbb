"""The model-agnostic layer under both model wings (the GPT in ``model``, any Hugging Face model in
``any_model``): the hyper-connection module and its residual add, parameter init by name, the
sequence-parallel mappings, this rank's part of a sequence under context parallelism, the MoE
layer's pairs, grouped product and combine, and the language-model loss. A wing owns only what is
its model's."""
from lightning_mhc.layers.hyper_connection import HyperConnectionConfig, HyperConnectionModule
from lightning_mhc.layers.init import ParamInit
from lightning_mhc.layers.loss import token_mean_loss
from lightning_mhc.layers.sequence import SequenceSplit

__all__ = ["HyperConnectionConfig", "HyperConnectionModule", "ParamInit", "SequenceSplit", "token_mean_loss"]
