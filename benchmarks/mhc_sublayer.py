"""One hyper-connected sub-layer, forward + backward: this project's reference and fused
paths against the ``hyper-connections`` package (PyPI), side by side.

    python benchmarks/mhc_sublayer.py [--rounds 15] [--hidden 256 1024 2048] [--tokens 2048]

The sub-layer is what mHC wraps around one attention or MLP block: mappings
(H_pre, H_post, H_res with 20 Sinkhorn iterations), aggregate ``H_pre @ x``,
``H_res @ x``, a ``Linear(C, C)`` as the branch F, ``H_post^T F`` and the
residual add (dropout 0), on ``tokens`` tokens of n = 4 streams, fp32, in one
process. Peer: ``hyper_connections.ManifoldConstrainedHyperConnections(4,
dim=C, branch=Linear, sinkhorn_iters=20)`` (it normalises each stream on its
own, where the paper and this project normalise the flattened n*C stream; the
work per token is otherwise the same). Times are medians over interleaved
rounds; saved bytes are the storages the autograd graph holds after the
forward (parameters excluded, the input stream included), per token. Writes JSON and a PNG
(default ``benchmarks/results/mhc_sublayer.json``).
"""
from __future__ import annotations

import argparse
import os
import pathlib

import lightning_mhc  # noqa: F401  (before megatron: quiets its Transformer Engine notice)
from _harness import RESULTS, interleaved_times, median, pyplot, sublayer_step, write_json

N = 4
IMPLEMENTATIONS = ("reference", "fused", "hyper-connections")


def _ours(hidden: int, tokens: int, implementation: str):
    import torch

    from lightning_mhc.model import MHCTransformerConfig
    from lightning_mhc.layers.bda import h_res_h_post_bias_dropout_add
    from lightning_mhc.layers.hyper_connection import HyperConnectionModule
    from lightning_mhc.layers.init import ParamInit

    cfg = MHCTransformerConfig(num_layers=1, hidden_size=hidden, num_attention_heads=1, num_residual_streams=N,
                               mhc_implementation=implementation)
    hc = HyperConnectionModule(cfg, ParamInit(0, "hc"))
    branch = torch.nn.Linear(hidden, hidden)
    x = torch.randn(tokens, 1, N * hidden, requires_grad=True)

    def forward():
        aggregated, h_res, h_post = hc(x)
        return h_res_h_post_bias_dropout_add((branch(aggregated), None), x, h_res, h_post, 0.0, True, implementation)

    return forward, x, (hc, branch)


def _peer(hidden: int, tokens: int):
    import torch
    from hyper_connections import ManifoldConstrainedHyperConnections

    hc = ManifoldConstrainedHyperConnections(N, dim=hidden, branch=torch.nn.Linear(hidden, hidden), sinkhorn_iters=20)
    x = torch.randn(N, tokens, hidden, requires_grad=True)  # '(batch streams) tokens dim'
    return (lambda: hc(x)), x, (hc,)


def _measure(rank: int, world_size: int, args: argparse.Namespace) -> dict:
    import torch

    table = {}
    for hidden in args.hidden:
        steps, saved = {}, {}
        for impl in IMPLEMENTATIONS:
            steps[impl], retained = sublayer_step(*(_peer(hidden, args.tokens) if impl == "hyper-connections"
                                                    else _ours(hidden, args.tokens, impl)))
            saved[impl] = retained / args.tokens
        times = interleaved_times(steps, args.rounds)
        table[hidden] = {impl: dict(median_s=median(times[impl]), saved_bytes_per_token=saved[impl], times_s=times[impl])
                         for impl in IMPLEMENTATIONS}
        print(f"C = {hidden}: " + ", ".join(f"{k} {1e3 * v['median_s']:.2f} ms, {v['saved_bytes_per_token']:,.0f} B/token"
                                           for k, v in table[hidden].items()), flush=True)
    return dict(threads=torch.get_num_threads(), torch=torch.__version__, table=table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--hidden", type=int, nargs="+", default=[256, 1024, 2048])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS / "mhc_sublayer.json")
    args = parser.parse_args()

    from lightning_mhc.testing.launch import spawn_ranks

    result = spawn_ranks(_measure, 1, args, timeout_s=3600, threads_per_rank=os.cpu_count() or 1)[0]
    print(f"\nsub-layer fwd + bwd, {args.tokens} tokens, n = {N}, fp32, {result['threads']} threads, "
          f"medians of {args.rounds} interleaved rounds")
    print(f"{'C':>5} {'implementation':<18} {'ms':>9} {'saved B/token':>14} {'time vs fused':>14}")
    for hidden, row in result["table"].items():
        for impl, r in row.items():
            r["time_vs_fused"] = r["median_s"] / row["fused"]["median_s"]
            print(f"{hidden:>5} {impl:<18} {1e3 * r['median_s']:>9.2f} {r['saved_bytes_per_token']:>14,.0f} "
                  f"{r['time_vs_fused']:>14.2f}")
    write_json(args.out, dict(n=N, tokens=args.tokens, rounds=args.rounds, **result))
    _plot(result, args.out.with_suffix(".png"), args.tokens)


def _plot(result: dict, path: pathlib.Path, tokens: int) -> None:
    plt = pyplot()
    if plt is None:
        return
    hiddens = list(result["table"])
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.27
    for i, impl in enumerate(IMPLEMENTATIONS):
        xs = [j + (i - 1) * width for j in range(len(hiddens))]
        ax1.bar(xs, [1e3 * result["table"][h][impl]["median_s"] for h in hiddens], width, label=impl)
        ax2.bar(xs, [result["table"][h][impl]["saved_bytes_per_token"] / 1024 for h in hiddens], width, label=impl)
    for ax, label in ((ax1, "fwd + bwd time (ms)"), (ax2, "saved by autograd (KiB per token)")):
        ax.set_xticks(range(len(hiddens)), [f"C={h}" for h in hiddens])
        ax.set_ylabel(label)
    ax1.legend()
    fig.suptitle(f"one mHC sub-layer (Linear branch), {tokens} tokens, n = {N}, fp32, CPU {result['threads']} threads")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
