"""End-to-end cost of mHC: step time and retained bytes with and without hyper-connections.

    python benchmarks/mhc_overhead.py [--rounds 15] [--hidden 128 512 1024] [--out PATH]

Model: 4 layers, sequence 128, micro-batch 2, FFN 4C, head dim 64 (at least 2
heads), n = 4 streams, fp32, dropout 0, AdamW; one process. For each hidden
size C it builds the model without hyper-connections and, with them, under
recompute policies ``none`` and ``mhc_block`` for both implementations
(``mhc_implementation`` = reference, fused). A step is forward + backward +
AdamW step; all variants of one C run round-robin in one process, and ratios
are of medians. Retained bytes are what the autograd graph holds after one
training forward (deterministic). Writes JSON and a PNG (default
``benchmarks/results/mhc_overhead.json``).
"""
from __future__ import annotations

import argparse
import os
import pathlib

import lightning_mhc  # noqa: F401  (before megatron: quiets its Transformer Engine notice)
from _harness import RESULTS, gpt_training_step, interleaved_times, median, pyplot, write_json

LAYERS, SEQ, MICRO_BATCH, N = 4, 128, 2, 4
VARIANTS = [  # (label, hyper-connections, implementation, recompute policy)
    ("no_hc", False, "auto", "none"),
    ("reference/none", True, "reference", "none"),
    ("reference/mhc_block", True, "reference", "mhc_block"),
    ("fused/none", True, "fused", "none"),
    ("fused/mhc_block", True, "fused", "mhc_block"),
]


def _measure(rank: int, world_size: int, args: argparse.Namespace) -> dict:
    import torch

    from lightning_mhc.distributed.layout import ParallelLayout, destroy_parallel

    from lightning_mhc.model import MHCTransformerConfig

    ParallelLayout().build()
    tokens = torch.randint(0, 256, (MICRO_BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    labels = tokens.roll(-1, 1)
    table = {}
    for hidden in args.hidden:
        runs = {}
        for label, hc, impl, policy in VARIANTS:
            cfg = MHCTransformerConfig(
                num_layers=LAYERS, hidden_size=hidden, num_attention_heads=max(2, hidden // 64),
                ffn_hidden_size=4 * hidden, vocab_size=256, max_sequence_length=SEQ,
                hidden_dropout=0.0, attention_dropout=0.0, enable_hyper_connections=hc,
                num_residual_streams=N if hc else 1, mhc_implementation=impl,
            )
            runs[label] = gpt_training_step(cfg, policy, tokens, labels)
        times = interleaved_times({k: v[0] for k, v in runs.items()}, args.rounds)
        table[hidden] = {label: dict(retained_bytes=runs[label][1], median_step_s=median(times[label]),
                                     step_times_s=times[label]) for label in runs}
        _print_one(hidden, table[hidden])
    destroy_parallel()
    return dict(threads=torch.get_num_threads(), torch=torch.__version__, table=table)


def _ratios(row: dict) -> dict:
    t = {k: v["median_step_s"] for k, v in row.items()}
    b = {k: v["retained_bytes"] for k, v in row.items()}
    out = {}
    for impl in ("reference", "fused"):
        out[impl] = dict(
            hc_vs_no_hc_time=t[f"{impl}/none"] / t["no_hc"],
            block_vs_none_time=t[f"{impl}/mhc_block"] / t[f"{impl}/none"],
            hc_vs_no_hc_bytes=b[f"{impl}/none"] / b["no_hc"],
            block_vs_no_hc_bytes=b[f"{impl}/mhc_block"] / b["no_hc"],
        )
    return out


def _print_one(hidden: int, row: dict) -> None:
    print(f"C = {hidden}: " + ", ".join(f"{k} {1e3 * v['median_step_s']:.1f} ms" for k, v in row.items()), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--hidden", type=int, nargs="+", default=[128, 512, 1024])
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS / "mhc_overhead.json")
    args = parser.parse_args()

    from lightning_mhc.testing.launch import spawn_ranks

    result = spawn_ranks(_measure, 1, args, timeout_s=3600, threads_per_rank=os.cpu_count() or 1)[0]
    print(f"\n{LAYERS} layers, seq {SEQ}, micro-batch {MICRO_BATCH}, n = {N}, fp32, dropout 0, "
          f"{result['threads']} threads, medians of {args.rounds} interleaved rounds")
    print(f"{'C':>5} {'impl':<10} {'HC/no-HC time':>14} {'mhc_block/none':>15} {'HC/no-HC bytes':>15} "
          f"{'mhc_block/no-HC bytes':>22}")
    for hidden, row in result["table"].items():
        ratios = _ratios(row)
        row["ratios"] = ratios
        for impl, r in ratios.items():
            print(f"{hidden:>5} {impl:<10} {r['hc_vs_no_hc_time']:>14.3f} {r['block_vs_none_time']:>15.3f} "
                  f"{r['hc_vs_no_hc_bytes']:>15.3f} {r['block_vs_no_hc_bytes']:>22.3f}")
    write_json(args.out, dict(layers=LAYERS, seq=SEQ, micro_batch=MICRO_BATCH, n=N, rounds=args.rounds, **result))
    _plot(result, args.out.with_suffix(".png"))


def _plot(result: dict, path: pathlib.Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    hiddens = list(result["table"])
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    panels = [("hc_vs_no_hc_time", "step time, HC / no HC (none)"),
              ("block_vs_none_time", "step time, mhc_block / none"),
              ("hc_vs_no_hc_bytes", "retained bytes, HC / no HC (none)")]
    width = 0.38
    for ax, (key, title) in zip(axes, panels):
        for i, impl in enumerate(("reference", "fused")):
            values = [result["table"][h]["ratios"][impl][key] for h in hiddens]
            ax.bar([j + (i - 0.5) * width for j in range(len(hiddens))], values, width, label=impl)
        ax.axhline(1.0, color="gray", linewidth=0.8)
        ax.set_xticks(range(len(hiddens)), [f"C={h}" for h in hiddens])
        ax.set_title(title, fontsize=10)
    axes[0].legend()
    fig.suptitle(f"mHC overhead: {LAYERS} layers, seq {SEQ}, micro-batch {MICRO_BATCH}, n = {N}, fp32, "
                 f"CPU {result['threads']} threads")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
