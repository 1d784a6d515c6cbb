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
from lightning_mhc.any_model.experts import PerExpertFiles, conversion_mapping, merged_experts, per_expert_files
from lightning_mhc.any_model.hc_plan import drawn_from_seed
from lightning_mhc.any_model.placement import strided_runs

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
    to_file: dict[str, str | PerExpertFiles]
    """``{the model's name: its name in the files}``, or a fused expert tensor's per-expert names."""
    tensor_ids: set[int]
    """``id`` of the whole (meta) model's tensors the files fill (the build allocates them only)."""


def check_weights(whole: nn.Module, weights) -> CheckedWeights:
    """Check ``weights`` against ``whole``, the recorded (meta) model, before anything is built:
    a ConfigError names every tensor that is missing, unexpected, or of another shape or dtype."""
    files = weight_files(weights)
    to_file = _check(files, _expected(whole), getattr(whole, "base_model_prefix", ""), weights,
                     _renamed_prefixes(whole), merged_experts(whole), _renamed_files(whole, files))
    filled = {id(tensor) for name, tensor in whole.state_dict(keep_vars=True).items() if name in to_file}
    return CheckedWeights(files, to_file, filled)


def load_weights(model_parallel: nn.Module, checked: CheckedWeights, layout: ParallelLayout) -> None:
    """Fill this rank's parameters and persistent buffers of ``model_parallel`` (named as the
    whole model by ``model_parallel.global_parameter_name``) from the checked files: each tensor of
    this rank's stage, of a TP-split one only this rank's slice."""
    from safetensors import safe_open

    files, to_file = checked.files, checked.to_file
    handles: dict[Path, object] = {}

    def piece(file_name: str):
        file = files[file_name]
        handle = handles.get(file) or handles.setdefault(file, safe_open(str(file), framework="pt"))
        return handle.get_slice(file_name)

    try:
        with torch.no_grad():
            for local, tensor in _local_tensors(model_parallel):
                name = model_parallel.global_parameter_name(local)
                if name not in to_file:
                    continue  # a tied copy whose owner the files name (checked), or a buffer they do not hold
                found = to_file[name]
                if isinstance(found, PerExpertFiles):
                    _copy_experts(found, tensor, layout, piece)
                else:
                    _copy_slice(piece(found), tensor, layout)
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


def _renamed_prefixes(whole: nn.Module) -> list[tuple[str, str, bool]]:
    """``(the model's name part, the files' name part, whether it is a prefix)`` where Hugging Face
    renames a tensor between its files and its model (transformers 5 loads GPT-NeoX's
    ``embed_out.weight`` as ``lm_head.weight``, Mixtral's ``.block_sparse_moe.`` as ``.mlp.``, and
    writes them back under the old names): the literal renamings of
    ``transformers.conversion_mapping``, anchored or not (none for other models or without transformers)."""
    renamings = conversion_mapping(whole)
    if not renamings:
        return []
    from transformers.core_model_loading import WeightRenaming

    pairs = []
    for renaming in renamings:
        if not isinstance(renaming, WeightRenaming) or len(renaming.source_patterns) != 1 \
                or len(renaming.target_patterns) != 1:
            continue
        source, target = renaming.source_patterns[0], renaming.target_patterns[0]
        anchored = source.startswith("^")
        literal = source[1:].replace("\\.", ".") if anchored else source
        # an unanchored pattern of names and dots only (its '.' matches a literal dot too)
        if (re.escape(literal) == source[1:]) if anchored else re.fullmatch(r"[\w.]+", source) is not None:
            pairs.append((target, literal, anchored))
    return pairs


def _renamed_files(whole: nn.Module, files: dict[str, Path]) -> dict[str, str]:
    """``{the name transformers loads a file's tensor as: its name in the files}`` where its
    renamings chain (all of them applied in turn, as ``from_pretrained`` does: DeepSeek-V4's files
    keep DeepSeek's own names, ``layers.0.attn.wq_a`` for ``layers.0.self_attn.q_a_proj``); empty
    for a model without renamings."""
    renamings = conversion_mapping(whole)
    if not renamings:
        return {}
    from transformers.core_model_loading import WeightRenaming, apply_renamings

    renamings = [r for r in renamings if isinstance(r, WeightRenaming)]
    return {apply_renamings(name, renamings): name for name in files} if renamings else {}


