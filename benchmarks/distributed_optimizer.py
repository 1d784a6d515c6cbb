"""Per-rank memory and step time with and without the distributed optimizer (ZeRO-1), DP 1, 2, 4.

    python benchmarks/distributed_optimizer.py [--rounds 5] [--hidden 256] [--vocab 8192] [--out PATH]

One spawned gloo group per DP size (one thread per rank). In each, two copies of the same GPT
model (4 layers, n = 4, fp32, AdamW, clipping at 1.0, micro-batch 4 x sequence 128 per rank): one
stepped by ``torch.optim.AdamW`` after the DP all-reduce, one by the same AdamW under
``DistributedOptimizer`` (reduce-scatter, step on 1/DP, all-gather). Steps run round-robin, medians
of ``--rounds``.

Per rank, in bytes (deterministic: counted from the tensors, not a process's resident size, which
holds both copies here): weights, gradients (ZeRO-1 keeps whole gradients, in its buckets' fp32
buffers; the reduced shard is counted with them), optimizer state, the activations one forward
keeps for backward, and their sum. The distributed optimizer's state is compared with the ideal,
the undistributed state / DP.

Then the peak, measured: at the largest DP (4) each variant alone in a fresh group, each rank's
anonymous resident memory (sampled every millisecond; allocations of 64 KiB and up unmapped when
freed, so that it follows the tensors alive) above its level before the model was built, at the
peak of the first step and of the 3 steps after it: everything a step holds, transient copies
included (the plain path's flat all-reduce buffer, the distributed optimizer's reduced shards and
its all-gather).

Writes JSON and a PNG (default ``benchmarks/results/distributed_optimizer.json``).
"""
from __future__ import annotations

import argparse
import os
import pathlib

import lightning_mhc  # noqa: F401  (before megatron: quiets its Transformer Engine notice)
from _harness import RESULTS, PeakGrowth, interleaved_times, median, pyplot, resident_mib, save_figure, write_json

LAYERS, SEQ, MICRO_BATCH, DP_SIZES, PEAK_STEPS = 4, 128, 4, (1, 2, 4), 3


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _variant(args: argparse.Namespace, layout, zero: bool):
    """``(step, bytes)``: one training step of a fresh model, and its per-rank byte counts."""
    import torch

    from lightning_mhc.distributed.grads import clip_grad_norm_, finalize_model_grads
    from lightning_mhc.distributed.optimizer import DistributedOptimizer, optimizer_state_bytes
    from lightning_mhc.model import MHCTransformerConfig
    from lightning_mhc.model.stages import build_gpt_chunks
    from lightning_mhc.recompute import ActivationMemoryMeter

    torch.manual_seed(0)
    cfg = MHCTransformerConfig(num_layers=LAYERS, hidden_size=args.hidden, num_attention_heads=4,
                               ffn_hidden_size=4 * args.hidden, vocab_size=args.vocab, max_sequence_length=SEQ,
                               hidden_dropout=0.0, attention_dropout=0.0)
    (model,) = build_gpt_chunks(cfg, layout)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    taken = DistributedOptimizer(optimizer, [model], layout) if zero else None
    rank = layout.data_parallel_rank
    data = torch.randint(0, args.vocab, (MICRO_BATCH, SEQ + 1), generator=torch.Generator().manual_seed(rank))
    tokens, labels = data[:, :-1], data[:, 1:]
    counted: dict[str, int] = {}

    def step() -> None:
        model(tokens, labels=labels).float().mean().backward()
        if taken is not None:
            taken.reduce_gradients()
            taken.clip_grad_norm(1.0)
            grads = [b.buffer for b in taken.buckets] + [b.grad for b in taken.buckets if b.parts > 1]
        else:
            finalize_model_grads(model, layout)
            clip_grad_norm_([p for p in model.parameters() if p.grad is not None], 1.0, layout)
            grads = [p.grad for p in model.parameters() if p.grad is not None]
        counted.setdefault("gradients", _nbytes(grads))
        optimizer.step()
        if taken is not None:
            taken.finish_step()
        optimizer.zero_grad(set_to_none=True)

    with ActivationMemoryMeter(model) as meter:
        loss = model(tokens, labels=labels).float().mean()
    del loss
    step()  # the optimizer's state exists after its first step
    state = taken.state_bytes() if taken is not None else optimizer_state_bytes(optimizer)
    counted.update(weights=_nbytes(model.parameters()), optimizer_state=state,
                   activations=meter.result.retained_bytes)
    counted["total"] = sum(counted[k] for k in ("weights", "gradients", "optimizer_state", "activations"))
    return step, counted


def _run(rank: int, world: int, args: argparse.Namespace) -> dict:
    import torch

    from lightning_mhc.distributed.layout import ParallelLayout, destroy_parallel
    from lightning_mhc.distributed.random import model_parallel_manual_seed

    torch.set_num_threads(1)
    layout = ParallelLayout().build()  # DP = world
    model_parallel_manual_seed(0, layout)
    variants = {label: _variant(args, layout, zero) for label, zero in (("AdamW", False), ("distributed", True))}
    times = interleaved_times({label: step for label, (step, _) in variants.items()}, args.rounds, warmup=1)
    destroy_parallel()
    return dict(times=times, bytes={label: counted for label, (_, counted) in variants.items()})


