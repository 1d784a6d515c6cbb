"""DeepSeek-V4's and HY-V4's hyper-connection sub-layers on this project's kernels against
transformers' own modules, side by side in one run: time (forward + backward) and the bytes
autograd saves.

    python benchmarks/v4_hyper_connection.py [--rounds 10] [--hidden 1024 4096] [--tokens 1024]
                                             [--implementations fused reference] [--device cpu]
                                             [--out PATH]

The sub-layer is one branch of a V4 decoder layer as transformers writes it: ``attn_hc`` (the
norm, the projection ``fn``, ``pre``/``post``/``comb`` with 20 Sinkhorn iterations, the collapse),
a ``Linear(D, D)`` as the branch, and the layer's ``post ⊗ F + comb^T x``; n = 4 streams, fp32,
the modules' parameters moved away from their init (tests/v4_utils.py). "transformers" runs
transformers' ``DeepseekV4HyperConnection`` and the decoder layer's mix as written; the others run
the same module after ``lightning_mhc.ops.deepseek_v4.use_our_ops(module, implementation)`` with
the mix on our kernels (``fused``: the C++ kernels on CPU, the eager set elsewhere; ``auto``:
Triton's on CUDA; ``reference`` and ``compile``: the op-by-op math). Saved bytes: the storages the
autograd graph holds after the forward, parameters excluded, the input stream included
(``ActivationMemoryMeter``), per token. Times: medians of interleaved rounds. Also prints how far
the two conventions' ``H_res`` are apart at three logit scales (the figures in
``lightning_mhc/ops/sinkhorn.py``'s docstring). HY-V4's sub-layer (``hy_v4_table``): its
``HYV4HyperConnection`` (gates only, no Sinkhorn), the same branch and the layer's ``post ⊗ F + x``
(transformers' line on both sides: only the connection runs on our ops). Writes JSON (default
``benchmarks/results/v4_hyper_connection.json``).
"""
from __future__ import annotations

import argparse
import os
import pathlib
import sys

import lightning_mhc  # noqa: F401  (before megatron: quiets its Transformer Engine notice)
from _harness import RESULTS, interleaved_times, median, sublayer_step, write_json

ROOT = pathlib.Path(__file__).resolve().parents[1]
N = 4


def _sublayer(hidden: int, tokens: int, implementation: str, device: str):
    import torch

    sys.path.insert(0, str(ROOT / "tests"))
    from v4_utils import ours_of, v4_modules

    modules = v4_modules(hidden=hidden, n=N, device=device)
    hc, _, branch = modules if implementation == "transformers" else ours_of(modules, implementation)
    x = torch.randn(1, tokens, N, hidden, device=device, requires_grad=True)

    if implementation == "transformers":
        def forward():
            post, comb, collapsed = hc(x)
            out = branch(collapsed)
            return post.unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.transpose(-1, -2), x)
    else:
        from lightning_mhc.ops.deepseek_v4 import deepseek_v4_res_post

        def forward():
            post, comb, collapsed = hc(x)
            return deepseek_v4_res_post(x, post, comb, branch(collapsed), implementation)

    return forward, x, (hc, branch)


def _hy_v4_sublayer(hidden: int, tokens: int, implementation: str, device: str):
    """HY-V4's ``attn_hc`` (``fn`` at std 0.02, ``base`` and ``scale`` drawn around their init), a
    ``Linear(D, D)`` branch and the decoder layer's ``post ⊗ F + x``."""
    import torch
    from transformers import HYV4Config
    from transformers.models.hy_v4.modeling_hy_v4 import HYV4HyperConnection

    from lightning_mhc.ops.deepseek_v4 import use_our_ops

    g = torch.Generator().manual_seed(0)
    hc = HYV4HyperConnection(HYV4Config(hidden_size=hidden, hc_mult=N, num_hidden_layers=1))
    branch = torch.nn.Linear(hidden, hidden, bias=False)
    with torch.no_grad():
        hc.fn.copy_(torch.randn(hc.fn.shape, generator=g) * 0.02)
        hc.base.copy_(torch.randn(hc.base.shape, generator=g) * 0.5)
        hc.scale.copy_(1.0 + 0.1 * torch.randn(2, generator=g))
        branch.weight.copy_(torch.randn(branch.weight.shape, generator=g) / hidden ** 0.5)
    hc, branch = hc.to(device), branch.to(device)
    if implementation != "transformers":
        use_our_ops(hc, implementation)
    x = torch.randn(1, tokens, N, hidden, device=device, requires_grad=True)

    def forward():
        post, collapsed = hc(x)
        return post.unsqueeze(-1) * branch(collapsed).unsqueeze(-2) + x

    return forward, x, (hc, branch)


