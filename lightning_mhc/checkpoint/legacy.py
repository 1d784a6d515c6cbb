"""Checkpoints of the earlier per-(tp, pp) format (``lightning_mhc.sharded/1``).

    <dir>/model_tp{t}_pp{p}.pt   model + optimizer states of that shard, keyed by local names

They load on the layout that saved them (same TP and PP) and are refused on any other with
the way to convert them: resume once on the saving layout; every checkpoint that run saves is
in the reshardable format.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from lightning_mhc.errors import ConfigError
from lightning_mhc.distributed.layout import ParallelLayout
from lightning_mhc.recompute.rng import set_all_rng_states

FORMAT = "lightning_mhc.sharded/1"


def is_legacy(meta: dict[str, Any]) -> bool:
    return meta.get("format") == FORMAT


def shard_name(layout: ParallelLayout) -> str:
    return f"model_tp{layout.tensor_model_parallel_rank}_pp{layout.pipeline_model_parallel_rank}.pt"


def not_reshardable(path: Path, meta: dict[str, Any], current: tuple[int, int] | None = None) -> str:
    """What to say about a per-(tp, pp) checkpoint asked for on another layout (or whole)."""
    tp, pp = meta["tensor_model_parallel_size"], meta["pipeline_model_parallel_size"]
    asked = (f"this run has tensor_model_parallel_size={current[0]} and pipeline_model_parallel_size={current[1]}"
             if current else "it cannot be read whole in one process")
    return (
        f"checkpoint {path} is in the earlier per-(tp, pp) format ({FORMAT}), which cannot be resharded: it was "
        f"saved with tensor_model_parallel_size={tp}, pipeline_model_parallel_size={pp}; {asked}. To convert it, "
        f"resume it once on TP={tp}, PP={pp} (e.g. lightning-mhc-train ... parallel.tensor_model_parallel_size={tp} "
        f"parallel.pipeline_model_parallel_size={pp} trainer.max_steps=<its step + 1> ckpt_path={path}): the "
        "checkpoints that run saves are reshardable."
    )


def check_layout(path: Path, meta: dict[str, Any], tensor_model_parallel_size: int,
                 pipeline_model_parallel_size: int) -> None:
    """A per-(tp, pp) checkpoint loads only with its TP and PP sizes: a ConfigError saying how
    to convert it otherwise (also checked before launch by ``lightning-mhc-train``)."""
    if not is_legacy(meta):
        return
    current = (tensor_model_parallel_size, pipeline_model_parallel_size)
    if (meta["tensor_model_parallel_size"], meta["pipeline_model_parallel_size"]) != current:
        raise ConfigError(not_reshardable(path, meta, current))


def read(path: Path, meta: dict[str, Any], layout: ParallelLayout, global_rank: int) -> dict[str, Any]:
    """This rank's view of a per-(tp, pp) checkpoint; restores its RNG states when the world size matches."""
    check_layout(path, meta, layout.tensor_model_parallel_size, layout.pipeline_model_parallel_size)
    checkpoint = torch.load(path / "trainer_state.pt", map_location="cpu", weights_only=False)
    checkpoint.update(torch.load(path / shard_name(layout), map_location="cpu", weights_only=False))
    rng_file = path / f"rng_rank{global_rank}.pt"
    if meta["world_size"] == layout.world_size and rng_file.is_file():
        set_all_rng_states(torch.load(rng_file, map_location="cpu", weights_only=False))
    return checkpoint
