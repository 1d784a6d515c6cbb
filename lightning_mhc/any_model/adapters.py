"""PEFT's LoRA adapters on a model split by :func:`parallelize`, placed like the layer they adapt.

Both of Hugging Face's orders work:

    peft_model = get_peft_model(recorded_model, LoraConfig(...))      # on the meta device
    self.model = self.parallelize(peft_model, plan="llama")            # the adapters split here

    self.model = self.parallelize(recorded_model, plan="llama")
    get_peft_model(self.model, LoraConfig(...))                        # injected in place; the
                                                                       # strategy places them at fit start

A LoRA layer computes ``base(x) + B(A(x)) * scaling``. Where the plan splits ``base``:

| base | ``lora_A`` | ``lora_B`` |
|---|---|---|
| column (output features split) | whole on every TP rank; takes the base's input mapping (the copy into the TP region, or the sequence's all-gather); its gradient is a partial sum over TP (``partial_over_tp``) | split with the base's output features (its stride too); takes the base's output mapping (a gathered output) |
| row (input features split) | split on its input features; its output summed over TP as the base's partial products are (all-reduce, or reduce-scatter of the sequence under SP) | whole on every TP rank; under SP it runs on this rank's part of the sequence, so its gradient is summed over TP (``sequence_parallel``) |

An adapter of a module the plan keeps whole is whole too, with its base's marks (a block's
parameters under SP are ``sequence_parallel``). Every adapter tensor is drawn whole from the
seed of ``parallelize`` and its whole-model name (PEFT's default: ``lora_A`` Kaiming-uniform as
``nn.Linear``, ``lora_B`` zero), then cut to this rank's slice: every layout, and the model
materialised whole in one process (``build_recorded_module``), starts from the same adapters.
"""
from __future__ import annotations

import math
from typing import Any, Iterator

import torch
from torch import nn

from lightning_mhc.distributed.layout import ParallelLayout
from lightning_mhc.distributed.placement import ParameterPlacement, place, placement_of
from lightning_mhc.errors import ConfigError
from lightning_mhc.any_model.plan import Column, Row, base_of, is_lora_layer
from lightning_mhc.any_model.record import seeded
from lightning_mhc.any_model.placement import Placement, shard
from lightning_mhc.roles import assign_roles, roles_of
from lightning_mhc.wrapping import wrap

def is_modules_to_save(module: nn.Module) -> bool:
    """PEFT's ``ModulesToSaveWrapper``: a trained copy of a module beside the frozen original."""
    modules = module.__dict__.get("_modules", {})
    return isinstance(modules.get("original_module"), nn.Module) and isinstance(modules.get("modules_to_save"),
                                                                                 nn.ModuleDict)


def unwrap_peft_model(model: nn.Module) -> nn.Module:
    """The model a ``PeftModel`` wraps (its adapters injected in place), or ``model`` itself:
    what ``parallelize`` splits, with the model's own module names."""
    if getattr(model, "peft_config", None) is not None and callable(getattr(model, "get_base_model", None)):
        return model.get_base_model()
    return model


def lora_layers(module: nn.Module, prefix: str = "") -> Iterator[tuple[str, nn.Module]]:
    for name, sub in module.named_modules(prefix=prefix):
        if is_lora_layer(sub):
            yield name, sub


def _config(root: nn.Module, adapter: str) -> Any:
    configs = getattr(root, "peft_config", None) or {}
    return configs.get(adapter)


