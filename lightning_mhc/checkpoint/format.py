"""The checkpoint directory: reshardable tensors on ``torch.distributed.checkpoint``, and the
files around them.

    <dir>/.metadata, __<r>_0.distcp  DCP: the model's and the optimizers' tensors under global
                                     names (``sharding.py``), each rank's pieces placed in the
                                     global tensors; copies written once
    <dir>/trainer_state.pt           rank 0: the rest of Lightning's checkpoint (loops and data
                                     position, callbacks, schedulers, hyperparameters) and the
                                     optimizers' param-group settings
    <dir>/rng_rank{r}.pt             every rank's RNG states (restored on the same layout)
    <dir>/metadata.json              written last (``commit.py``): format, layout, step, files

A checkpoint saved on one layout loads on any other (TP, PP, DP, SP, virtual pipeline; one
process too): every rank asks DCP for the pieces of the global tensors it holds now.
Checkpoints of the earlier per-(tp, pp) format (``LEGACY_FORMAT``) are refused, naming the command
that converts them once (``lightning_mhc/cli/convert.py``).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

import torch
import torch.distributed as dist

from lightning_mhc.checkpoint import commit
from lightning_mhc.checkpoint.sharding import (
    Sharder,
    global_namer,
    model_shards,
    model_targets,
    optimizer_shards,
    optimizer_targets,
    parameter_keys,
)
from lightning_mhc.errors import ConfigError
from lightning_mhc.distributed.layout import ParallelLayout
from lightning_mhc.recompute.rng import get_all_rng_states, set_all_rng_states

FORMAT = "lightning_mhc.dcp/1"
LEGACY_FORMAT = "lightning_mhc.sharded/1"
"""The earlier per-(tp, pp) format: no loader reads it; ``lightning_mhc.cli.convert`` rewrites it."""
TRAINER_STATE = "trainer_state.pt"
MODEL = "state_dict"
OPTIMIZERS = "optimizer_states"
PARAM_GROUPS = "optimizer_param_groups"
ONE_PROCESS = ParallelLayout(world_size=1).summary()
"""A one-process layout's record; a checkpoint from before a field existed had its default."""


def layout_record(layout: ParallelLayout | None) -> dict[str, Any]:
    """The metadata's layout fields: ``layout.summary()`` (a one-process layout's without one)."""
    return layout.summary() if layout is not None else dict(ONE_PROCESS)


def rng_file(global_rank: int) -> str:
    return f"rng_rank{global_rank}.pt"


# ------------------------------------------------------------------------------ saving
def model_state(module: torch.nn.Module, layout: ParallelLayout | None) -> dict[str, Any]:
    """The model's pieces by global name: Lightning's ``state_dict`` entry of a checkpoint."""
    return model_shards(module, layout, Sharder(layout))


def optimizer_state(optimizer: torch.optim.Optimizer, module: torch.nn.Module,
                    layout: ParallelLayout | None, pieces: Iterable[tuple] = ()) -> dict[str, Any]:
    """``{"state": pieces by "<global parameter name>.<state name>", "param_groups": settings}``:
    one entry of Lightning's ``optimizer_states``. ``pieces``: the distributed optimizer's
    ``(piece, parameter, flat range)`` that ``optimizer`` steps instead of whole parameters."""
    state, groups = optimizer_shards(optimizer, parameter_keys(module, layout, pieces), Sharder(layout))
    return dict(state=state, param_groups=groups)


def save(checkpoint: dict[str, Any], path: Path, layout: ParallelLayout | None, global_rank: int,
         global_names: bool = True) -> None:
    """Every rank (a collective): write ``checkpoint`` (``state_dict`` and ``optimizer_states``
    as :func:`model_state` and :func:`optimizer_state` give them) into ``path``, visible only
    once complete: rank 0 cleans what crashed saves left and makes a staging directory, every
    rank writes into it (:func:`write`), rank 0 commits it (``commit.py``)."""
    distributed = dist.is_initialized() and dist.get_world_size() > 1
    path = Path(_broadcast(str(path)) if distributed else path)
    staging = str(commit.begin_save(path)) if global_rank == 0 else None
    staging = Path(_broadcast(staging) if distributed else staging)
    write(checkpoint, staging, global_rank)
    if distributed:
        dist.barrier()
    if global_rank == 0:
        meta = dict(format=FORMAT, **layout_record(layout), global_step=checkpoint.get("global_step"),
                    global_names=global_names)
        commit.commit(staging, path, meta)
    if distributed:
        dist.barrier()


