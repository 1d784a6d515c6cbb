"""Context parallelism through ``Trainer.fit``, several cases per process group.

    python fit_context_parallel.py --devices 4 --cases cp4 cp2pp2 cp2tp2sp cp2dp2 --out result.json --dir DIR
    python fit_context_parallel.py --devices 1 --cases single resume --out reference.json --dir DIR \
        --compare single:cp4 single:resume

Every case fits ``MHCGPTModule`` (mHC, n = 4 streams, grouped-query attention, RoPE) with the
``mhc_block`` recompute callback on the same data: a loss mask that keeps positions 0-4 and 9 of
16, so that at CP 2 rank 0 holds four kept tokens and rank 1 two (at CP 4: 2, 2, 1, 1). It records
the per-step losses and saves the final weights (``DIR/<case>``), which the test reads back whole.
``cp2dp2`` also saves a checkpoint after step 2 (``DIR/cp2dp2_step2``); the one-process
``resume`` case continues it at CP 1. ``*_dropout_<policy>`` cases run CP 2 x DP 2 with dropout 0.1.
``<layout>_exact`` cases run hidden dropout 0.1 with ``exact_hidden_dropout`` (attention dropout 0),
``<layout>_exact_dropout_<policy>`` with that recompute policy.
``--compare a:b`` (after the fits, in rank 0): the largest difference between the weights saved by
cases ``a`` and ``b``, each read whole into this process (``MHCGPTModule.load_from_checkpoint``).
"""
from __future__ import annotations

import argparse
import json
import pathlib

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader

from lightning_mhc import MHCGPTModule, MHCParallelStrategy, MHCRecomputeCallback
from lightning_mhc.data.sources import SyntheticTokens

SEQ, GLOBAL_BATCH, STEPS, SAVE_AT = 16, 8, 4, 2
LAYOUTS = {  # case -> (TP, CP, PP, sequence parallelism, distributed optimizer)
    "single": (1, 1, 1, False, False), "resume": (1, 1, 1, False, False),
    "cp4": (1, 4, 1, False, False), "cp2pp2": (1, 2, 2, False, False), "cp2tp2sp": (2, 2, 1, True, False),
    "cp2dp2": (1, 2, 1, False, True), "tp2dp2": (2, 1, 1, False, False),
    "tp2pp2": (2, 1, 2, False, False),
}


def loss_mask() -> torch.Tensor:
    position = torch.arange(SEQ)
    return ((position < 5) | (position == 9)).float()


class MaskedTokens(SyntheticTokens):
    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return dict(super().__getitem__(index), loss_mask=loss_mask())


class Recorder(Callback):
    """Per step the loss (the same on every rank); after step ``save_at`` a checkpoint."""

    def __init__(self, save_at: pathlib.Path | None) -> None:
        self.losses: list[float] = []
        self.save_at = save_at

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))
        if self.save_at is not None and trainer.global_step == SAVE_AT:
            trainer.save_checkpoint(self.save_at)


def gpt_config(dropout: float, exact: bool = False) -> dict:
    # exact_hidden_dropout leaves attention dropout off (it refuses it under TP or CP)
    return dict(num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128,
                vocab_size=256, max_sequence_length=SEQ, hidden_dropout=dropout,
                attention_dropout=0.0 if exact else dropout, exact_hidden_dropout=exact, mhc_sinkhorn_iterations=4)


def fit_case(case: str, devices: int, directory: pathlib.Path) -> dict:
    layout_name, _, policy = case.partition("_dropout_")
    exact = layout_name.endswith("_exact")
    layout_name = layout_name.removesuffix("_exact")
    dropout = 0.1 if policy or exact else 0.0
    tp, cp, pp, sp, zero = LAYOUTS[layout_name]
    dp = devices // (tp * cp * pp)
    strategy = MHCParallelStrategy(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                   context_parallel_size=cp, sequence_parallel=sp, use_distributed_optimizer=zero,
                                   num_microbatches=2 if pp > 1 else 1)
    recorder = Recorder(directory / "cp2dp2_step2" if case == "cp2dp2" else None)
    trainer = pl.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=STEPS, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, limit_val_batches=1, val_check_interval=STEPS,
                         callbacks=[recorder, MHCRecomputeCallback(policy or "mhc_block")])
    # SGD with momentum: weights within 1e-5 (AdamW divides each gradient by its own scale, so an
    # element whose gradient is ~0 in both runs can move by ~lr on rounding differences)
    module = MHCGPTModule(gpt_config(dropout, exact), lr=0.1, warmup_steps=0, optimizer="sgd")
    dataset = MaskedTokens(STEPS * GLOBAL_BATCH, SEQ)
    loader = DataLoader(dataset, batch_size=GLOBAL_BATCH // dp, drop_last=True)
    val_loader = DataLoader(MaskedTokens(GLOBAL_BATCH, SEQ, seed=9), batch_size=GLOBAL_BATCH // dp)
    ckpt = directory / "cp2dp2_step2" if case == "resume" else None
    trainer.fit(module, train_dataloaders=loader, val_dataloaders=val_loader, ckpt_path=ckpt)
    trainer.save_checkpoint(directory / case)
    return dict(losses=recorder.losses, val_loss=float(trainer.callback_metrics["val_loss"]), dp=dp,
                cp_ranks=strategy.layout.context_parallel_rank)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, required=True)
    parser.add_argument("--cases", nargs="+", required=True)
    parser.add_argument("--out", type=pathlib.Path, required=True)
    parser.add_argument("--dir", type=pathlib.Path, required=True)
    parser.add_argument("--compare", nargs="*", default=[])
    args = parser.parse_args()
    pl.seed_everything(7, verbose=False)
    results = {case: fit_case(case, args.devices, args.dir) for case in args.cases}
    if not dist.is_initialized() or dist.get_rank() == 0:
        results["weight_diffs"] = {pair: weight_diff(args.dir, *pair.split(":")) for pair in args.compare}
        args.out.write_text(json.dumps(results))


def weight_diff(directory: pathlib.Path, a: str, b: str) -> float:
    first, second = (MHCGPTModule.load_from_checkpoint(directory / case).state_dict() for case in (a, b))
    assert first.keys() == second.keys()
    return max((first[k].float() - second[k].float()).abs().max().item() for k in first
               if isinstance(first[k], torch.Tensor) and first[k].is_floating_point())


if __name__ == "__main__":
    main()