def _refuse_unsupported(name: str, layer: nn.Module, adapter: str, config: Any, split: bool) -> None:
    """What the placement does not cover, refused with the setting to change."""
    init = getattr(config, "init_lora_weights", True)
    if init is not True and init != "gaussian":
        raise ConfigError(f"{name}: LoraConfig(init_lora_weights={init!r}) on a model split by parallelize: its "
                          "adapters are drawn from the seed by name, as PEFT's default (True) or 'gaussian' draws "
                          "them; use one of those.")
    if adapter in getattr(layer, "lora_embedding_A", {}) or adapter in getattr(layer, "lora_magnitude_vector", {}) \
            or adapter in getattr(layer, "lora_variant", {}):
        raise ConfigError(f"{name}: only LoRA on linear layers (no DoRA, no embedding adapters) is placed on a model "
                          "split by parallelize; leave this module out of target_modules.")
    dropout = layer.lora_dropout[adapter]
    if split and isinstance(dropout, nn.Dropout) and dropout.p > 0:
        raise ConfigError(f"{name}: LoraConfig(lora_dropout={dropout.p}) on a layer split over TP: the adapter's "
                          "dropout would need the mask of the activation it drops (whole or split); use "
                          "lora_dropout=0.0.")


def _draw(shape: tuple[int, ...], name: str, seed: int, init: Any, rank: int) -> torch.Tensor:
    """PEFT's default draw of ``lora_A`` (``reset_lora_parameters``), from ``(seed, name)``."""
    with seeded(seed, name + "#lora"):
        tensor = torch.empty(shape)
        if init == "gaussian":
            nn.init.normal_(tensor, std=1 / rank)
        else:
            nn.init.kaiming_uniform_(tensor, a=math.sqrt(5))
    return tensor


def _whole_adapters(layer: nn.Module, adapter: str, name: str, seed: int, config: Any,
                    whole_in: int, whole_out: int) -> dict[str, torch.Tensor]:
    """The adapter's whole tensors, by their names in ``layer`` (``lora_A.<adapter>.weight``...)."""
    rank = layer.r[adapter]
    init = getattr(config, "init_lora_weights", True)
    a_name = f"lora_A.{adapter}.weight"
    tensors = {a_name: _draw((rank, whole_in), f"{name}.{a_name}", seed, init, rank),
               f"lora_B.{adapter}.weight": torch.zeros(whole_out, rank)}
    if layer.lora_B[adapter].bias is not None:
        tensors[f"lora_B.{adapter}.bias"] = torch.zeros(whole_out)
    return tensors


def fill_adapters(module: nn.Module, name: str, seed: int, root: nn.Module) -> None:
    """Give the adapters of ``module``'s LoRA layers (on the meta device: PEFT injected them into a
    recorded model) their whole tensors, drawn by name, before the rest is materialised; the model's
    own init function leaves them (their role ``initialises_itself``)."""
    for layer_name, layer in lora_layers(module, name):
        for adapter in layer.lora_A:
            a, b = layer.lora_A[adapter], layer.lora_B[adapter]
            if a.weight.device.type != "meta":
                continue
            config = _config(root, adapter)
            _refuse_unsupported(layer_name, layer, adapter, config, split=False)
            whole = _whole_adapters(layer, adapter, layer_name, seed, config, a.weight.shape[1], b.weight.shape[0])
            for key, tensor in whole.items():
                _set(layer, key, tensor.to(layer.lora_A[adapter].weight.dtype))
            assign_roles(a, initialises_itself=True)
            assign_roles(b, initialises_itself=True)


def _set(layer: nn.Module, key: str, tensor: torch.Tensor, placement: ParameterPlacement | None = None
         ) -> nn.Parameter:
    path, _, attr = key.rpartition(".")
    owner = layer.get_submodule(path)
    old = owner._parameters[attr]
    param = nn.Parameter(tensor.contiguous(), requires_grad=old.requires_grad)
    if placement is not None:
        place(param, placement)
    owner._parameters[attr] = param
    return param


