"""The whole GPT in one process, exported and loaded back without the strategy.

    <out>/model.safetensors   every tensor of the whole GPTModel (its state-dict names)
    <out>/config.json         the model configuration (``model_config_to_dict``: the fields
                              that differ from MHCTransformerConfig's defaults)

``lightning-mhc-export <checkpoint dir> <out dir>`` writes one from a checkpoint of any layout
(``MHCGPTModule.load_from_checkpoint`` builds the whole model); ``load_exported(out)`` reads it.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Mapping

import torch

from lightning_mhc.distributed.layout import ParallelLayout, single_process_layout
from lightning_mhc.model.config import PARALLEL_LAYOUT_FIELDS, MHCTransformerConfig, with_parallel_layout
from lightning_mhc.model.config_dict import model_config_from_dict, model_config_to_dict
from lightning_mhc.model.gpt import GPTModel

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"


def whole_model_config(values: Mapping[str, Any] | MHCTransformerConfig) -> MHCTransformerConfig:
    """The configuration of the whole model in one process (TP = PP = 1, no recompute), from a
    recorded ``model_config`` (its parallel layout is dropped)."""
    if isinstance(values, Mapping):
        values = model_config_from_dict({k: v for k, v in values.items() if k not in PARALLEL_LAYOUT_FIELDS})
    return with_parallel_layout(values, ParallelLayout())


def save_exported(model: GPTModel, out: Path) -> dict[str, Any]:
    """Write ``out/model.safetensors`` and ``out/config.json`` from a whole GPTModel; returns what was
    written (files, tensors, bytes, seconds)."""
    from safetensors.torch import save_file

    start, out = time.perf_counter(), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.detach().contiguous() for name, t in model.state_dict().items() if isinstance(t, torch.Tensor)}
    save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": "lightning_mhc.gpt/1"})
    (out / CONFIG_FILE).write_text(json.dumps(model_config_to_dict(model.config, strict=False), indent=2) + "\n")
    return dict(weights=str(out / WEIGHTS_FILE), config=str(out / CONFIG_FILE), tensors=len(tensors),
                bytes=(out / WEIGHTS_FILE).stat().st_size, seconds=time.perf_counter() - start)


def load_exported(out: Path) -> GPTModel:
    """A GPTModel from an export directory, without the strategy (TP = PP = 1, eval mode)."""
    from safetensors.torch import load_file

    out = Path(out)
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        if not (out / name).is_file():
            raise FileNotFoundError(f"{out} is not a lightning-mhc-export directory: {name} is missing.")
    model = GPTModel(whole_model_config(json.loads((out / CONFIG_FILE).read_text())), layout=single_process_layout())
    model.load_state_dict(load_file(str(out / WEIGHTS_FILE)), strict=True)
    return model.eval()
