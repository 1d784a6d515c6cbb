"""The model-agnostic layer under both model wings (the GPT in ``model``, any Hugging Face model in
``any_model``): the hyper-connection module and its residual add, parameter init by name and the
sequence-parallel mappings. A wing owns only what is its model's."""
from lightning_mhc.layers.hyper_connection import HyperConnectionConfig, HyperConnectionModule
from lightning_mhc.layers.init import ParamInit

__all__ = ["HyperConnectionConfig", "HyperConnectionModule", "ParamInit"]
