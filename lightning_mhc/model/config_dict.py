"""MHCTransformerConfig as a plain dict and back (hyperparameters, YAML, JSON, LightningCLI).

``model_config_to_dict`` keeps only what a user chose: the fields that differ from the defaults,
without the parallel layout (the strategy's) and the fields training sets; the activation by
name. ``model_config_from_dict`` is its inverse and also takes ``activation``, dotted callables,
and dtypes and enums by name.
"""
from __future__ import annotations

import dataclasses
import enum
import functools
import importlib
import typing
import warnings
from collections.abc import Mapping
from typing import Any, Callable

import torch

from lightning_mhc.model.activations import ACTIVATIONS, activation_name
from lightning_mhc.errors import ConfigError
from lightning_mhc.model.config import (
    MEGATRON_NAMES,
    PARALLEL_LAYOUT_FIELDS,
    MHCTransformerConfig,
    _default,
    _same,
)

SET_WHEN_BUILT_FIELDS = (
    # the recompute policy (MHCRecomputeCallback / ``recompute_policy``) sets these
    "recompute_granularity", "recompute_method", "recompute_num_layers", "recompute_modules",
    "recompute_hyper_connections", "mhc_recompute_layer_num",
    # forced by __post_init__
    "use_cpu_initialization",
    # unused: every weight is drawn from init_method_std and init_seed (layers/init.py)
    "init_method", "output_layer_init_method", "embedding_init_method",
    # training-loop hooks, not part of the model
    "timers", "finalize_model_grads_func", "grad_scale_func", "no_sync_func", "grad_sync_func",
    "param_sync_func", "_cpu_offloading_context",
    # Megatron-LM's names for our mHC fields: input only, __post_init__ moves them onto ours
    *MEGATRON_NAMES,
)
"""Fields ``model_config_to_dict`` leaves out besides the layout: set by training, not by the model."""



@functools.cache
def _field_types() -> dict[str, Any]:
    return typing.get_type_hints(MHCTransformerConfig)


def _build_quietly(kwargs: dict[str, Any]) -> MHCTransformerConfig:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return MHCTransformerConfig(**kwargs)