def place_lora(layer_name: str, layer: nn.Module, layout: ParallelLayout, config_root: nn.Module) -> None:
    """Cut ``layer``'s whole adapters as its base was cut (see the module docstring), hook them to
    the base's mappings and mark their gradients' reduction. Once per layer."""
    if roles_of(layer).adapters_placed:
        return
    base = base_of(layer)
    placement: Placement | None = roles_of(base).tensor_parallel_placement
    tp, tp_rank = layout.tensor_model_parallel_size, layout.tensor_model_parallel_rank
    for adapter in layer.lora_A:
        _refuse_unsupported(layer_name, layer, adapter, _config(config_root, adapter),
                            split=placement is not None and tp > 1)
        a, b = layer.lora_A[adapter], layer.lora_B[adapter]
        if placement is None:  # whole, as its base: the same reduction as the base's weight
            of_base = placement_of(base.weight)
            for p in (*a.parameters(), *b.parameters()):
                place(p, placed=True, split_dim=None, partial_over_tp=of_base.partial_over_tp,
                      sequence_parallel=of_base.sequence_parallel)
            continue
        if isinstance(placement.style, Column):
            stride = placement.style.stride
            for key in ("weight", "bias"):
                if getattr(b, key, None) is not None:
                    _set(b, key, shard(getattr(b, key).detach(), 0, stride, tp, tp_rank),
                         ParameterPlacement(placed=True, split_dim=0, stride=stride))
            _set(a, "weight", a.weight.detach(), ParameterPlacement(placed=True, partial_over_tp=True))
            if placement.input_map is not None:
                wrap(a, "adapter_input", lambda _m, args, f=placement.input_map: (f(args[0]), *args[1:]))
            if placement.output_map is not None:
                wrap(b, "adapter_output", lambda _m, _a, out, f=placement.output_map: f(out))
        elif isinstance(placement.style, Row):
            _set(a, "weight", shard(a.weight.detach(), 1, 1, tp, tp_rank),
                 ParameterPlacement(placed=True, split_dim=1, stride=1))
            for p in b.parameters():
                place(p, placed=True, split_dim=None)
                if placement.sequence_parallel:  # B runs on this rank's part of the sequence
                    place(p, sequence_parallel=True)
            if placement.reduce is not None:
                wrap(a, "adapter_partial_summed", lambda _m, _a, out, f=placement.reduce: f(out))
    assign_roles(layer, adapters_placed=True)


def place_injected_adapters(model: nn.Module, layout: ParallelLayout, seed: int, global_name) -> list[str]:
    """PEFT's adapters injected into ``model`` (a :class:`ParallelModel`) after it was split:
    each LoRA layer's adapters drawn again whole from ``seed`` by their whole-model names
    (``global_name``) and placed (:func:`place_lora`); each ``modules_to_save`` copy given its
    original's placement (its ``deepcopy`` drops a parameter's placement). Returns the
    names of the layers placed."""
    placed = []
    tp = layout.tensor_model_parallel_size
    for layer_name, layer in lora_layers(model):
        if roles_of(layer).adapters_placed:
            continue
        base = base_of(layer)
        placement = roles_of(base).tensor_parallel_placement
        whole_name = global_name(layer_name + ".base_layer.weight").removesuffix(".base_layer.weight")
        for adapter in layer.lora_A:
            a, b = layer.lora_A[adapter], layer.lora_B[adapter]
            whole_in, whole_out = a.weight.shape[1], b.weight.shape[0]
            if placement is not None and isinstance(placement.style, Row):
                whole_in *= tp
            elif placement is not None and isinstance(placement.style, Column):
                whole_out *= tp
            # (what the placement does not cover is refused by place_lora, below, before anything is split)
            whole = _whole_adapters(layer, adapter, whole_name, seed, _config(model, adapter), whole_in, whole_out)
            for key, tensor in whole.items():
                _set(layer, key, tensor.to(device=a.weight.device, dtype=a.weight.dtype))
        place_lora(layer_name, layer, layout, model)
        placed.append(layer_name)
    for _, wrapper in ((n, m) for n, m in model.named_modules() if is_modules_to_save(m)):
        originals = dict(wrapper.original_module.named_parameters())
        for copy_ in wrapper.modules_to_save.values():
            for name, p in copy_.named_parameters():
                if name in originals and placement_of(p) == ParameterPlacement():
                    place(p, placement_of(originals[name]))
    return placed
