"""Data parallelism through ``Trainer.fit`` with real DataLoaders, several cases per process group.

    python fit_data_parallel.py --devices 4 --cases pp2 tp2 --out result.json

Every case fits on a shuffled DataLoader (Lightning inserts the sampler) for
``STEPS`` steps, across an epoch boundary, and records per step the loss and
the dataset indices each rank trained on (gathered to rank 0). ``--devices 1``
runs the one-process references: the same global batches, whole. The case ``stop_resume`` runs
the plain module stopped early, saved after ``fit`` and resumed (``stop_resume``).
"""
from __future__ import annotations

import argparse
import json
import pathlib

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader, Dataset

from lightning_mhc import MHCGPTModule, MHCParallelStrategy
from lightning_mhc.lightning.callbacks.final_step import FinalStepCheckpoint
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
    """Per step: the loss (rank 0's view), every rank's sample indices and (epoch, batch index)."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.indices: list[list[list[int]]] = []
        self.positions: list[tuple[int, int]] = []

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
        self.positions.append((trainer.current_epoch, batch_idx))


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


STOP_RESUME_STEPS = 3 * STEPS_PER_EPOCH
STOPS = {  # name: (the first run's Trainer arguments, stop at step (should_stop), where it is saved)
    "should_stop_mid_epoch": (dict(max_steps=STOP_RESUME_STEPS), 2, "after_fit"),
    "should_stop_at_epoch_end": (dict(max_steps=STOP_RESUME_STEPS), STEPS_PER_EPOCH, "after_fit"),
    "max_steps_mid_epoch": (dict(max_steps=2), None, "after_fit"),
    "max_steps_at_epoch_end": (dict(max_steps=STEPS_PER_EPOCH), None, "after_fit"),
    "final_step_mid_epoch": (dict(max_steps=4), None, "final_step"),  # the CLI's FinalStepCheckpoint
    "epochs_should_stop_mid_epoch": (dict(max_epochs=3), 5, "after_fit"),  # epoch-based training
}
"""How a run can end before the uninterrupted run's ``STOP_RESUME_STEPS`` steps (3 epochs): each
is resumed with that run's limit (``max_steps``, or ``max_epochs`` where the first run had it)."""


class StopAt(Callback):
    """``trainer.should_stop`` set after the step ``step``, as a user's callback sets it."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            trainer.should_stop = True


def fit_plain(devices: int, limits: dict, callbacks: list, ckpt_path: str | None = None):
    """The plain module on ``VectorData`` (shuffled, Lightning's sampler) under ``limits``."""
    recorder = Recorder()
    trainer = pl.Trainer(accelerator="cpu", devices=devices, strategy=MHCParallelStrategy(), logger=False,
                         enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         limit_val_batches=0, callbacks=[recorder, *callbacks], **limits)
    loader = DataLoader(VectorData(), batch_size=GLOBAL_BATCH // devices, shuffle=True, drop_last=True)
    torch.manual_seed(0)  # the same initial weights in every run
    trainer.fit(PlainRegression(), train_dataloaders=loader, ckpt_path=ckpt_path)
    return trainer, dict(losses=recorder.losses, indices=recorder.indices, positions=recorder.positions,
                         epoch=trainer.current_epoch, global_step=trainer.global_step)


def stop_resume(devices: int, out_dir: pathlib.Path) -> dict:
    """The uninterrupted run of ``STOP_RESUME_STEPS`` steps, then per ``STOPS`` case: the first
    run, stopped and saved (after ``fit`` returns, or ``FinalStepCheckpoint`` in
    ``on_train_end``), and the run resumed from that checkpoint."""
    result = {"uninterrupted": fit_plain(devices, dict(max_steps=STOP_RESUME_STEPS), [])[1]}
    for name, (limits, stop_at, saved) in STOPS.items():
        callbacks = [StopAt(stop_at)] if stop_at else []
        if saved == "final_step":
            callbacks.append(FinalStepCheckpoint(dirpath=out_dir / name, every_n_train_steps=STOP_RESUME_STEPS))
        trainer, result[f"{name}_first"] = fit_plain(devices, limits, callbacks)
        path = out_dir / name / "after_fit.ckpt"
        if saved == "after_fit":
            path.parent.mkdir(parents=True, exist_ok=True)
            trainer.save_checkpoint(path)
        else:
            (path,) = (out_dir / name).glob("*.ckpt")
        resumed_limits = limits if "max_epochs" in limits else dict(max_steps=STOP_RESUME_STEPS)
        result[name] = fit_plain(devices, resumed_limits, [], ckpt_path=str(path))[1]
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
    results = {case: stop_resume(args.devices, args.out.parent / f"stop_resume{args.devices}") if case == "stop_resume"
               else fit_case(case, args.devices) for case in args.cases}
    if not dist.is_initialized() or dist.get_rank() == 0:
        args.out.write_text(json.dumps(results))


if __name__ == "__main__":
    main()
