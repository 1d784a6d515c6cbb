"""A checkpoint of a model split by :func:`parallelize`, read back into the model as written.

A parallel run's checkpoint names every tensor as the whole model does (``ParallelLMModule``'s
``global_parameter_name``: ``model.<the model's own name>``), stores a tied tensor once under its
owner's name, and stores a tensor split with a stride (GPT-2's fused ``c_attn``: ``[q; k; v]``)
with its split dimension viewed as ``[stride, size / stride]`` so that every TP size stores the
same global tensor (``checkpoint/sharding.py``). Reading it whole in one process therefore needs
no process group; what is left is to put each stored tensor back under every name and in the
shape the model uses:

    model = GPT2LMHeadModel(config)                      # the plain model, one process
    load_checkpoint(model, "run/checkpoints/step=100.ckpt")
    model.save_pretrained("export/")                     # Hugging Face's own safetensors
    # or, in one call: export_pretrained("run/checkpoints/step=100.ckpt", model, "export/")

A model with hyper-connections (``add_hyper_connections``) is written as its base model (what
``from_pretrained`` of its class reads) plus ``hyper_connections.safetensors`` and
``hyper_connections.json`` (the settings and the plan) beside it, by its own ``save_pretrained``
(``hc_files.SavePretrainedWithHyperConnections``) or, after saving the base model another way, by
``hc_files.save_hyper_connections``; :func:`load_pretrained` reads both back into the mHC model.

Resharding onto another layout needs nothing from here: ``Trainer.fit(ckpt_path=...)`` with
another ``MHCParallelStrategy`` reads the same global names (``checkpoint/format.py``).
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_mhc.checkpoint.format import MODEL, read_tensors
from lightning_mhc.errors import ConfigError
from lightning_mhc.any_model.hc_files import HYPER_CONNECTION_SETTINGS, HYPER_CONNECTION_WEIGHTS
from lightning_mhc.any_model.hc_plan import Branch, HyperConnectionPlan, drawn_from_seed
from lightning_mhc.any_model.hyper_connections import HyperConnectionSettings, add_hyper_connections

MODULE_PREFIX = "model."
"""Where ``ParallelLMModule`` keeps the model: its checkpoints name tensors ``model.<name>``."""


def _holders(model: nn.Module) -> dict[str, list[str]]:
    """``{state-dict name: every state-dict name of the same tensor}`` (tied weights)."""
    by_tensor: dict[int, list[str]] = {}
    names = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if isinstance(tensor, torch.Tensor):
            by_tensor.setdefault(id(tensor), []).append(name)
            names[name] = id(tensor)
    return {name: by_tensor[key] for name, key in names.items()}


def consolidated_state_dict(path: str | Path, model: nn.Module, prefix: str = MODULE_PREFIX) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors as ``model.state_dict()`` names and shapes them (every holder of
    a tied tensor included), read whole in this process from a checkpoint of any layout.
    ``prefix`` is where the checkpointed LightningModule kept the model."""
    path = Path(path)
    saved = read_tensors(path, prefix=f"{MODEL}.{prefix}")
    if not saved:
        raise ConfigError(f"checkpoint {path} holds no tensor under {prefix!r}: was it saved from a ParallelLMModule "
                          "(whose model is self.model)? Pass prefix= to name where the model was kept.")
    state: dict[str, torch.Tensor] = {}
    missing = []
    holders_of = _holders(model)
    current = model.state_dict(keep_vars=True)
    for name, holders in holders_of.items():
        key = next((h for h in [name, *holders] if h in saved), None)
        if key is None:
            missing.append(name)
            continue
        target = current[name]
        tensor = saved[key]
        if tensor.numel() != target.numel():
            raise ConfigError(f"checkpoint {path}: {prefix}{key} has shape {tuple(tensor.shape)}, the model's {name} "
                              f"{tuple(target.shape)}: build the model with the configuration the run trained.")
        state[name] = tensor.reshape(target.shape).to(target.dtype)  # a strided split's [.., s, n/s, ..] view
    if missing:
        raise ConfigError(f"checkpoint {path} lacks {len(missing)} tensor(s) of {type(model).__name__}, e.g. "
                          f"{prefix}{missing[0]}: build the model with the configuration the run trained.")
    unused = sorted(set(saved) - set(holders_of))
    if unused:
        raise ConfigError(f"checkpoint {path} holds {len(unused)} tensor(s) {type(model).__name__} does not have, e.g. "
                          f"{prefix}{unused[0]}: build the model with the configuration the run trained.")
    return state


def load_checkpoint(model: nn.Module, path: str | Path, prefix: str = MODULE_PREFIX) -> nn.Module:
    """Fill ``model``, the plain model as written (built normally, in one process), from a
    checkpoint of a parallel run on any layout: ``model.load_state_dict`` of
    :func:`consolidated_state_dict` (strict). Returns ``model``."""
    model.load_state_dict(consolidated_state_dict(path, model, prefix), strict=True)
    return model


def export_pretrained(path: str | Path, model: nn.Module, out: str | Path,
                      prefix: str = MODULE_PREFIX) -> dict[str, Any]:
    """Load a parallel run's checkpoint into ``model`` and write it to ``out``: a Hugging Face
    model with its own ``save_pretrained`` (``model.safetensors`` + ``config.json``, read by
    ``from_pretrained``), any other model as ``model.safetensors`` (``safetensors.torch.load_model``
    reads it). Returns what was written."""
    start = time.perf_counter()
    out = Path(out)
    load_checkpoint(model, path, prefix)
    out.mkdir(parents=True, exist_ok=True)
    if callable(getattr(model, "save_pretrained", None)):
        # the base model as transformers reads it, the hyper-connections beside it (a model with
        # hyper-connections saves both itself: SavePretrainedWithHyperConnections)
        model.save_pretrained(out)
    else:
        from safetensors.torch import save_model

        save_model(model, str(out / "model.safetensors"), metadata={"format": "pt"})
    files = sorted(p.name for p in out.iterdir())
    return dict(out=str(out), files=files, bytes=sum((out / f).stat().st_size for f in files),
                tensors=len(model.state_dict()), seconds=time.perf_counter() - start)


def load_pretrained(directory: str | Path, **from_pretrained_kwargs: Any) -> nn.Module:
    """The model of an exported directory in this process: ``AutoModelForCausalLM.from_pretrained``
    (``from_pretrained_kwargs`` passed on), and, where ``hyper_connections.json`` is beside it, its
    hyper-connections added with the saved settings and plan and filled from
    ``hyper_connections.safetensors`` (every tensor, checked)."""
    import json

    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    directory = Path(directory)
    model = AutoModelForCausalLM.from_pretrained(directory, **from_pretrained_kwargs)
    settings_file = directory / HYPER_CONNECTION_SETTINGS
    if not settings_file.is_file():
        return model
    saved = json.loads(settings_file.read_text())
    plan = HyperConnectionPlan(tuple(Branch(**b) for b in saved["plan"]["branches"]), saved["plan"].get("blocks"))
    add_hyper_connections(model, HyperConnectionSettings(**saved["settings"]), plan)
    tensors = load_file(str(directory / HYPER_CONNECTION_WEIGHTS))
    expected = {name for name in model.state_dict() if drawn_from_seed(name)}
    if set(tensors) != expected:
        missing, unexpected = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
        raise ConfigError(f"{directory / HYPER_CONNECTION_WEIGHTS} does not fit the model's hyper-connections "
                          f"(missing {missing[:3]}, unexpected {unexpected[:3]}): was it written with this directory?")
    model.load_state_dict(tensors, strict=False)
    return model
