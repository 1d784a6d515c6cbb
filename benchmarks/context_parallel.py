"""Context parallelism: retained activation bytes per rank and step time at CP 1, 2 and 4.

    python benchmarks/context_parallel.py [--seq 4096] [--rounds 3] [--out PATH]

One spawned gloo group of 4 ranks (one thread each) runs the three layouts one after the other:
CP 1 (DP 4: every rank the whole sequence), CP 2 (x DP 2) and CP 4. Model: the mHC GPT, 2 layers,
hidden 128, 4 query heads over 2 K/V groups (head size 32), n = 4 streams, RoPE, fp32, recompute
none, micro-batch 1 of ``--seq`` tokens. Per layout:

- retained bytes: what one training forward leaves for backward on rank 0 (autograd's saved
  tensors, unique storages, parameters excluded: ``ActivationMemoryMeter``), and its fraction of
  CP 1's. A CP rank keeps ``1/cp`` of every token-wise activation (the ``n``-wide stream, norms,
  hyper-connections, MLP, q and the attention output) plus, per layer, the gathered K/V of the whole
  sequence: the extra over an ideal ``1/cp``;
- step time: forward + backward + the gradient reduction over DP x CP, between barriers, the
  median of ``--rounds`` (after one untimed step), and that time per token of the whole job
  (``DP * seq`` tokens per step), since the 4 ranks train DP samples at once.

On a shared 2-core CPU the times mostly measure 4 processes taking turns on 2 cores; the bytes
do not depend on the machine. Writes JSON (default ``benchmarks/results/context_parallel.json``).
"""
from __future__ import annotations

import argparse
import os
import pathlib
import time

import lightning_mhc  # noqa: F401  (before megatron: quiets its Transformer Engine notice)
from _harness import RESULTS, median, write_json

WORLD, LAYERS, HIDDEN = 4, 2, 128


def _layout_run(cp: int, seq: int, rounds: int) -> dict:
    import torch
    import torch.distributed as dist

    from lightning_mhc.distributed.grads import finalize_model_grads
    from lightning_mhc.distributed.layout import ParallelLayout, destroy_parallel
    from lightning_mhc.distributed.random import model_parallel_manual_seed
    from lightning_mhc.model import MHCTransformerConfig
    from lightning_mhc.model.config import with_parallel_layout
    from lightning_mhc.model.gpt import gpt_forward_step, gpt_loss_func
    from lightning_mhc.model.stages import build_gpt_chunks
    from lightning_mhc.recompute import ActivationMemoryMeter

    layout = ParallelLayout(context_parallel_size=cp).build()
    model_parallel_manual_seed(0, layout)
    cfg = MHCTransformerConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=4, num_query_groups=2,
                               ffn_hidden_size=4 * HIDDEN, vocab_size=256, max_sequence_length=seq,
                               hidden_dropout=0.0, attention_dropout=0.0, mhc_sinkhorn_iterations=4)
    (model,) = build_gpt_chunks(with_parallel_layout(cfg, layout), layout)
    data = torch.randint(0, 256, (1, seq + 1), generator=torch.Generator().manual_seed(layout.data_parallel_rank))
    microbatch = dict(tokens=data[:, :-1], labels=data[:, 1:])

    def loss_of_forward():
        output = gpt_forward_step(model, microbatch)
        return gpt_loss_func(output, model.on_this_rank(microbatch), model.context_parallel_group)

    with ActivationMemoryMeter(model) as meter:
        loss = loss_of_forward()
    retained = meter.result.retained_bytes
    loss.backward()
    model.zero_grad(set_to_none=True)

    times = []
    for r in range(rounds + 1):
        dist.barrier()
        start = time.perf_counter()
        loss_of_forward().backward()
        finalize_model_grads(model, layout)
        dist.barrier()
        if r:
            times.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    result = dict(cp=cp, dp=layout.data_parallel_size, retained_bytes=retained, step_s=median(times), times=times,
                  local_tokens=seq // cp)
    destroy_parallel()
    return result


def _run(rank: int, world: int, args: argparse.Namespace) -> list[dict]:
    import torch

    torch.set_num_threads(1)
    return [_layout_run(cp, args.seq, args.rounds) for cp in (1, 2, 4)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS / "context_parallel.json")
    args = parser.parse_args()

    from lightning_mhc.testing.launch import spawn_ranks

    rows = spawn_ranks(_run, WORLD, args, timeout_s=3600)[0]
    base = rows[0]["retained_bytes"]
    print(f"mHC GPT, {LAYERS} layers, hidden {HIDDEN}, 4 heads / 2 K/V groups, n = 4, seq {args.seq}, micro-batch 1, "
          f"fp32; {WORLD} gloo ranks, {os.cpu_count()} cores, 1 thread per rank, medians of {args.rounds}")
    print(f"{'layout':<12} {'tokens/rank':>11} {'retained MiB/rank':>18} {'vs CP 1':>8} {'step s':>8} "
          f"{'us/token (job)':>15}")
    for row in rows:
        row["fraction_of_cp1"] = row["retained_bytes"] / base
        row["step_us_per_token"] = 1e6 * row["step_s"] / (row["dp"] * args.seq)
        label = f"CP {row['cp']} x DP {row['dp']}"
        print(f"{label:<12} {row['local_tokens']:>11} {row['retained_bytes'] / 2**20:>18.2f} "
              f"{row['fraction_of_cp1']:>8.3f} {row['step_s']:>8.2f} {row['step_us_per_token']:>15.1f}")
    write_json(args.out, dict(cpus=os.cpu_count(), seq=args.seq, rounds=args.rounds, rows=rows))


if __name__ == "__main__":
    main()
