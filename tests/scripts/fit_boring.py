"""Lightning's BoringModel (no pipeline contract) under MHCParallelStrategy(): data parallel."""
from __future__ import annotations

import atexit
import json
import sys

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_mhc import MHCParallelStrategy


class SeedPerRankBoring(BoringModel):
    """Initialised differently on every rank: the strategy must start all replicas from rank 0's."""

    def configure_model(self) -> None:
        with torch.no_grad():
            self.layer.weight.add_(float(self.trainer.global_rank))


def report_group_at_exit() -> None:
    # registered before the strategy's own exit hook, so it runs after it
    print(f"process group alive at exit: {dist.is_initialized()}", file=sys.stderr)


def main() -> None:
    out = sys.argv[1]
    atexit.register(report_group_at_exit)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=MHCParallelStrategy(), max_steps=4,
                         limit_val_batches=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    model = SeedPerRankBoring()
    trainer.fit(model)
    metrics = trainer.validate(model, verbose=False)
    weights = [torch.empty_like(model.layer.weight) for _ in range(2)]
    dist.all_gather(weights, model.layer.weight.detach().contiguous())
    if trainer.global_rank == 0:
        json.dump(dict(global_step=trainer.global_step, val=metrics, replicas_identical=torch.equal(*weights),
                       sampler_ranks=trainer.strategy.distributed_sampler_kwargs), open(out, "w"))


if __name__ == "__main__":
    main()