def _peak(rank: int, world: int, args: argparse.Namespace, zero: bool) -> dict:
    """MiB of this rank's anonymous resident memory above its level before the model was built:
    at the peak of the first step, and at the peak of the ``PEAK_STEPS`` steps after it (the
    optimizer's state exists from the first step on)."""
    import ctypes

    import torch

    from lightning_mhc.distributed.layout import ParallelLayout, destroy_parallel
    from lightning_mhc.distributed.random import model_parallel_manual_seed

    # glibc keeps freed memory for reuse (the resident size would show a high-water mark of its
    # own): allocations of 64 KiB and up are mapped and unmapped on free, so the resident size
    # follows the tensors alive
    ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD
    torch.set_num_threads(1)
    layout = ParallelLayout().build()
    model_parallel_manual_seed(0, layout)
    base = resident_mib()[0]
    with PeakGrowth() as first:
        step, _ = _variant(args, layout, zero)  # built, and one step
    with PeakGrowth() as steady:
        for _ in range(PEAK_STEPS):
            step()
    destroy_parallel()
    return dict(first_step=first.anon_mib, steady=steady.start[0] - base + steady.anon_mib)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--dp", type=int, nargs="+", default=list(DP_SIZES), help="the DP sizes to run")
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS / "distributed_optimizer.json")
    args = parser.parse_args()

    from lightning_mhc.testing.launch import spawn_ranks

    rows = []
    for dp in args.dp:
        per_rank = spawn_ranks(_run, dp, args, timeout_s=1800)
        for label in ("AdamW", "distributed"):
            counted = [r["bytes"][label] for r in per_rank]
            rows.append(dict(dp=dp, optimizer=label, step_s=median(per_rank[0]["times"][label]),
                             per_rank_bytes=counted, max_rank=max(counted, key=lambda c: c["total"])))
    for row in rows:
        plain = next(r for r in rows if r["dp"] == row["dp"] and r["optimizer"] == "AdamW")
        ideal = plain["max_rank"]["optimizer_state"] / row["dp"]
        row["state_vs_ideal"] = row["max_rank"]["optimizer_state"] / ideal if row["optimizer"] == "distributed" else None
        row["step_vs_adamw"] = row["step_s"] / plain["step_s"]

    peak_dp = max(args.dp)
    peak = {label: spawn_ranks(_peak, peak_dp, args, zero, timeout_s=1800)
            for label, zero in (("AdamW", False), ("distributed", True))}
    mib = 2**20
    print(f"GPT {LAYERS} layers, hidden {args.hidden}, vocab {args.vocab}, micro-batch {MICRO_BATCH} x {SEQ} per rank, "
          f"fp32 AdamW; {os.cpu_count()} cores, 1 thread per rank; medians of {args.rounds} interleaved rounds")
    print(f"{'DP':>3} {'optimizer':<12} {'weights':>8} {'grads':>8} {'state':>8} {'activ.':>8} {'total MiB':>10} "
          f"{'state/ideal':>12} {'step ms':>9} {'vs AdamW':>9}")
    for r in rows:
        b = r["max_rank"]
        ideal = f"{r['state_vs_ideal']:.4f}" if r["state_vs_ideal"] is not None else "-"
        print(f"{r['dp']:>3} {r['optimizer']:<12} {b['weights'] / mib:>8.2f} {b['gradients'] / mib:>8.2f} "
              f"{b['optimizer_state'] / mib:>8.2f} {b['activations'] / mib:>8.2f} {b['total'] / mib:>10.2f} "
              f"{ideal:>12} {1e3 * r['step_s']:>9.1f} {r['step_vs_adamw']:>9.3f}")
    largest = {label: {when: max(rank[when] for rank in ranks) for when in ("first_step", "steady")}
               for label, ranks in peak.items()}
    ratio = largest["distributed"]["steady"] / largest["AdamW"]["steady"]
    print(f"peak anonymous resident memory above the level before the build, DP {peak_dp}, largest rank: "
          f"AdamW {largest['AdamW']['steady']:.1f} MiB, distributed {largest['distributed']['steady']:.1f} MiB "
          f"(ratio {ratio:.3f}) in steps 2-{PEAK_STEPS + 1}; the first step (no optimizer state before it): "
          f"{largest['AdamW']['first_step']:.1f} and {largest['distributed']['first_step']:.1f} MiB")
    write_json(args.out, dict(cpus=os.cpu_count(), rounds=args.rounds, hidden=args.hidden, vocab=args.vocab,
                              layers=LAYERS, seq=SEQ, micro_batch=MICRO_BATCH, rows=rows,
                              peak_resident_mib=dict(dp=peak_dp, steps=PEAK_STEPS, per_rank=peak, largest=largest,
                                                     steady_ratio=ratio)))
    plt = pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(6, 3.6))
        parts = ("weights", "gradients", "optimizer_state", "activations")
        labels = [f"DP {r['dp']}\n{'ZeRO-1' if r['optimizer'] == 'distributed' else 'AdamW'}" for r in rows]
        bottom = [0.0] * len(rows)
        for part in parts:
            values = [r["max_rank"][part] / mib for r in rows]
            ax.bar(labels, values, bottom=bottom, label=part.replace("_", " "))
            bottom = [b + v for b, v in zip(bottom, values)]
        ax.set_ylabel("MiB per rank (largest rank)")
        ax.set_title("Per-rank memory with and without the distributed optimizer")
        ax.legend(fontsize=7)
        save_figure(fig, args.out.with_suffix(".png"))


if __name__ == "__main__":
    main()