def write(checkpoint: dict[str, Any], directory: Path, global_rank: int) -> None:
    """This rank's files of a save (a collective: DCP plans the tensors over all ranks)."""
    import torch.distributed.checkpoint as dcp

    directory = Path(directory)
    tensors = {f"{MODEL}.{k}": v for k, v in checkpoint.get(MODEL, {}).items()}
    for i, optimizer_state in enumerate(checkpoint.get(OPTIMIZERS, [])):
        tensors.update({f"{OPTIMIZERS}.{i}.{k}": v for k, v in optimizer_state["state"].items()})
    dcp.save(tensors, storage_writer=dcp.FileSystemWriter(directory))
    commit.fault_point("during_shards")
    commit.atomic_save(get_all_rng_states(), directory / rng_file(global_rank))
    if global_rank == 0:
        rest = {k: v for k, v in checkpoint.items() if k not in (MODEL, OPTIMIZERS)}
        rest[PARAM_GROUPS] = [s["param_groups"] for s in checkpoint.get(OPTIMIZERS, [])]
        commit.atomic_save(rest, directory / TRAINER_STATE)
    commit.fault_point("after_shards")


# ----------------------------------------------------------------------------- loading
def load(path: Path, module: torch.nn.Module, optimizers: list[torch.optim.Optimizer],
         layout: ParallelLayout | None, global_rank: int, pieces: Iterable[tuple] = ()) -> dict[str, Any]:
    """Every rank: Lightning's checkpoint dict for this rank's module on this layout, with
    ``state_dict`` (local names) and ``optimizer_states`` (``optimizer.load_state_dict``'s
    form, one per optimizer given; ``None`` in ``optimizers`` skips the saved optimizer of that
    index) read from whatever layout saved ``path`` (``pieces``: as :func:`optimizer_state`).
    Restores the RNG states when the layout is the saving one."""
    path = Path(path)
    meta = read_metadata(path)
    checkpoint = _load(path, meta, module, optimizers, layout, global_rank, pieces)
    checkpoint["lightning_mhc_metadata"] = meta
    return checkpoint


def load_whole(path: Path, module: torch.nn.Module, prefix: str = "") -> dict[str, Any]:
    """One process, no collective: fill ``module``, the whole model built in this process, from
    a checkpoint of any layout; its tensor ``<name>`` is the checkpoint's ``<prefix><name>``
    (``prefix="model."`` loads a GPTModel from an MHCGPTModule's checkpoint). Returns the
    checkpoint's metadata."""
    import torch.distributed.checkpoint as dcp

    meta, reader, saved = _open_whole(Path(path))
    model, local = model_targets(module, None, Sharder(None))
    targets = {f"{MODEL}.{prefix}{k}": v for k, v in model.items()}
    _check_model_shapes(Path(path), targets, saved)
    dcp.load(targets, storage_reader=reader, no_dist=True)
    module.load_state_dict(local, strict=False)
    return meta


def read_tensors(path: Path, prefix: str = MODEL + ".") -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint whose name starts with ``prefix``, whole, by global name
    (``prefix`` removed), in this process: no model, no process group needed."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    _, reader, saved = _open_whole(Path(path))
    tensors = {key: torch.empty(m.size, dtype=m.properties.dtype) for key, m in saved.items()
               if key.startswith(prefix) and isinstance(m, TensorStorageMetadata)}
    dcp.load(tensors, storage_reader=reader, no_dist=True)
    return {key[len(prefix):]: tensor for key, tensor in tensors.items()}


def _open_whole(path: Path) -> tuple[dict[str, Any], Any, dict[str, Any]]:
    """``(metadata, DCP reader, DCP tensor metadata)`` of a checkpoint to read whole."""
    return (read_metadata(path), *_dcp_reader(path))


def _dcp_reader(path: Path) -> tuple[Any, dict[str, Any]]:
    """``(DCP reader, its tensor metadata by key)`` of a checkpoint directory."""
    import torch.distributed.checkpoint as dcp

    reader = dcp.FileSystemReader(path)
    return reader, reader.read_metadata().state_dict_metadata


def read_metadata(path: Path) -> dict[str, Any]:
    """A checkpoint's ``metadata.json``, refused in one line when it is missing (an incomplete
    checkpoint), of the earlier format (naming the command that converts it) or of another."""
    meta = commit.read_metadata(path)
    if meta.get("format") == LEGACY_FORMAT:
        tp, pp = meta["tensor_model_parallel_size"], meta["pipeline_model_parallel_size"]
        raise ConfigError(f"checkpoint {path} is in the earlier per-(tp, pp) format ({LEGACY_FORMAT}, saved on TP={tp} "
                          f"x PP={pp}), which no loader reads: convert it once with torchrun --nproc-per-node "
                          f"{tp * pp} -m lightning_mhc.cli.convert {path} NEW, then load NEW.")
    if meta.get("format") != FORMAT:
        raise ConfigError(f"checkpoint {path} has format {meta.get('format')!r}; this version reads {FORMAT}.")
    return meta


