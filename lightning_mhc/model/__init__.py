"""The mHC transformer on megatron-core tensor-parallel layers (no Lightning import).

Each public name is loaded from its file on first use (as the package's face does), so a module of
this room that needs no megatron-core (the shape the planner reads, ``model.shape``) imports none."""
from __future__ import annotations

import importlib

_PUBLIC = {
    "GPTModel": "lightning_mhc.model.gpt",
    "HyperConnectionModule": "lightning_mhc.layers.hyper_connection",
    "MHCTransformerConfig": "lightning_mhc.model.config",
    "TransformerBlock": "lightning_mhc.model.transformer_block",
    "TransformerLayer": "lightning_mhc.model.transformer_layer",
    "model_config_from_dict": "lightning_mhc.model.config_dict",
    "model_config_to_dict": "lightning_mhc.model.config_dict",
    "sinkhorn_knopp": "lightning_mhc.layers.hyper_connection",
}


def __getattr__(name: str):
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'lightning_mhc.model' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))


__all__ = sorted(_PUBLIC)
