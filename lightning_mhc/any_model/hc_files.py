"""A hyper-connected model's own files beside its base model: ``hyper_connections.safetensors``
(its hyper-connection tensors) and ``hyper_connections.json`` (its settings and plan), written by
its ``save_pretrained`` or by :func:`save_hyper_connections`; ``export.load_pretrained`` reads both
back."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn

from lightning_mhc.any_model.hc_plan import drawn_from_seed


HYPER_CONNECTION_WEIGHTS = "hyper_connections.safetensors"
HYPER_CONNECTION_SETTINGS = "hyper_connections.json"


def save_hyper_connections(model: nn.Module, out: str | Path,
                           state_dict: Mapping[str, torch.Tensor] | None = None) -> None:
    """``model``'s hyper-connection tensors (from ``state_dict`` where it holds them, else the
    model's) as ``hyper_connections.safetensors`` and its settings and plan as
    ``hyper_connections.json`` in ``out``, beside its base model; nothing for a model without
    hyper-connections. A Hugging Face model's own ``save_pretrained`` calls it (see
    :class:`SavePretrainedWithHyperConnections`); call it yourself after saving the base model
    another way."""
    import dataclasses
    import json

    from safetensors.torch import save_file

    settings = getattr(model, "hyper_connection_settings", None)
    if settings is None:
        return
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    given = state_dict is not None and any(drawn_from_seed(name) for name in state_dict)
    source = state_dict if given else model.state_dict()
    tensors = {name: t.detach().contiguous() for name, t in source.items() if drawn_from_seed(name)}
    save_file(tensors, str(out / HYPER_CONNECTION_WEIGHTS), metadata={"format": "pt"})
    plan = model.hyper_connection_plan
    (out / HYPER_CONNECTION_SETTINGS).write_text(json.dumps(dict(
        settings=dataclasses.asdict(settings),
        plan=dict(branches=[dataclasses.asdict(b) for b in plan.branches], blocks=plan.blocks)), indent=2))


class SavePretrainedWithHyperConnections:
    """A hyper-connected Hugging Face model's ``save_pretrained`` (set on the model by
    ``add_hyper_connections``): the class's own ``save_pretrained``, with every argument passed
    on, writes the base model without the hyper-connection tensors (so ``from_pretrained`` of
    the class reads it as a plain model, with no unexpected tensors), then
    :func:`save_hyper_connections` writes them beside it (on the main process), so that
    :func:`load_pretrained` rebuilds the mHC model. An object rather than a closure: a copy or a
    pickle of the model gets one that saves the copy."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def __call__(self, save_directory: str | Path, *args: Any, **kwargs: Any):
        import inspect

        model = self.model
        save = type(model).save_pretrained
        bound = inspect.signature(save).bind(model, save_directory, *args, **kwargs)
        state_dict = bound.arguments.get("state_dict")
        full = state_dict if state_dict is not None else model.state_dict()
        bound.arguments["state_dict"] = {name: t for name, t in full.items() if not drawn_from_seed(name)}
        result = save(*bound.args, **bound.kwargs)
        if bound.arguments.get("is_main_process", True):
            save_hyper_connections(model, save_directory, full)
        return result
