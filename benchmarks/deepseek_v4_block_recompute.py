"""DeepSeek-V4's own hyper-connections under ``mhc_block``: retained activation bytes and step time,
with and without it, in one process.

    python benchmarks/deepseek_v4_block_recompute.py [--seq 1024] [--out PATH]

The CP benchmark's small ``DeepseekV4ForCausalLM`` (``deepseek_v4_context_parallel.v4_config``:
3 layers of compressed sparse, heavily compressed and sliding-window attention, hidden 128, 4
heads, 4 streams, 4 routed experts) with V4's own 20 Sinkhorn iterations, fp32, micro-batch 1 of
``--seq`` tokens, trained ``STEPS`` SGD steps through ``Trainer.fit`` on one process under
``recompute="none"`` and ``"mhc_block"`` (the paper's groups: one layer each at 3 layers and 4
streams) one after the other. The bytes are what the strategy reports as ``activation_bytes``
(``measure_activation_memory``: the first step's peak of what the forward keeps for backward);
the time is the median of the steps after the first. Writes JSON (default
``benchmarks/results/deepseek_v4_block_recompute.json``).
"""
from __future__ import annotations

import os
import statistics
import tempfile
import time

import lightning_mhc  # noqa: F401  (before megatron: quiets its Transformer Engine notice)
from _harness import write_json
from deepseek_v4_context_parallel import VOCAB, sequence_arguments, v4_config

STEPS = 4
POLICIES = ("none", "mhc_block")


def _fit(directory: str, policy: str, seq: int) -> dict:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback
    from torch.utils.data import DataLoader

    from lightning_mhc import MHCParallelStrategy, MHCRecomputeCallback
    from lightning_mhc.data.sources import SyntheticTokens
    from lightning_mhc.lightning.modules.hf import HFCausalLMModule

    class StepTimes(Callback):
        def __init__(self) -> None:
            self.times: list[float] = []

        def on_train_batch_start(self, *args) -> None:
            self.start = time.perf_counter()

        def on_train_batch_end(self, *args) -> None:
            self.times.append(time.perf_counter() - self.start)

    pl.seed_everything(0, verbose=False)
    module = HFCausalLMModule(directory, optimizer="sgd", lr=1e-3, weight_decay=0.0, min_lr_ratio=1.0)
    strategy = MHCParallelStrategy(measure_activation_memory=True)
    times = StepTimes()
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=STEPS, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[times, MHCRecomputeCallback(policy)])
    trainer.fit(module, train_dataloaders=DataLoader(SyntheticTokens(STEPS, seq, vocab_size=VOCAB, seed=3),
                                                     batch_size=1))
    return dict(policy=policy, activation_bytes=strategy.activation_bytes,
                step_seconds=statistics.median(times.times[1:]))


def main() -> None:
    args = sequence_arguments(__doc__, "deepseek_v4_block_recompute", 1024)

    with tempfile.TemporaryDirectory() as directory:
        config = v4_config(args.seq)
        config.hc_sinkhorn_iters = 20  # V4's own
        config.save_pretrained(directory)
        rows = [_fit(directory, policy, args.seq) for policy in POLICIES]
    base = rows[0]
    print(f"DeepseekV4ForCausalLM, 3 layers (CSA 4 / HCA 128 / window 128), hidden 128, 4 heads, 4 streams, "
          f"20 Sinkhorn iterations, seq {args.seq}, micro-batch 1, fp32; one process, {os.cpu_count()} cores")
    print(f"{'recompute':<10} {'activation MiB':>15} {'vs none':>8} {'s/step':>8} {'vs none':>8}")
    for row in rows:
        row["bytes_vs_none"] = row["activation_bytes"] / base["activation_bytes"]
        row["time_vs_none"] = row["step_seconds"] / base["step_seconds"]
        print(f"{row['policy']:<10} {row['activation_bytes'] / 2**20:>15.2f} {row['bytes_vs_none']:>8.3f} "
              f"{row['step_seconds']:>8.3f} {row['time_vs_none']:>8.3f}")
    write_json(args.out, dict(cpus=os.cpu_count(), seq=args.seq, steps=STEPS, rows=rows))


if __name__ == "__main__":
    main()
