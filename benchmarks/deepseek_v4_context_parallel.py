"""DeepSeek-V4 under context parallelism: retained activation bytes per rank at CP 1, 2 and 4.

    python benchmarks/deepseek_v4_context_parallel.py [--seq 2048] [--out PATH]

One spawned gloo group of 4 ranks (one thread each) trains one step through ``Trainer.fit`` on
each layout, one after the other: CP 1 (DP 4: every rank the whole sequence), CP 2 (x DP 2) and
CP 4. The number is what the strategy reports as ``activation_bytes`` (``measure_activation_memory``,
the command line's figure): the peak of what the first training step's forward keeps for backward,
max over ranks. Model: a small ``DeepseekV4ForCausalLM`` drawn from its config (hidden 128, 4 heads
of 64 sharing one K/V head, 4 streams, 3 layers: compressed sparse attention at compression 4 with
the indexer's top 64, heavily compressed attention at compression 128, and a sliding window of 128
in every layer; 4 routed experts, top 2), fp32, micro-batch 1 of ``--seq`` tokens.

What CP splits (``any_model/deepseek_v4_context.py``): the queries and everything token-wise (the
streams, hyper-connections, experts, the attention scores of a rank's queries); what it does not:
each rank gathers the whole sequence's K/V and, in a compressed layer, the attention's input (and
CSA's low-rank query), and keeps them for backward, with the compressor's work on them.
Writes JSON (default ``benchmarks/results/deepseek_v4_context_parallel.json``).
"""
from __future__ import annotations

import argparse
import os
import pathlib
import tempfile

import lightning_mhc  # noqa: F401  (before megatron: quiets its Transformer Engine notice)
from _harness import RESULTS, write_json

WORLD, VOCAB = 4, 256


def v4_config(seq: int):
    from transformers import DeepseekV4Config

    return DeepseekV4Config(
        vocab_size=VOCAB, hidden_size=128, moe_intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, head_dim=64, partial_rotary_factor=0.25, q_lora_rank=64, o_groups=2, o_lora_rank=32,
        n_routed_experts=4, num_experts_per_tok=2,
        layer_types=["compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"],
        mlp_layer_types=["moe"] * 3,
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}, sliding_window=128,
        index_n_heads=4, index_head_dim=32, index_topk=64, hc_mult=4, hc_sinkhorn_iters=5,
        max_position_embeddings=seq, pad_token_id=None)


def _fit(directory: str, cp: int, seq: int) -> int:
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    from lightning_mhc import MHCParallelStrategy
    from lightning_mhc.data.sources import SyntheticTokens
    from lightning_mhc.lightning.modules.hf import HFCausalLMModule

    pl.seed_everything(0, verbose=False)
    module = HFCausalLMModule(directory, optimizer="sgd", lr=1e-3, weight_decay=0.0, min_lr_ratio=1.0)
    strategy = MHCParallelStrategy(context_parallel_size=cp, measure_activation_memory=True)
    trainer = pl.Trainer(accelerator="cpu", devices=WORLD, strategy=strategy, max_steps=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    dp = WORLD // cp
    trainer.fit(module, train_dataloaders=DataLoader(SyntheticTokens(dp, seq, vocab_size=VOCAB, seed=3), batch_size=1))
    return strategy.activation_bytes


def _run(rank: int, world: int, directory: str, seq: int) -> list[dict]:
    import torch

    torch.set_num_threads(1)
    return [dict(cp=cp, dp=WORLD // cp, local_tokens=seq // cp, activation_bytes=_fit(directory, cp, seq))
            for cp in (1, 2, 4)]


def sequence_arguments(doc: str, name: str, seq: int) -> argparse.Namespace:
    """``--seq`` (default ``seq``) and ``--out`` (default ``benchmarks/results/NAME.json``), as the
    V4 benchmarks on this model take them."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, default=seq)
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS / f"{name}.json")
    return parser.parse_args()


def main() -> None:
    args = sequence_arguments(__doc__, "deepseek_v4_context_parallel", 2048)

    from lightning_mhc.testing.launch import spawn_ranks

    with tempfile.TemporaryDirectory() as directory:
        v4_config(args.seq).save_pretrained(directory)
        rows = spawn_ranks(_run, WORLD, directory, args.seq, timeout_s=3600, init_group=False)[0]
    base = rows[0]["activation_bytes"]
    print(f"DeepseekV4ForCausalLM, 3 layers (CSA 4 / HCA 128 / window 128), hidden 128, 4 heads, 4 streams, "
          f"seq {args.seq}, micro-batch 1, fp32; {WORLD} gloo ranks, {os.cpu_count()} cores")
    print(f"{'layout':<12} {'tokens/rank':>11} {'activation MiB/rank':>20} {'vs CP 1':>8}")
    for row in rows:
        row["fraction_of_cp1"] = row["activation_bytes"] / base
        label = f"CP {row['cp']} x DP {row['dp']}"
        print(f"{label:<12} {row['local_tokens']:>11} {row['activation_bytes'] / 2**20:>20.2f} "
              f"{row['fraction_of_cp1']:>8.3f}")
    write_json(args.out, dict(cpus=os.cpu_count(), seq=args.seq, rows=rows))


if __name__ == "__main__":
    main()
