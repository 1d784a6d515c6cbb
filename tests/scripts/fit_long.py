"""A long MHCGPTModule run for the fault tests: it prints ``STEP <n> <loss>`` (rank 0, flushed)
after every step, so a test knows when to send a signal; ``--stop-at N`` ends it cleanly after
step N (the LR schedule is the same whatever N: max_steps stays 1000).

    python fit_long.py --devices 4 --tp 2 --pp 2 --ckpt-dir ckpt [--stop-at 8] [--ckpt-path ckpt/x]
"""
from __future__ import annotations

import argparse
import datetime

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader

from fit_gpt import GLOBAL_BATCH, SEQ, STEPS_PER_EPOCH, model_config
from lightning_mhc import MHCGPTModule, MHCParallelStrategy, MHCRecomputeCallback
from lightning_mhc.data.sources import SyntheticTokens


class StepPrinter(Callback):
    def __init__(self, stop_at: int | None) -> None:
        self.stop_at = stop_at

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_rank == 0:
            print(f"STEP {trainer.global_step} {float(outputs['loss'])!r}", flush=True)
        if self.stop_at is not None and trainer.global_step >= self.stop_at:
            trainer.should_stop = True


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--ckpt-dir", required=True)
    parser.add_argument("--ckpt-path")
    parser.add_argument("--stop-at", type=int)
    parser.add_argument("--timeout", type=float, default=120)
    args = parser.parse_args()
    dp = args.devices // (args.tp * args.pp)
    loader = DataLoader(SyntheticTokens(STEPS_PER_EPOCH * GLOBAL_BATCH, SEQ), batch_size=GLOBAL_BATCH // dp,
                        shuffle=True)
    trainer = pl.Trainer(
        accelerator="cpu", devices=args.devices, max_steps=1000, logger=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, gradient_clip_val=1.0,
        strategy=MHCParallelStrategy(tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp,
                                     timeout=datetime.timedelta(seconds=args.timeout)),
        callbacks=[StepPrinter(args.stop_at), MHCRecomputeCallback("mhc_block"),
                   ModelCheckpoint(dirpath=args.ckpt_dir, every_n_train_steps=10**6)],
    )
    trainer.fit(MHCGPTModule(model_config(0.1), lr=1e-3, warmup_steps=2), train_dataloaders=loader,
                ckpt_path=args.ckpt_path)


if __name__ == "__main__":
    main()
