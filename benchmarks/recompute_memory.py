"""Retained activation bytes and step time of each recompute policy, side by side.

    python benchmarks/recompute_memory.py [--rounds 20] [--dropout 0.1]

Model (issue 3): 8 layers, hidden 128, 4 heads, FFN 512, sequence 64,
micro-batch 4, n = 4 residual streams, fp32; plus the same model without
hyper-connections and without recompute. Bytes are what the autograd graph
holds after one training forward (deterministic). Step time is forward +
backward + AdamW step, measured round-robin over the variants in one process
(so machine noise hits all of them alike); ratios are of medians against
``none``. Writes ``benchmarks/results/recompute_memory.json`` and, when
matplotlib is installed, a PNG beside it.
"""
from __future__ import annotations

import argparse
import os
import pathlib

import lightning_mhc  # noqa: F401  (before megatron: quiets its Transformer Engine notice)
from _harness import RESULTS, gpt_training_step, interleaved_times, median, pyplot, write_json

VARIANTS = [  # (label, recompute policy, hyper-connections)
    ("none", "none", True),
    ("selective", "selective", True),
    ("mhc_block", "mhc_block", True),
    ("full", "full", True),
    ("no_hc_none", "none", False),
]


def _measure(rank: int, world_size: int, args: argparse.Namespace) -> list[dict]:
    import torch

    from lightning_mhc.distributed.layout import ParallelLayout, destroy_parallel

    from lightning_mhc.model import MHCTransformerConfig

    ParallelLayout().build()
    tokens = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(0))
    labels = tokens.roll(-1, 1)
    runs = []
    for label, policy, hc in VARIANTS:
        cfg = MHCTransformerConfig(
            num_layers=8, hidden_size=128, num_attention_heads=4, ffn_hidden_size=512,
            vocab_size=256, max_sequence_length=64,
            hidden_dropout=args.dropout, attention_dropout=args.dropout,
            enable_hyper_connections=hc, num_residual_streams=4 if hc else 1,
        )
        runs.append((label, *gpt_training_step(cfg, policy, tokens, labels)))

    times = interleaved_times({label: step for label, step, _ in runs}, args.rounds)
    destroy_parallel()
    return [
        dict(label=label, retained_bytes=retained, median_step_s=median(times[label]), step_times_s=times[label])
        for label, _, retained in runs
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS / "recompute_memory.json")
    args = parser.parse_args()

    from lightning_mhc.testing.launch import spawn_ranks

    rows = spawn_ranks(_measure, 1, args, timeout_s=1800, threads_per_rank=os.cpu_count() or 1)[0]
    base = next(r for r in rows if r["label"] == "none")
    no_hc = next(r for r in rows if r["label"] == "no_hc_none")
    for r in rows:
        r["bytes_ratio_vs_none"] = r["retained_bytes"] / base["retained_bytes"]
        r["bytes_ratio_vs_no_hc"] = r["retained_bytes"] / no_hc["retained_bytes"]
        r["step_time_ratio_vs_none"] = r["median_step_s"] / base["median_step_s"]

    print(f"retained activation bytes after one training forward (dropout {args.dropout}), "
          f"step time over {args.rounds} interleaved rounds")
    print(f"{'policy':<12} {'bytes':>12} {'vs none':>8} {'vs no-HC':>9} {'step ms':>9} {'time vs none':>13}")
    for r in rows:
        print(f"{r['label']:<12} {r['retained_bytes']:>12,d} {r['bytes_ratio_vs_none']:>8.3f} "
              f"{r['bytes_ratio_vs_no_hc']:>9.3f} {1e3 * r['median_step_s']:>9.1f} "
              f"{r['step_time_ratio_vs_none']:>13.3f}")
    write_json(args.out, dict(dropout=args.dropout, rounds=args.rounds, rows=rows))
    _plot(rows, args.out.with_suffix(".png"))


def _plot(rows: list[dict], path: pathlib.Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    labels = [r["label"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ax1.bar(labels, [r["retained_bytes"] / 2**20 for r in rows])
    ax1.set_ylabel("retained activations (MiB)")
    ax2.bar(labels, [r["step_time_ratio_vs_none"] for r in rows])
    ax2.axhline(1.0, color="gray", linewidth=0.8)
    ax2.set_ylabel("step time / none")
    for ax in (ax1, ax2):
        ax.tick_params(axis="x", rotation=30)
    fig.suptitle("mHC recompute policies: 8 layers, hidden 128, n = 4, fp32")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
