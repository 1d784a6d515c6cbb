"""``torchrun --nproc-per-node TPxPP -m lightning_mhc.cli.convert OLD NEW``: a checkpoint of the
earlier per-(tp, pp) format rewritten once in the reshardable one, which every loader reads.

The earlier format (``lightning_mhc.sharded/1``) held one ``model_tp<t>_pp<p>.pt`` per model-parallel
rank (the stage's state dict and its optimizers' states, under the stage's local names) beside
``trainer_state.pt`` and ``metadata.json``. Its tensors can be placed in the whole model's only by
the module that saved them, so each of the TP x PP processes (CPU, gloo; one process needs no
torchrun) builds the saved ``MHCGPTModule`` from its hyperparameters on the saving layout, loads its
shard and its optimizer's state, and saves them by global name (``lightning_mhc.checkpoint``): what
resuming once on the saving layout and saving again gives, without a training step. The trainer
state (loops, data position, schedulers, hyperparameters) is carried over; the RNG states are this
conversion's (those of a run on another layout are not restored anyway).
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

SHARD = "model_tp{}_pp{}.pt"


def convert(old: Path, new: Path) -> None:
    """This rank's part of the conversion (every rank of the TP x PP world calls it)."""
    import torch
    import torch.distributed as dist

    from lightning_mhc.checkpoint.commit import read_metadata
    from lightning_mhc.checkpoint.format import LEGACY_FORMAT, model_state, optimizer_state, read_trainer_state, save
    from lightning_mhc.distributed.layout import ParallelLayout
    from lightning_mhc.errors import ConfigError
    from lightning_mhc.lightning.modules.gpt import MHCGPTModule

    meta = read_metadata(old)  # a clear error for a missing or incomplete checkpoint
    if meta.get("format") != LEGACY_FORMAT:
        raise ConfigError(f"checkpoint {old} has format {meta.get('format')!r}, not the earlier {LEGACY_FORMAT}: "
                          "nothing to convert (every loader reads it as it is).")
    tp, pp = meta["tensor_model_parallel_size"], meta["pipeline_model_parallel_size"]
    if not dist.is_initialized():  # torchrun's environment, or one process on its own (an in-memory store)
        if "RANK" in os.environ:
            dist.init_process_group("gloo")
        else:
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    if dist.get_world_size() != tp * pp:
        raise ConfigError(f"checkpoint {old} was saved on TP={tp} x PP={pp}: convert it on {tp * pp} processes "
                          f"(torchrun --nproc-per-node {tp * pp} -m lightning_mhc.cli.convert ...), not "
                          f"{dist.get_world_size()}.")
    layout = ParallelLayout(tp, pp, world_size=tp * pp).build()
    state = read_trainer_state(old)
    hparams = state.get("hyper_parameters") or {}
    if "model_config" not in hparams:
        raise ConfigError(f"checkpoint {old} records no model_config hyperparameter (it was not saved from an "
                          "MHCGPTModule): only MHCGPTModule checkpoints can be converted.")
    module = MHCGPTModule(**hparams)
    module.handed_layout = layout  # no strategy here: the module builds its stage on the layout it is handed
    module.configure_model()
    shard = torch.load(old / SHARD.format(layout.tensor_model_parallel_rank, layout.pipeline_model_parallel_rank),
                       map_location="cpu", weights_only=False)
    module.load_state_dict(shard["state_dict"])
    optimizers = []
    for saved in shard.get("optimizer_states", []):
        optimizer = module.configure_optimizers(max_steps=1)["optimizer"]  # the schedule is in the trainer state
        optimizer.load_state_dict(saved)
        optimizers.append(optimizer)
    checkpoint = {**state, "state_dict": model_state(module, layout),
                  "optimizer_states": [optimizer_state(optimizer, module, layout) for optimizer in optimizers]}
    save(checkpoint, new, layout, dist.get_rank())
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_mhc.cli.convert", description=__doc__.split("\n\n")[0])
    parser.add_argument("old", type=Path, help="a checkpoint directory of the earlier per-(tp, pp) format")
    parser.add_argument("new", type=Path, help="the directory to write, in the reshardable format")
    args = parser.parse_args(argv)
    from lightning_mhc.errors import ConfigError

    try:
        convert(args.old, args.new)
    except (ConfigError, FileNotFoundError) as error:
        print(f"lightning_mhc.cli.convert: {error}", file=sys.stderr)
        return 2
    if int(os.environ.get("RANK", 0)) == 0:
        print(f"{args.old} -> {args.new} (reshardable)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