def _check(files: dict[str, Path], expected: dict[str, tuple[tuple[int, ...], torch.dtype]], prefix: str,
           weights, renamed: list[tuple[str, str, bool]] = (), merged: list[tuple[str, tuple[str, ...]]] = (),
           renamed_files: dict[str, str] | None = None) -> dict[str, str | PerExpertFiles]:
    """``{model name: file name}`` (a fused expert tensor stored per expert: its per-expert names,
    ``merged`` by :func:`~lightning_mhc.any_model.experts.merged_experts`), once every model tensor
    is found with its shape and dtype and no file tensor is left over; else a ConfigError naming them."""
    from safetensors import safe_open

    def in_files(name: str) -> str | None:
        old_names = [f"{old}{name[len(new):]}" if anchored else name.replace(new, old, 1)
                     for new, old, anchored in renamed if (name.startswith(new) if anchored else new in name)]
        for candidate in (name, name.removeprefix(f"{prefix}.") if prefix else None,
                          f"{prefix}.{name}" if prefix else None, *old_names):
            if candidate and candidate in files:
                return candidate
        return (renamed_files or {}).get(name)

    to_file = {name: in_files(name) for name in expected}
    for name, found in to_file.items():
        if found is None:
            to_file[name] = per_expert_files(name, expected[name][0], merged, in_files)
    missing = sorted(n for n, f in to_file.items()
                     if f is None and not n.endswith(("inv_freq", "masked_bias")) and not drawn_from_seed(n))
    used = {f for found in to_file.values() if found
            for f in ([found] if isinstance(found, str) else [n for parts in found.names for n in parts])}
    unexpected = sorted(set(files) - used)
    problems = []
    if missing:
        problems.append(f"missing: {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
    if unexpected:
        problems.append(f"unexpected: {', '.join(unexpected[:5])}{' ...' if len(unexpected) > 5 else ''}")
    handles = {}

    def stored(file_name: str) -> tuple[tuple[int, ...], torch.dtype | None]:
        path = files[file_name]
        handle = handles.get(path) or handles.setdefault(path, safe_open(str(path), framework="pt"))
        piece = handle.get_slice(file_name)
        return tuple(piece.get_shape()), _DTYPES.get(piece.get_dtype())

    for name, found in to_file.items():
        if found is None:
            continue
        want_shape, want_dtype = expected[name]
        if isinstance(found, str):
            file_name, (shape, dtype) = found, stored(found)
        else:  # one tensor per expert and part: as transformers stacks and joins them
            file_name = f"{found.names[0][0]} ... {found.names[-1][-1]}"
            parts = [[stored(n) for n in expert] for expert in found.names]
            shape = _stacked_shape([[part_shape for part_shape, _ in expert] for expert in parts])
            dtypes = {dtype for expert in parts for _, dtype in expert}
            dtype = dtypes.pop() if len(dtypes) == 1 else None
        if shape is None:
            problems.append(f"{file_name} do not stack into the model's {name} {want_shape}")
        elif shape != want_shape:
            problems.append(f"{file_name} has shape {shape}, the model's {name} {want_shape}")
        elif dtype != want_dtype:
            problems.append(f"{file_name} is {dtype}, the model's {name} {want_dtype} (build the model in the "
                            "weights' dtype, e.g. with torch.set_default_dtype or the config's torch_dtype)")
    if problems:
        raise ConfigError(f"weights={str(weights)!r} do not fit {len(expected)} tensors of the model: "
                          + "; ".join(problems[:6]))
    return {name: f for name, f in to_file.items() if f is not None}


def _stacked_shape(shapes: list[list[tuple[int, ...]]]) -> tuple[int, ...] | None:
    """The fused shape ``[E, sum of the parts' dim 0, ...]`` of ``shapes[e]``, expert ``e``'s parts'
    shapes; None where they do not stack (the parts' other dims, or the experts, differ)."""
    joined = set()
    for parts in shapes:
        if len({shape[1:] for shape in parts}) != 1:
            return None
        joined.add((sum(shape[0] for shape in parts), *parts[0][1:]))
    return (len(shapes), *joined.pop()) if len(joined) == 1 else None


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
    # an expert tensor is split over EP (this rank's block of experts along dim 0), others over TP
    parts, part = ((layout.expert_model_parallel_size, layout.expert_model_parallel_rank) if placement.over == "ep"
                   else (layout.tensor_model_parallel_size, layout.tensor_model_parallel_rank))
    split = placement.dim is not None and parts > 1
    if local.dim() == 0:
        local.copy_(piece[:])
        return
    # (local start, file start, length) along dim ``d`` per stride part; whole on other dims
    d = placement.dim if split else 0
    if split:
        runs = strided_runs(piece.get_shape()[d], placement.stride, parts, part)
    else:
        runs = [(0, 0, local.shape[0])]
    _copy_runs(piece, local, d, runs)


def _copy_experts(found: PerExpertFiles, local: torch.Tensor, layout: ParallelLayout, piece_of) -> None:
    """Copy into ``local`` (``[experts, out, in]``: this EP rank's block of experts, all of them
    without EP) its experts' per-expert tensors, each part into its rows of the expert
    (``piece_of(name)``: the file's slice object of a name)."""
    first = 0
    if tp_placement(local).over == "ep" and layout.expert_model_parallel_size > 1:
        first = layout.expert_model_parallel_rank * local.shape[0]
    for i in range(local.shape[0]):
        row = 0
        for name in found.names[first + i]:
            piece = piece_of(name)
            length = piece.get_shape()[0]
            _copy_runs(piece, local[i], 0, [(row, 0, length)])
            row += length


def _copy_runs(piece, local: torch.Tensor, d: int, runs: list[tuple[int, int, int]]) -> None:
    """Copy the file's ``piece`` into ``local`` along dim ``d``, ``(local start, file start,
    length)`` per run, whole on the other dims, a few MiB at a time."""
    rows = max(1, CHUNK_BYTES // max(1, local.element_size() * local.numel() // max(1, local.shape[d])))
    for local_start, file_start, length in runs:
        for offset in range(0, length, rows):
            n = min(rows, length - offset)
            file_index = tuple(slice(file_start + offset, file_start + offset + n) if i == d else slice(None)
                               for i in range(local.dim()))
            local.narrow(d, local_start + offset, n).copy_(piece[file_index])


CHUNK_BYTES = 4 << 20
"""The most a read holds besides its destination."""
