"""The Lightning idioms users write, on MHCGPTModule through MHCParallelStrategy: PP 2 and then TP 2
in one launch of 2 processes, or one process (the reference).

    python fit_idioms.py --devices 2 --out result.json

Per layout, one Trainer with a LightningDataModule, ``ModelCheckpoint(monitor="val_loss",
save_top_k=2)``, ``LearningRateMonitor``, ``accumulate_grad_batches=2`` and a CSV logger:
``fit`` (6 steps), then on the same Trainer ``save_checkpoint`` (the line from Lightning's docs),
``validate``, ``test``, a second ``fit`` resuming from that checkpoint (2 more steps), and
``predict`` (refused on a model-parallel layout with its reason). Then a second Trainer with
``precision="bf16-mixed"`` and ``EarlyStopping`` that must stop it early on every rank.
"""
from __future__ import annotations

import argparse
import datetime
import json
import pathlib

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, EarlyStopping, LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader

from lightning_mhc import ConfigError, MHCGPTModule, MHCParallelStrategy
from lightning_mhc.data.sources import SyntheticTokens

SEQ, GLOBAL_BATCH = 16, 8


class Tokens(pl.LightningDataModule):
    """Synthetic windows for every stage; each loader's batch is the per-DP-rank share of 8 (the
    strategy's sampler splits the samples by DP rank)."""

    def __init__(self, data_parallel_size: int) -> None:
        super().__init__()
        self.batch = GLOBAL_BATCH // data_parallel_size

    def _loader(self, n: int, seed: int, shuffle: bool = False) -> DataLoader:
        return DataLoader(SyntheticTokens(n, SEQ, seed=seed), batch_size=self.batch, shuffle=shuffle)

    def train_dataloader(self):
        return self._loader(64, 0, shuffle=True)

    def val_dataloader(self):
        return self._loader(16, 1)

    def test_dataloader(self):
        return self._loader(16, 2)

    def predict_dataloader(self):
        return self._loader(8, 3)


class LossRecorder(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))


def model_config() -> dict:
    return dict(num_layers=4, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128, vocab_size=256,
                max_sequence_length=SEQ, hidden_dropout=0.0, attention_dropout=0.0, mhc_sinkhorn_iterations=4)


def strategy(args, tp: int, pp: int) -> MHCParallelStrategy:
    return MHCParallelStrategy(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                               timeout=datetime.timedelta(seconds=args.timeout))


def idioms(args, name: str, tp: int, pp: int, out: pathlib.Path) -> dict:
    dp = args.devices // (tp * pp)
    recorder = LossRecorder()
    best = ModelCheckpoint(dirpath=out / "best", monitor="val_loss", save_top_k=2, filename="{step}")
    trainer = pl.Trainer(
        accelerator="cpu", devices=args.devices, strategy=strategy(args, tp, pp), max_steps=6,
        accumulate_grad_batches=2, val_check_interval=2, limit_val_batches=2, limit_test_batches=2,
        num_sanity_val_steps=0, gradient_clip_val=1.0, enable_progress_bar=False, enable_model_summary=False,
        log_every_n_steps=1,
        logger=CSVLogger(out, name="logs", version=0), callbacks=[recorder, best, LearningRateMonitor("step")])
    module = MHCGPTModule(model_config(), lr=1e-3, warmup_steps=2)
    data = Tokens(dp)
    result: dict = {}
    trainer.fit(module, datamodule=data)
    result["losses"] = list(recorder.losses)
    saved = out / "after_fit.ckpt"
    trainer.save_checkpoint(saved)  # after fit returned: Lightning's documented way to save by hand
    result["saved"] = sorted(p.name for p in saved.iterdir())
    result["validate"] = trainer.validate(module, datamodule=data)[0]["val_loss"]
    result["test"] = trainer.test(module, datamodule=data)[0]["test_loss"]
    result["top_k"] = sorted(pathlib.Path(p).name for p in best.best_k_models)
    result["best_score"] = float(best.best_model_score)
    trainer.fit_loop.epoch_loop.max_steps = 8
    # two more steps decay to max_steps=8, not the saved schedule's 6: said, or the resume is refused
    module.override_scheduler = True
    trainer.fit(module, datamodule=data, ckpt_path=str(saved))  # a second fit, resuming
    result["resumed_losses"] = recorder.losses[len(result["losses"]):]
    result["global_step"] = trainer.global_step
    try:
        predictions = trainer.predict(module, datamodule=data)
        result["predict"] = [p.tolist() for p in predictions]
    except ConfigError as error:
        result["predict_refused"] = str(error)
    metrics = (out / "logs" / "version_0" / "metrics.csv").read_text().splitlines()[0].split(",")
    result["logged"] = sorted(metrics)

    stopper = EarlyStopping(monitor="val_loss", min_delta=100.0, patience=1)  # never improves enough
    recorder = LossRecorder()
    trainer = pl.Trainer(
        accelerator="cpu", devices=args.devices, strategy=strategy(args, tp, pp), max_steps=20, precision="bf16-mixed",
        val_check_interval=2, limit_val_batches=1, num_sanity_val_steps=0, enable_progress_bar=False,
        enable_model_summary=False, logger=False, enable_checkpointing=False, callbacks=[recorder, stopper])
    trainer.fit(MHCGPTModule(model_config(), lr=1e-3, warmup_steps=2), datamodule=data)
    result["early_stopped_at"] = trainer.global_step
    result["bf16_mixed_losses"] = recorder.losses
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--timeout", type=float, default=120)
    args = parser.parse_args()
    layouts = {"pp2": (1, 2), "tp2": (2, 1)} if args.devices == 2 else {"single": (1, 1)}
    result = {name: idioms(args, name, tp, pp, args.out.parent / name) for name, (tp, pp) in layouts.items()}
    if torch.distributed.get_rank() == 0:
        args.out.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
