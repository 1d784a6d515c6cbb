"""lightning_mhc: train mHC transformers with TP/PP/DP from one line of Lightning.

The rooms and what each may import: docs/rooms.md. Public names are loaded on first use
(``__getattr__`` below), so ``import lightning_mhc`` and the rooms below ``strategies`` never import
Lightning. ``strategy="mhc_parallel"`` is registered by the room that defines the strategy:
``import lightning_mhc.lightning`` (or ``from lightning_mhc import MHCParallelStrategy``, which
imports it) for the Trainer, ``import lightning_mhc.fabric`` for Fabric. ``MHCParallelStrategy``
here is the Trainer's; Fabric's is ``lightning_mhc.fabric.MHCParallelStrategy``.
"""
from __future__ import annotations

import importlib
import warnings

from lightning_mhc.distributed.launcher_watch import watch_launcher

# a rank started by our launchers ends with it: watched from here, its first import of this package
watch_launcher()

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
    "HyperConnectionModule": "lightning_mhc.layers",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    """``lightning_mhc.NAME``: imports the room that defines NAME only now, on first use."""
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'lightning_mhc' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))
