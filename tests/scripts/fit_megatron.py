"""Megatron indexed data through ``Trainer.fit``: an uninterrupted run, then resumes from its
mid-epoch checkpoint on the same and on another layout, counting which samples each rank reads.

    python fit_megatron.py --prefix P --tokenizer T --work DIR --out result.json   # 2 processes

Cases, in one process group of 2: ``full`` (DP 2, 6 steps, a checkpoint at step 3), ``dp2``
(DP 2 resumed from step 3) and ``tp2`` (TP 2 resumed from step 3).
"""
from __future__ import annotations

import argparse
import json
import pathlib

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_mhc import MHCGPTModule, MHCParallelStrategy
from lightning_mhc.data.megatron import MegatronDataModule

SEQ, GLOBAL_BATCH, STEPS, SAVE_AT = 16, 8, 6, 3


class CountingReads:
    """The training dataset, recording every index read."""

    def __init__(self, dataset, reads: list[int]) -> None:
        self.dataset, self.reads = dataset, reads

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int):
        self.reads.append(int(index))
        return self.dataset[index]


class CountedData(MegatronDataModule):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.reads: list[int] = []

    def setup(self, stage: str | None = None) -> None:
        super().setup(stage)
        if not isinstance(self.datasets["train"], CountingReads):
            self.datasets["train"] = CountingReads(self.datasets["train"], self.reads)


class Losses(Callback):
    def __init__(self) -> None:
        self.losses: dict[int, float] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses[trainer.global_step] = float(outputs["loss"])


def fit(case: str, args, ckpt: str | None) -> dict:
    tp = 2 if case == "tp2" else 1
    strategy = MHCParallelStrategy(tensor_model_parallel_size=tp)
    losses = Losses()
    callbacks = [losses]
    if case == "full":
        callbacks.append(ModelCheckpoint(dirpath=str(args.work / "ckpt"), filename="step-{step}",
                                         every_n_train_steps=SAVE_AT, save_top_k=-1, auto_insert_metric_name=False))
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=STEPS, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                         num_sanity_val_steps=0, enable_checkpointing=case == "full", callbacks=callbacks)
    module = MHCGPTModule(dict(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
                               vocab_size=args.vocab, max_sequence_length=SEQ, hidden_dropout=0.0,
                               attention_dropout=0.0, mhc_sinkhorn_iterations=4), lr=3e-3, warmup_steps=0)
    data = CountedData(args.prefix, args.tokenizer, seq_length=SEQ, global_batch_size=GLOBAL_BATCH,
                       split="100,0,0", seed=5, cache_dir=str(args.work / "cache"))
    trainer.fit(module, datamodule=data, ckpt_path=ckpt)
    reads = [None] * dist.get_world_size()
    dist.all_gather_object(reads, data.reads)
    return dict(losses=losses.losses, reads=reads, dataset_length=len(data.datasets["train"]))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prefix", required=True)
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--vocab", type=int, required=True)
    parser.add_argument("--work", type=pathlib.Path, required=True)
    parser.add_argument("--out", type=pathlib.Path, required=True)
    args = parser.parse_args()
    results = {"full": fit("full", args, None)}
    ckpt = str(args.work / "ckpt" / f"step-{SAVE_AT}.ckpt")
    for case in ("dp2", "tp2"):
        results[case] = fit(case, args, ckpt)
    if dist.get_rank() == 0:
        args.out.write_text(json.dumps(results))


if __name__ == "__main__":
    main()