def is_plain(value: Any) -> bool:
    """True for None, bool, int, float, str and lists / str-keyed dicts of them (YAML and JSON)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if isinstance(value, (list, tuple)):
        return all(is_plain(v) for v in value)
    if isinstance(value, Mapping):
        return all(isinstance(k, str) and is_plain(v) for k, v in value.items())
    return False


def _import_callable(path: str) -> Callable:
    module, _, name = path.rpartition(".")
    try:
        func = getattr(importlib.import_module(module), name) if module else None
    except (ImportError, AttributeError):
        func = None
    if not callable(func):
        raise ConfigError(
            f"activation_func={path!r} is not an importable function ('package.module.function'); "
            f"or give activation: one of {', '.join(ACTIVATIONS)}."
        )
    return func


def _plain(name: str, value: Any, strict: bool) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, (list, tuple)):
        return [_plain(name, v, strict) for v in value]
    if isinstance(value, Mapping):
        return {str(k): _plain(name, v, strict) for k, v in value.items()}
    if callable(value):
        path = f"{getattr(value, '__module__', None)}.{getattr(value, '__qualname__', None)}"
        try:
            if _import_callable(path) is value:
                return path
        except ConfigError:
            pass
    message = (f"model config field {name}={value!r} has no plain (YAML/JSON) form: use a value of "
               "basic type, or a function importable by its dotted name.")
    if strict:
        raise ConfigError(message)
    warnings.warn(message + " It is recorded by its repr and cannot be rebuilt from the dict.", stacklevel=3)
    return repr(value)


def model_config_to_dict(config: MHCTransformerConfig, strict: bool = True) -> dict[str, Any]:
    """The fields of ``config`` that differ from ``MHCTransformerConfig``'s defaults, as plain
    (YAML/JSON) values; ``model_config_from_dict`` builds an equal config from it.

    Left out: the parallel layout (``PARALLEL_LAYOUT_FIELDS``: the strategy sets it), the
    fields training sets (``SET_WHEN_BUILT_FIELDS``: recompute policy, hooks) and the ones
    ``__post_init__`` derives from the rest (``ffn_hidden_size = 4 * hidden_size``, ...). The
    activation is recorded by name (``activation: swiglu``, see ``lightning_mhc.model.activations``),
    or as ``activation_func: package.module.function``; dtypes by name (``bfloat16``), enums by
    member name. A value with no plain form raises ConfigError (``strict=False``: recorded by
    its repr, with a warning).
    """
    skip = set(PARALLEL_LAYOUT_FIELDS) | set(SET_WHEN_BUILT_FIELDS)
    described = [f for f in dataclasses.fields(MHCTransformerConfig) if f.init and f.name not in skip]
    chosen = {f.name: getattr(config, f.name) for f in described
              if not _same(getattr(config, f.name), _default(f))}

    def reproduces(kwargs: dict[str, Any]) -> bool:
        try:
            rebuilt = _build_quietly(kwargs)
        except Exception:
            return False
        return all(_same(getattr(rebuilt, f.name), getattr(config, f.name)) for f in described)

    for name in list(chosen):  # drop what __post_init__ derives from the others
        trial = {k: v for k, v in chosen.items() if k != name}
        if reproduces(trial):
            chosen = trial

    out: dict[str, Any] = {}
    for name, value in chosen.items():
        if name in ("activation_func", "gated_linear_unit"):
            if "activation" in out or "activation_func" in out:
                continue
            named = activation_name(config.activation_func, config.gated_linear_unit)
            if named is not None:
                out["activation"] = named
                continue
            out["activation_func"] = _plain("activation_func", config.activation_func, strict)
            if "gated_linear_unit" in chosen:
                out["gated_linear_unit"] = config.gated_linear_unit
            continue
        out[name] = _plain(name, value, strict)
    return out


def model_config_from_dict(values: Mapping[str, Any]) -> MHCTransformerConfig:
    """An ``MHCTransformerConfig`` from a dict of its fields: the inverse of
    ``model_config_to_dict``. Besides the fields themselves it takes ``activation`` (a name in
    ``lightning_mhc.model.activations.ACTIVATIONS``), ``activation_func`` as a dotted name, and dtypes
    and enums by name."""
    kwargs = dict(values)
    if "activation" in kwargs:
        name = kwargs.pop("activation")
        if name not in ACTIVATIONS:
            raise ConfigError(f"activation={name!r}: choose one of {', '.join(ACTIVATIONS)}.")
        if "activation_func" in kwargs or "gated_linear_unit" in kwargs:
            raise ConfigError(
                f"activation={name!r} together with activation_func / gated_linear_unit: give either "
                "the activation's name or the two fields."
            )
        kwargs["activation_func"], kwargs["gated_linear_unit"] = ACTIVATIONS[name]
    init_fields = {f.name for f in dataclasses.fields(MHCTransformerConfig) if f.init}
    unknown = sorted(set(kwargs) - init_fields)
    if unknown:
        raise ConfigError(
            f"model_config has unknown field(s) {unknown}: use MHCTransformerConfig's fields "
            f"(megatron-core's TransformerConfig plus the mHC and GPT fields) or 'activation' "
            f"({', '.join(ACTIVATIONS)})."
        )
    if isinstance(kwargs.get("activation_func"), str):
        kwargs["activation_func"] = _import_callable(kwargs["activation_func"])
    types = _field_types()
    for name, value in kwargs.items():
        if not isinstance(value, str):
            continue
        hint = types.get(name)
        if hint is torch.dtype or torch.dtype in typing.get_args(hint):
            dtype = getattr(torch, value.removeprefix("torch."), None)
            if not isinstance(dtype, torch.dtype):
                raise ConfigError(f"{name}={value!r} is not a torch dtype (e.g. 'float32', 'bfloat16').")
            kwargs[name] = dtype
        elif isinstance(hint, type) and issubclass(hint, enum.Enum):
            try:
                kwargs[name] = hint[value]
            except KeyError:
                raise ConfigError(f"{name}={value!r}: choose one of {', '.join(hint.__members__)}.") from None
    return MHCTransformerConfig(**kwargs)
