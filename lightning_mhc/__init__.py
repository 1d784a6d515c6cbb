"""lightning_mhc: train mHC transformers with TP/PP/DP from one line of Lightning.

Rooms by concept (the README's "Layout" is the map); each imports only the rooms before it here:
``ops`` <- ``recompute`` <- ``distributed`` <- ``model`` <- ``checkpoint`` <- ``any_model`` <- ``data``
<- ``strategies`` <- ``fabric``, ``lightning`` <- ``cli`` (``testing``: helpers for tests and benchmarks).
Public names are loaded on first use, so importing one room never imports the rooms above it,
with one deliberate exception: once Lightning itself is imported, the registration hook imports
``fabric`` and ``lightning`` to register ``"mhc_parallel"``. ``MHCParallelStrategy`` here is the
Trainer's; Fabric's is ``lightning_mhc.fabric.MHCParallelStrategy``.
"""
from __future__ import annotations

import importlib
import warnings

# megatron-core warns at import that Transformer Engine / Apex are absent (this package uses
# neither), and on every TransformerConfig about its own default cuda_graph_scope.
warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
warnings.filterwarnings("ignore", message="full scope is deprecated")

__version__ = "0.1.0"

_PUBLIC = {
    "MHCParallelStrategy": "lightning_mhc.lightning",
    "MHCRecomputeCallback": "lightning_mhc.lightning",
    "MHCGPTModule": "lightning_mhc.lightning",
    "ParallelLMModule": "lightning_mhc.lightning",
    "parallelize": "lightning_mhc.any_model",
    "add_hyper_connections": "lightning_mhc.any_model",
    "load_pretrained": "lightning_mhc.any_model",
    "save_hyper_connections": "lightning_mhc.any_model",
    "hyper_connection_modules": "lightning_mhc.any_model",
    "record_module_init": "lightning_mhc.any_model",
    "build_recorded_module": "lightning_mhc.any_model",
    "MHCTransformerConfig": "lightning_mhc.model",
    "ActivationMemoryMeter": "lightning_mhc.recompute",
    "CheckpointWithoutOutput": "lightning_mhc.recompute",
    "MHCBlockRecomputeManager": "lightning_mhc.recompute",
    "RecomputePolicy": "lightning_mhc.recompute",
    "attach_recompute": "lightning_mhc.recompute",
    "ParallelLayout": "lightning_mhc.distributed.layout",
    "ParallelSettings": "lightning_mhc.strategies",
    "ConfigError": "lightning_mhc.errors",
    "GPTModel": "lightning_mhc.model",
    "HyperConnectionModule": "lightning_mhc.model",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'lightning_mhc' has no attribute {name!r}")


# ``strategy="mhc_parallel"`` works once Lightning is imported too, in either order, without
# this import pulling Lightning in (see lightning_mhc/_registration.py).
from lightning_mhc._registration import register_with_lightning as _register_with_lightning  # noqa: E402

_register_with_lightning()
