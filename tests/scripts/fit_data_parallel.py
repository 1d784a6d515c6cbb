"""Data parallelism through ``Trainer.fit`` with real DataLoaders, several cases per process group.

    python fit_data_parallel.py --devices 4 --cases pp2 tp2 --out result.json

Every case fits on a shuffled DataLoader (Lightning inserts the sampler) for
``STEPS`` steps, across an epoch boundary, and records per step the loss and
the dataset indices each rank trained on (gathered to rank 0). ``--devices 1``
runs the one-process references: the same global batches, whole.
"""
from __future__ import annotations

import argparse
import json
import pathlib

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader, Dataset

from lightning_mhc import MHCGPTModule, MHCParallelStrategy
from lightning_mhc.data.sources import SyntheticTokens

SEQ, GLOBAL_BATCH, STEPS_PER_EPOCH, STEPS = 16, 8, 3, 5
LAYOUTS = {"single": (1, 1), "dp": (1, 1), "pp2": (1, 2), "tp2": (2, 1), "tp2pp2": (2, 2)}


class IndexedTokens(SyntheticTokens):
    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return dict(super().__getitem__(index), index=torch.tensor(index))


class VectorData(Dataset):
    """Deterministic regression samples: (x, y) depend only on the index."""

    def __len__(self) -> int:
        return STEPS_PER_EPOCH * GLOBAL_BATCH

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(index)
        return dict(x=torch.randn(16, generator=g), y=torch.randn(2, generator=g), index=torch.tensor(index))


class PlainRegression(pl.LightningModule):
    """A plain LightningModule (no pipeline contract): trains as data parallel."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(16, 2)

    def training_step(self, batch, batch_idx):
        return torch.nn.functional.mse_loss(self.layer(batch["x"]), batch["y"])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.2)


class PlainWithUnusedLayer(PlainRegression):
    """The plain module with AdamW and a trainable layer its loss never touches: AdamW skips a
    parameter without a gradient (no weight decay, no momentum), so that layer must not move,
    with the distributed optimizer too."""

    def __init__(self) -> None:
        super().__init__()
        self.unused = torch.nn.Linear(3, 3)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.05, weight_decay=0.1)


class Recorder(Callback):
    """Per step: the loss (rank 0's view) and every rank's sample indices."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.indices: list[list[list[int]]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = outputs["loss"].detach()
        if not isinstance(pl_module, MHCGPTModule):  # a plain module's loss is this rank's: average over DP
            loss = trainer.strategy.reduce(loss)
        self.losses.append(float(loss))
        mine = batch["index"].tolist()
        everyone = [None] * dist.get_world_size() if dist.is_initialized() else [mine]
        if dist.is_initialized():
            dist.all_gather_object(everyone, mine)
        self.indices.append(everyone)


def gpt_config() -> dict:
    return dict(num_layers=4, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128, vocab_size=256,
                max_sequence_length=SEQ, hidden_dropout=0.0, attention_dropout=0.0, mhc_sinkhorn_iterations=4)


def fit_case(case: str, devices: int) -> dict:
    """``case``: a layout of LAYOUTS, prefixed ``plain_`` for the plain module, ``plain_adamw_`` for
    the plain module with AdamW and an unused layer, stepped by the distributed optimizer on more
    than one device."""
    plain, adamw = case.startswith("plain"), case.startswith("plain_adamw_")
    tp, pp = LAYOUTS[case.removeprefix("plain_").removeprefix("adamw_")]
    dp = devices // (tp * pp)
    # microbatches: 2 per DP rank under PP; the one-process reference takes the whole global batch
    micro = 2 if pp > 1 else 1
    strategy = MHCParallelStrategy(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                   num_microbatches=micro, use_distributed_optimizer=adamw and devices > 1)
    recorder = Recorder()
    trainer = pl.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=STEPS, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, limit_val_batches=0, callbacks=[recorder])
    if plain:
        module, dataset = PlainWithUnusedLayer() if adamw else PlainRegression(), VectorData()
    else:
        module = MHCGPTModule(gpt_config(), lr=3e-3, warmup_steps=0)
        dataset = IndexedTokens(STEPS_PER_EPOCH * GLOBAL_BATCH, SEQ)
    loader = DataLoader(dataset, batch_size=GLOBAL_BATCH // dp, shuffle=True, drop_last=True)
    initial = [p.detach().flatten().tolist() for p in module.parameters()]
    trainer.fit(module, train_dataloaders=loader)
    result = dict(losses=recorder.losses, indices=recorder.indices, dp=dp, tp=tp, pp=pp,
                  dp_ranks=_gather(strategy.layout.data_parallel_rank))
    if plain:
        result["initial_weights"] = initial
        result["weights"] = [p.detach().flatten().tolist() for p in module.parameters()]
        result["replicas_identical"] = all(_gather(p.detach().flatten().tolist()) == [p.detach().flatten().tolist()]
                                           * max(devices, 1) for p in module.parameters())
    return result


def _gather(value):
    if not dist.is_initialized():
        return [value]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, required=True)
    parser.add_argument("--cases", nargs="+", required=True)
    parser.add_argument("--out", type=pathlib.Path, required=True)
    args = parser.parse_args()
    pl.seed_everything(7, verbose=False)
    results = {case: fit_case(case, args.devices) for case in args.cases}
    if not dist.is_initialized() or dist.get_rank() == 0:
        args.out.write_text(json.dumps(results))


if __name__ == "__main__":
    main()