def _timed_table(sublayer, hiddens, tokens: int, variants, rounds: int, device) -> dict:
    """``{D: {variant: median_s, saved_bytes_per_token, times_s, and both against transformers'}}``."""
    table = {}
    for hidden in hiddens:
        steps, saved = {}, {}
        for variant in variants:
            steps[variant], retained = sublayer_step(*sublayer(hidden, tokens, variant, device.type), device)
            saved[variant] = retained / tokens
        times = interleaved_times(steps, rounds)
        table[hidden] = {v: dict(median_s=median(times[v]), saved_bytes_per_token=saved[v], times_s=times[v])
                         for v in variants}
        for v in variants:
            table[hidden][v]["time_vs_transformers"] = table[hidden][v]["median_s"] / table[hidden]["transformers"]["median_s"]
            table[hidden][v]["saved_vs_transformers"] = saved[v] / saved["transformers"]
    return table


def _print_table(title: str, table: dict) -> None:
    print(title)
    print(f"{'D':>5} {'implementation':<14} {'ms':>9} {'vs transformers':>16} {'saved B/token':>14} {'vs transformers':>16}")
    for hidden, row in table.items():
        for v, r in row.items():
            print(f"{hidden:>5} {v:<14} {1e3 * r['median_s']:>9.2f} {r['time_vs_transformers']:>16.2f} "
                  f"{r['saved_bytes_per_token']:>14,.0f} {r['saved_vs_transformers']:>16.2f}")


def sinkhorn_conventions(tokens: int = 4096) -> list[dict]:
    """How far ``H_res`` moves between the conventions on the same logits (20 iterations): the
    rows-first order without the transpose (fp32), with it (fp64: the same computation, so only
    rounding is left, and fp32's rounding depends on how the CPU sums four numbers: 0 on one
    machine, 4e-5 on another), and V4's eps floors (fp32)."""
    import torch

    from lightning_mhc.ops.sinkhorn import sinkhorn_knopp

    def rows_first(logits):
        p = torch.exp(logits - logits.amax(dim=(-2, -1), keepdim=True))
        for _ in range(20):
            p = p / p.sum(-1, keepdim=True).clamp_min(1e-6)
            p = p / p.sum(-2, keepdim=True).clamp_min(1e-6)
        return p

    g = torch.Generator().manual_seed(0)
    rows = []
    for scale in (1.0, 5.0, 25.0):
        logits = torch.randn(tokens, N, N, generator=g) * scale
        ours = sinkhorn_knopp(logits, 20)
        v4 = (ours - sinkhorn_knopp(logits.mT, 20, 1e-6, "deepseek_v4")).abs().amax(dim=(1, 2))
        rows.append(dict(logit_std=scale, without_transpose=(ours - rows_first(logits)).abs().max().item(),
                         with_transpose=(sinkhorn_knopp(logits.double(), 20)
                                         - rows_first(logits.double().mT).mT).abs().max().item(),
                         eps_floors_max=v4.max().item(), eps_floors_median=v4.median().item()))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--hidden", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--implementations", nargs="+", default=None,
                        help="ours, beside transformers (default: fused and reference; auto and compile on CUDA)")
    parser.add_argument("--device", default="cuda" if _cuda() else "cpu")
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS / "v4_hyper_connection.json")
    args = parser.parse_args()

    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    ours = args.implementations or (["auto", "compile", "fused"] if args.device == "cuda" else ["fused", "reference"])
    variants = ["transformers", *ours]
    device = torch.device(args.device)
    table = _timed_table(_sublayer, args.hidden, args.tokens, variants, args.rounds, device)
    hy_v4_table = _timed_table(_hy_v4_sublayer, args.hidden, args.tokens, variants, args.rounds, device)
    where = (torch.cuda.get_device_name() if args.device == "cuda" else f"CPU, {torch.get_num_threads()} threads")
    setting = f"{args.tokens} tokens, n = {N}, fp32, {where}, medians of {args.rounds} interleaved rounds"
    _print_table(f"V4 hyper-connection sub-layer fwd + bwd, {setting}", table)
    _print_table(f"\nHY-V4 hyper-connection sub-layer fwd + bwd, {setting}", hy_v4_table)
    conventions = sinkhorn_conventions()
    print("\nH_res, mHC against the rows-first order / V4's convention on the same logits (max |difference|, "
          "20 iterations, 4096 tokens)")
    print(f"{'logits':>12} {'no transpose':>13} {'transpose':>10} {'V4 floors max':>14} {'median':>8}")
    for r in conventions:
        print(f"{'N(0, %g^2)' % r['logit_std']:>12} {r['without_transpose']:>13.1e} {r['with_transpose']:>10.1e} "
              f"{r['eps_floors_max']:>14.2f} {r['eps_floors_median']:>8.1e}")
    write_json(args.out, dict(n=N, tokens=args.tokens, rounds=args.rounds, device=where, torch=torch.__version__,
                              table=table, hy_v4_table=hy_v4_table, sinkhorn_conventions=conventions))


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    main()
