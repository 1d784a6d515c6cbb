"""Pretrained weights read shard by shard: ``parallelize(model, plan, weights=DIR_OR_FILES)``.

Each rank opens the safetensors files (a Hugging Face directory with ``model.safetensors`` or
``model.safetensors.index.json`` and its shards, or a list of files) and reads only the tensors
of its stage and, of a tensor split over TP, only its slice (``safe_open(...).get_slice``), a few
MiB at a time. The build allocates the tensors the files fill without drawing them (a split
tensor's whole pages are never touched), so a rank holds its part of the model and little more.

Before anything is read, every rank checks the whole files' names, shapes and dtypes against the
whole (meta) model, so all ranks refuse the same problem with the same message, naming the
tensor: a missing tensor, an unexpected one, a shape or a dtype other than the model's. Hugging
Face's conventions are followed: a head tied to the embedding is absent from the files, and a
file may name tensors with or without the model's ``base_model_prefix`` (``model.``,
``transformer.``).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import torch
from torch import nn

from lightning_mhc.checkpoint.sharding import tp_placement
from lightning_mhc.distributed.layout import ParallelLayout
from lightning_mhc.errors import ConfigError
from lightning_mhc.any_model.hc_plan import drawn_from_seed
from lightning_mhc.any_model.tensor_parallel import strided_runs

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def weight_files(weights: str | Path | Iterable[str | Path]) -> dict[str, Path]:
    """``{tensor name: the file that holds it}`` of a directory (indexed or single-file) or of files."""
    if isinstance(weights, (str, Path)) and Path(weights).is_dir():
        directory = Path(weights)
        if (directory / INDEX).is_file():
            weight_map = json.loads((directory / INDEX).read_text())["weight_map"]
            return {name: directory / file for name, file in weight_map.items()}
        files = [directory / SINGLE] if (directory / SINGLE).is_file() else sorted(directory.glob("*.safetensors"))
        if not files:
            raise ConfigError(f"weights={str(weights)!r} holds no {INDEX}, {SINGLE} or *.safetensors file.")
    else:
        files = [Path(weights)] if isinstance(weights, (str, Path)) else [Path(f) for f in weights]
    from safetensors import safe_open

    names: dict[str, Path] = {}
    for file in files:
        if not file.is_file():
            raise ConfigError(f"weights: no file {file}.")
        with safe_open(str(file), framework="pt") as handle:
            names.update({name: file for name in handle.keys()})
    return names


@dataclass(frozen=True)
class CheckedWeights:
    """What :func:`check_weights` found: the files of each tensor, and the model's names in them."""

    files: dict[str, Path]
    """``{name in the files: the file}``."""
    to_file: dict[str, str]
    """``{the model's name: its name in the files}``."""
    tensor_ids: set[int]
    """``id`` of the whole (meta) model's tensors the files fill (the build allocates them only)."""


def check_weights(whole: nn.Module, weights) -> CheckedWeights:
    """Check ``weights`` against ``whole``, the recorded (meta) model, before anything is built:
    a ConfigError names every tensor that is missing, unexpected, or of another shape or dtype."""
    files = weight_files(weights)
    to_file = _check(files, _expected(whole), getattr(whole, "base_model_prefix", ""), weights,
                     _renamed_prefixes(whole))
    filled = {id(tensor) for name, tensor in whole.state_dict(keep_vars=True).items() if name in to_file}
    return CheckedWeights(files, to_file, filled)


def load_weights(model_parallel: nn.Module, checked: CheckedWeights, layout: ParallelLayout) -> None:
    """Fill this rank's parameters and persistent buffers of ``model_parallel`` (named as the
    whole model by ``model_parallel.global_parameter_name``) from the checked files: each tensor of
    this rank's stage, of a TP-split one only this rank's slice."""
    from safetensors import safe_open

    files, to_file = checked.files, checked.to_file
    handles: dict[Path, object] = {}
    try:
        with torch.no_grad():
            for local, tensor in _local_tensors(model_parallel):
                name = model_parallel.global_parameter_name(local)
                if name not in to_file:
                    continue  # a tied copy whose owner the files name (checked), or a buffer they do not hold
                file = files[to_file[name]]
                handle = handles.get(file) or handles.setdefault(file, safe_open(str(file), framework="pt"))
                _copy_slice(handle.get_slice(to_file[name]), tensor, layout)
    finally:
        handles.clear()


def _expected(whole: nn.Module) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The whole model's persistent tensors, each tied tensor under its first name."""
    seen: set[int] = set()
    expected = {}
    for name, tensor in whole.state_dict(keep_vars=True).items():
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        expected[name] = (tuple(tensor.shape), tensor.dtype)
    return expected


