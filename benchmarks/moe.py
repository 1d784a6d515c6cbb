"""Mixture of experts under expert parallelism: per-rank expert bytes, and step time with and
without mHC, at EP 1, 2 and 4 on the same 4 ranks.

    python benchmarks/moe.py [--rounds 5] [--hidden 128] [--experts 8] [--world 4] [--out PATH]

One spawned gloo group of ``--world`` ranks (one thread each) per EP size (DP = world, EP carved
out of it). In each, two copies of the MoE GPT (4 layers, every MLP an MoE layer with
``--experts`` experts, top-2, a shared expert, the load-balancing loss; fp32, AdamW, micro-batch
4 x sequence 128 per rank): one with hyper-connections (n = 4, ``mhc_block`` recompute), one
without (one stream). A step is forward, backward, the gradient reduction (expert gradients over
the expert-data-parallel ranks) and the AdamW step; steps run round-robin, medians of ``--rounds``.

Per rank, counted from the tensors: the experts' parameter bytes and their AdamW state bytes, as
a fraction of EP 1's (the goal: 1/EP); the step time of each model and their ratio (mHC / no
mHC); tokens per second of the whole group. Writes JSON (default ``benchmarks/results/moe.json``).
"""
from __future__ import annotations

import argparse
import os
import pathlib

import lightning_mhc  # noqa: F401  (before megatron: quiets its Transformer Engine notice)
from _harness import RESULTS, interleaved_times, median, write_json

LAYERS, SEQ, MICRO_BATCH, EP_SIZES = 4, 128, 4, (1, 2, 4)


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _model(args: argparse.Namespace, layout, hyper_connections: bool):
    """``(step, expert parameter bytes, expert optimizer-state bytes)`` of a fresh MoE GPT."""
    import torch

    from lightning_mhc.distributed.grads import finalize_model_grads
    from lightning_mhc.distributed.placement import placement_of
    from lightning_mhc.model import MHCTransformerConfig
    from lightning_mhc.model.config import with_parallel_layout
    from lightning_mhc.distributed.expert_parallel import set_aux_loss_scale, update_expert_biases
    from lightning_mhc.model.stages import build_gpt_chunks
    from lightning_mhc.recompute import RecomputePolicy, attach_recompute

    cfg = MHCTransformerConfig(
        num_layers=LAYERS, hidden_size=args.hidden, num_attention_heads=4, ffn_hidden_size=4 * args.hidden,
        vocab_size=1024, max_sequence_length=SEQ, hidden_dropout=0.0, attention_dropout=0.0, add_bias_linear=False,
        enable_hyper_connections=hyper_connections, num_residual_streams=4 if hyper_connections else 1,
        num_moe_experts=args.experts, moe_router_topk=2, moe_ffn_hidden_size=args.hidden,
        moe_shared_expert_intermediate_size=args.hidden, moe_aux_loss_coeff=0.01)
    cfg = RecomputePolicy("mhc_block" if hyper_connections else "none").apply(with_parallel_layout(cfg, layout))
    (model,) = build_gpt_chunks(cfg, layout)
    attach_recompute(model)
    set_aux_loss_scale(model, layout.data_parallel_size)  # gradients are averaged over DP
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = torch.randint(0, 1024, (MICRO_BATCH, SEQ + 1),
                         generator=torch.Generator().manual_seed(layout.data_parallel_rank))
    tokens, labels = data[:, :-1], data[:, 1:]

    def step() -> None:
        model(tokens, labels=labels).float().mean().backward()
        finalize_model_grads(model, layout)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        update_expert_biases(model)

    step()  # AdamW's state exists after its first step
    experts = [p for p in model.parameters() if placement_of(p).expert]
    state = _nbytes(t for p in experts for t in optimizer.state[p].values()
                    if isinstance(t, torch.Tensor) and t.dim() > 0)
    return step, _nbytes(experts), state


def _run(rank: int, world: int, args: argparse.Namespace, ep: int) -> dict:
    import torch

    from lightning_mhc.distributed.layout import ParallelLayout, destroy_parallel
    from lightning_mhc.distributed.random import model_parallel_manual_seed

    torch.set_num_threads(1)
    layout = ParallelLayout(expert_model_parallel_size=ep).build()
    model_parallel_manual_seed(0, layout)
    variants = {label: _model(args, layout, hc) for label, hc in (("mHC", True), ("no mHC", False))}
    times = interleaved_times({label: step for label, (step, _, _) in variants.items()}, args.rounds, warmup=1)
    destroy_parallel()
    return dict(times=times, expert_bytes=variants["mHC"][1], expert_state_bytes=variants["mHC"][2])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--world", type=int, default=4, help="ranks of every group (EP sizes that divide it run)")
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS / "moe.json")
    args = parser.parse_args()

    from lightning_mhc.testing.launch import spawn_ranks

    rows = []
    for ep in (e for e in EP_SIZES if args.world % e == 0 and args.experts % e == 0):
        per_rank = spawn_ranks(_run, args.world, args, ep, timeout_s=1800)
        step = {label: max(median(r["times"][label]) for r in per_rank) for label in ("mHC", "no mHC")}
        rows.append(dict(ep=ep, expert_bytes=max(r["expert_bytes"] for r in per_rank),
                         expert_state_bytes=max(r["expert_state_bytes"] for r in per_rank),
                         step_s=step, mhc_ratio=step["mHC"] / step["no mHC"],
                         tokens_per_s={label: args.world * MICRO_BATCH * SEQ / s for label, s in step.items()}))
    base = rows[0]
    for row in rows:
        row["expert_bytes_vs_ep1"] = row["expert_bytes"] / base["expert_bytes"]
        row["expert_state_vs_ep1"] = row["expert_state_bytes"] / base["expert_state_bytes"]
    print(f"MoE GPT {LAYERS} layers, hidden {args.hidden}, {args.experts} experts top-2 + a shared expert, "
          f"micro-batch {MICRO_BATCH} x {SEQ} per rank, {args.world} ranks (DP = {args.world}), fp32 AdamW; "
          f"{os.cpu_count()} cores, 1 thread per rank; medians of {args.rounds} interleaved rounds")
    print(f"{'EP':>3} {'expert KiB':>11} {'vs EP 1':>8} {'state KiB':>10} {'vs EP 1':>8} {'mHC ms':>8} "
          f"{'no mHC ms':>10} {'mHC/no':>7} {'tok/s mHC':>10} {'tok/s no':>9}")
    for r in rows:
        print(f"{r['ep']:>3} {r['expert_bytes'] / 1024:>11.1f} {r['expert_bytes_vs_ep1']:>8.3f} "
              f"{r['expert_state_bytes'] / 1024:>10.1f} {r['expert_state_vs_ep1']:>8.3f} "
              f"{1e3 * r['step_s']['mHC']:>8.1f} {1e3 * r['step_s']['no mHC']:>10.1f} {r['mhc_ratio']:>7.3f} "
              f"{r['tokens_per_s']['mHC']:>10.0f} {r['tokens_per_s']['no mHC']:>9.0f}")
    write_json(args.out, dict(cpus=os.cpu_count(), rounds=args.rounds, hidden=args.hidden, experts=args.experts,
                              world=args.world, layers=LAYERS, seq=SEQ, micro_batch=MICRO_BATCH, rows=rows))


if __name__ == "__main__":
    main()