def read_trainer_state(path: Path) -> dict[str, Any]:
    """Rank 0's part of a checkpoint (hyperparameters, loops, schedulers), any format."""
    return torch.load(Path(path) / TRAINER_STATE, map_location="cpu", weights_only=False)


def _load(path: Path, meta: dict[str, Any], module: torch.nn.Module, optimizers: list[torch.optim.Optimizer],
          layout: ParallelLayout | None, global_rank: int, pieces: Iterable[tuple]) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    current = layout_record(layout)
    _, global_names = global_namer(module, layout)
    if not (meta.get("global_names", True) and global_names) and \
            meta["pipeline_model_parallel_size"] != current["pipeline_model_parallel_size"]:
        raise ConfigError(
            f"checkpoint {path} holds a pipelined {type(module).__name__} without global parameter names "
            f"(saved with pipeline_model_parallel_size={meta['pipeline_model_parallel_size']}); this run has "
            f"{current['pipeline_model_parallel_size']}. Resume with the saving PP size, or give the module a "
            "global_parameter_name(local_name) method (see MHCGPTModule)."
        )
    checkpoint = read_trainer_state(path)
    reader, saved = _dcp_reader(path)
    sharder = Sharder(layout)
    model, local = model_targets(module, layout, sharder)
    targets = {f"{MODEL}.{k}": v for k, v in model.items()}
    _check_model_shapes(path, targets, saved)
    keys = parameter_keys(module, layout, pieces)
    assemblers = []
    for i, optimizer in enumerate(optimizers):
        if optimizer is None:  # the caller skips the saved optimizer i
            assemblers.append(None)
            continue
        optimizer_part, assemble = optimizer_targets(optimizer, f"{OPTIMIZERS}.{i}.", keys, sharder, saved)
        targets.update(optimizer_part)
        assemblers.append(assemble)
    dcp.load(targets, storage_reader=reader)

    state_dict = module.state_dict()  # non-tensor entries (megatron's _extra_state) as they are
    state_dict.update(local)
    checkpoint[MODEL] = state_dict
    settings = checkpoint.pop(PARAM_GROUPS, [])
    checkpoint[OPTIMIZERS] = [
        None if optimizer is None else
        _optimizer_state(path, optimizer, assemble(), settings[i] if i < len(settings) else None)
        for i, (optimizer, assemble) in enumerate(zip(optimizers, assemblers))]
    # the RNG streams are per rank (and differ over CP ranks): restored on the saving layout only
    if all(meta.get(k, default) == current[k] for k, default in ONE_PROCESS.items()):
        rng = path / rng_file(global_rank)
        if rng.is_file():
            set_all_rng_states(torch.load(rng, map_location="cpu", weights_only=False))
    return checkpoint


def _check_model_shapes(path: Path, targets: dict[str, Any], saved: dict[str, Any]) -> None:
    missing = [k for k in targets if k not in saved]
    wrong = [f"{k} {tuple(saved[k].size)} != {tuple(v.shape)}" for k, v in targets.items()
             if k in saved and hasattr(saved[k], "size") and tuple(saved[k].size) != tuple(v.shape)]
    if missing or wrong:
        problems = ([f"missing: {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}"] if missing else []) + \
                   ([f"shape (saved != this model): {', '.join(wrong[:5])}"] if wrong else [])
        raise ConfigError(
            f"checkpoint {path} does not fit this model ({'; '.join(problems)}): it was saved from another "
            "model configuration. Load it with the configuration it was trained with."
        )


def _optimizer_state(path: Path, optimizer: torch.optim.Optimizer, state: dict[int, Any],
                     settings: list[dict[str, Any]] | None) -> dict[str, Any]:
    groups = optimizer.state_dict()["param_groups"]
    if settings is None or len(settings) != len(groups):
        raise ConfigError(
            f"checkpoint {path} has {len(settings or [])} optimizer param groups where this run's optimizer has "
            f"{len(groups)}: configure_optimizers must build the same groups as the run that saved it."
        )
    return dict(state=state, param_groups=[dict(saved, params=group["params"])
                                           for saved, group in zip(settings, groups)])


def _broadcast(obj: Any) -> Any:
    box = [obj]
    dist.broadcast_object_list(box, 0)
    return box[0]