def _renamed_prefixes(whole: nn.Module) -> list[tuple[str, str]]:
    """``(the model's name prefix, the files' prefix)`` where Hugging Face renames a tensor between
    its files and its model (transformers 5 loads GPT-NeoX's ``embed_out.weight`` as
    ``lm_head.weight``, and writes it back under the old name): the anchored, literal renamings of
    ``transformers.conversion_mapping`` (none for other models or without transformers)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming

        renamings = get_model_conversion_mapping(whole)
    except Exception:  # not a transformers model, or a transformers without these
        return []
    pairs = []
    for renaming in renamings:
        if not isinstance(renaming, WeightRenaming) or len(renaming.source_patterns) != 1 \
                or len(renaming.target_patterns) != 1:
            continue
        source, target = renaming.source_patterns[0], renaming.target_patterns[0]
        literal = source[1:].replace("\\.", ".")
        if source.startswith("^") and re.escape(literal) == source[1:]:
            pairs.append((target, literal))
    return pairs


def _check(files: dict[str, Path], expected: dict[str, tuple[tuple[int, ...], torch.dtype]], prefix: str,
           weights, renamed: list[tuple[str, str]] = ()) -> dict[str, str]:
    """``{model name: file name}``, once every model tensor is found with its shape and dtype and
    no file tensor is left over; else a ConfigError naming them."""
    from safetensors import safe_open

    def in_files(name: str) -> str | None:
        old_names = [f"{old}{name[len(new):]}" for new, old in renamed if name.startswith(new)]
        for candidate in (name, name.removeprefix(f"{prefix}.") if prefix else None,
                          f"{prefix}.{name}" if prefix else None, *old_names):
            if candidate and candidate in files:
                return candidate
        return None

    to_file = {name: in_files(name) for name in expected}
    missing = sorted(n for n, f in to_file.items()
                     if f is None and not n.endswith(("inv_freq", "masked_bias")) and not drawn_from_seed(n))
    unexpected = sorted(set(files) - {f for f in to_file.values() if f})
    problems = []
    if missing:
        problems.append(f"missing: {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
    if unexpected:
        problems.append(f"unexpected: {', '.join(unexpected[:5])}{' ...' if len(unexpected) > 5 else ''}")
    handles = {}
    for name, file_name in to_file.items():
        if file_name is None:
            continue
        path = files[file_name]
        handle = handles.get(path) or handles.setdefault(path, safe_open(str(path), framework="pt"))
        piece = handle.get_slice(file_name)
        shape, dtype = tuple(piece.get_shape()), _DTYPES.get(piece.get_dtype())
        want_shape, want_dtype = expected[name]
        if shape != want_shape:
            problems.append(f"{file_name} has shape {shape}, the model's {name} {want_shape}")
        elif dtype != want_dtype:
            problems.append(f"{file_name} is {dtype}, the model's {name} {want_dtype} (build the model in the "
                            "weights' dtype, e.g. with torch.set_default_dtype or the config's torch_dtype)")
    if problems:
        raise ConfigError(f"weights={str(weights)!r} do not fit {len(expected)} tensors of the model: "
                          + "; ".join(problems[:6]))
    return {name: f for name, f in to_file.items() if f is not None}


_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
           "I64": torch.int64, "I32": torch.int32, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}


def _local_tensors(model_parallel: nn.Module) -> Iterable[tuple[str, torch.Tensor]]:
    seen: set[int] = set()
    for name, tensor in model_parallel.state_dict(keep_vars=True).items():
        if isinstance(tensor, torch.Tensor) and id(tensor) not in seen:
            seen.add(id(tensor))
            yield name, tensor


def _copy_slice(piece, local: torch.Tensor, layout: ParallelLayout) -> None:
    """Copy into ``local`` this rank's slice of the file's tensor ``piece`` (megatron's strided
    split: with stride ``s`` the split dim is ``s`` parts and the rank takes its piece of each),
    a few MiB at a time, so that no copy of a whole slice is ever in flight besides ``local``."""
    placement = tp_placement(local)
    split = placement.dim is not None and layout.tensor_model_parallel_size > 1
    if local.dim() == 0:
        local.copy_(piece[:])
        return
    # (local start, file start, length) along dim ``d`` per stride part; whole on other dims
    d = placement.dim if split else 0
    if split:
        runs = strided_runs(piece.get_shape()[d], placement.stride, layout.tensor_model_parallel_size,
                            layout.tensor_model_parallel_rank)
    else:
        runs = [(0, 0, local.shape[0])]
    rows = max(1, CHUNK_BYTES // max(1, local.element_size() * local.numel() // max(1, local.shape[d])))
    for local_start, file_start, length in runs:
        for offset in range(0, length, rows):
            n = min(rows, length - offset)
            file_index = tuple(slice(file_start + offset, file_start + offset + n) if i == d else slice(None)
                               for i in range(local.dim()))
            local.narrow(d, local_start + offset, n).copy_(piece[file_index])


CHUNK_BYTES = 4 << 20
"""The most a read holds besides its destination."""
