"""mHC on the GPU: one sub-layer per implementation, Megatron-LM's mHC beside ours, and a 4-layer
model's step time, side by side in one process.

    python benchmarks/gpu_mhc.py [--hidden 2048 4096] [--tokens 8192] [--model-hidden 4096]
                                 [--rounds 20] [--megatron-lm DIR] [--out PATH]

1. **Sub-layer** (forward + backward; n = 4, 20 Sinkhorn iterations, dropout 0): the mappings,
   ``H_pre x``, a ``Linear(C, C)`` as the branch F, ``H_res x + H_post^T F``. Variants: ``no_hc``
   (``x + F(x)`` on one stream of width C), this project's ``reference`` (eager op by op),
   ``compile`` (torch.compile of it), ``fused`` (the fused nodes with eager kernels: C++ on CPU),
   ``triton`` (the fused nodes with Triton's kernels), and Megatron-LM's ``HyperConnectionModule``
   eager and compiled (its methods carry ``@torch.compile``; eager runs them with dynamo disabled),
   with its ``fused_h_res_h_post_bda`` as its layers call it. bf16 on the GPU (the mappings in
   fp32 in ours; Megatron's module runs in the model's dtype), fp32 on CPU. Per variant: median
   time of interleaved rounds, the bytes autograd saves per token, and on the GPU the peak memory
   the step allocates beyond its inputs.
2. **Mappings kernel bandwidth** (GPU, Triton): the projection kernel (norm + ``x @ phi``) reads the
   stream once: its effective bandwidth (the bytes the work needs, the stream, ``phi`` and the
   outputs once each, over its time) against the GPU's peak, and what its loads really request
   (``phi`` again for every tile of 128 fp32 / 256 bf16 tokens, the split partial sums:
   ``triton_kernels.projection_bytes``); for a bf16 stream (tf32 products) and an fp32 stream under
   each of torch's fp32 matmul precisions (fp32, tf32x3, tf32 products).
3. **Model**: 4 layers, sequence 2048 x micro-batch 2 on the GPU (128 x 2 on CPU), FFN 4C, AdamW,
   bf16-mixed on the GPU: step time HC / no-HC and ``mhc_block`` / ``none`` with
   ``mhc_implementation=auto``.

Megatron-LM's mHC is in no megatron-core release (up to 0.19.2): the script imports it from
megatron-core when a release has it, else from a Megatron-LM checkout given by ``--megatron-lm``
(its ``megatron/core/transformer/hyper_connection.py`` alone, on the installed megatron-core);
otherwise its columns are marked absent with the reason. On a machine without CUDA the script runs
what runs on CPU and marks the GPU columns (Triton, peak memory, bandwidth) absent. Writes JSON and
a PNG (default ``benchmarks/results/gpu_mhc.json``).
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import pathlib
import sys

import lightning_mhc  # noqa: F401  (before megatron: quiets its Transformer Engine notice)
from _harness import RESULTS, gpt_training_step, interleaved_times, median, pyplot, synchronize, write_json

N, ITERATIONS = 4, 20
SUBLAYER = ("no_hc", "reference", "compile", "fused", "triton", "megatron_eager", "megatron_compiled")
PEAK_BANDWIDTH = {"H200": 4.8e12, "H100 SXM": 3.35e12, "H100 NVL": 3.9e12, "H100 PCIe": 2.0e12, "H100": 3.35e12,
                  "A100-SXM4-80GB": 2.039e12, "A100 80GB PCIe": 1.935e12, "A100": 1.555e12, "L40S": 0.864e12}
"""Peak memory bandwidth (bytes/s) by device name (vendor data sheets), first match wins."""


class Absent(Exception):
    """A variant that cannot run here; its message is the reason the results give."""


def _check_triton_runs(device) -> None:
    """Triton's timings need CUDA and Triton (the interpreter's times on CPU mean nothing)."""
    from lightning_mhc.ops import triton_available

    if device.type != "cuda" or not triton_available():
        raise Absent("needs CUDA and Triton (the interpreter's times on CPU mean nothing)")


# ------------------------------------------------------------------ the variants of one sub-layer
def _ours(hidden: int, tokens: int, implementation: str, device, dtype):
    import torch

    from lightning_mhc.model import MHCTransformerConfig
    from lightning_mhc.layers.bda import h_res_h_post_bias_dropout_add
    from lightning_mhc.layers.hyper_connection import HyperConnectionModule
    from lightning_mhc.layers.init import ParamInit

    if implementation == "triton":
        _check_triton_runs(device)
    cfg = MHCTransformerConfig(num_layers=1, hidden_size=hidden, num_attention_heads=1, num_residual_streams=N,
                               mhc_implementation=implementation)
    hc = HyperConnectionModule(cfg, ParamInit(0, "hc")).to(device)  # the mappings' parameters stay fp32
    branch = torch.nn.Linear(hidden, hidden, device=device, dtype=dtype)
    x = torch.randn(tokens, 1, N * hidden, device=device, dtype=dtype, requires_grad=True)

    def forward():
        aggregated, h_res, h_post = hc(x)
        return h_res_h_post_bias_dropout_add((branch(aggregated), None), x, h_res, h_post, 0.0, True, implementation)

    return forward, x, (hc, branch)


def _no_hc(hidden: int, tokens: int, device, dtype):
    import torch

    branch = torch.nn.Linear(hidden, hidden, device=device, dtype=dtype)
    x = torch.randn(tokens, 1, hidden, device=device, dtype=dtype, requires_grad=True)
    return (lambda: x + branch(x)), x, (branch,)


def _megatron_module(checkout: pathlib.Path | None):
    """Megatron-LM's ``HyperConnectionModule`` class and where it came from, or ``Absent``."""
    if importlib.util.find_spec("megatron.core.transformer.hyper_connection") is not None:
        from megatron.core.transformer.hyper_connection import HyperConnectionModule

        return HyperConnectionModule, "megatron-core"
    if checkout is None:
        raise Absent("no megatron-core release has mHC (up to 0.19.2): give --megatron-lm with a Megatron-LM checkout")
    path = checkout
    if checkout.is_dir():  # a checkout, or a folder holding the module alone (gpu_check's .megatron-lm/)
        path = next((p for p in (checkout / "megatron/core/transformer/hyper_connection.py",
                                 checkout / "hyper_connection.py") if p.is_file()), checkout / "hyper_connection.py")
    if not path.is_file():
        raise Absent(f"{path} not found")
    import megatron.core.tensor_parallel.random as megatron_random

    if not hasattr(megatron_random, "CheckpointWithoutOutputManager"):
        # imported by name for its recompute path (not run here); older megatron-cores lack it
        megatron_random.CheckpointWithoutOutputManager = type("CheckpointWithoutOutputManager", (), {})
    import contextlib

    import torch

    if not torch.cuda.is_available():  # a CPU build of torch has no NVTX; Megatron's ranges only label the timeline
        torch.cuda.nvtx.range = lambda *args, **kwargs: contextlib.nullcontext()
    spec = importlib.util.spec_from_file_location("megatron_lm_hyper_connection", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.HyperConnectionModule, str(path)


def _megatron(hidden: int, tokens: int, compiled: bool, checkout, device, dtype):
    import contextlib

    import torch
    import torch._dynamo
    from megatron.core.transformer import TransformerConfig

    module_class, _ = _megatron_module(checkout)
    cfg = TransformerConfig(num_layers=1, hidden_size=hidden, num_attention_heads=1)
    for name, value in dict(enable_mhc_connections=True, mhc_num_residual_streams=N, mhc_sinkhorn_iterations=ITERATIONS,
                            mhc_init_gating_factor=0.01).items():
        setattr(cfg, name, value)  # the config fields of Megatron-LM main (absent from a release's config)
    hc = module_class(cfg, layer_number=1).to(device=device, dtype=dtype)  # as Megatron's Float16Module runs it
    branch = torch.nn.Linear(hidden, hidden, device=device, dtype=dtype)
    x = torch.randn(tokens, 1, N * hidden, device=device, dtype=dtype, requires_grad=True)

    def forward():
        with contextlib.nullcontext() if compiled else torch._dynamo.config.patch(disable=True):
            aggregated, h_res, h_post = hc(x)
            return hc.fused_h_res_h_post_bda(h_res, x, h_post, (branch(aggregated), None), 0.0, True,
                                             fused=device.type == "cuda")

    return forward, x, (hc, branch)


def _variant(name: str, hidden: int, args, device, dtype):
    if name == "no_hc":
        return _no_hc(hidden, args.tokens, device, dtype)
    if name.startswith("megatron"):
        return _megatron(hidden, args.tokens, name == "megatron_compiled", args.megatron_lm, device, dtype)
    return _ours(hidden, args.tokens, name, device, dtype)


def _sublayer(hidden: int, args, device, dtype) -> dict:
    import torch

    from lightning_mhc.recompute import ActivationMemoryMeter

    steps, rows = {}, {}
    for name in SUBLAYER:
        try:
            forward, x, modules = _variant(name, hidden, args, device, dtype)
        except Absent as why:
            rows[name] = dict(absent=str(why))
            continue
        with ActivationMemoryMeter(*modules) as meter:  # parameters are not activations
            out = forward()
        grad = torch.randn_like(out)
        out.backward(grad)
        rows[name] = dict(saved_bytes_per_token=meter.result.retained_bytes / args.tokens)

        def step(forward=forward, grad=grad, x=x) -> None:
            forward().backward(grad)
            x.grad = None
            synchronize(device)

        step()  # compiles, where it compiles
        if device.type == "cuda":
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            step()
            rows[name]["peak_bytes"] = torch.cuda.max_memory_allocated() - base
        else:
            rows[name]["peak_bytes"] = None  # absent: no allocator statistics on CPU
        steps[name] = step
    times = interleaved_times(steps, args.rounds)
    for name, values in times.items():
        rows[name].update(median_s=median(values), times_s=values)
    return rows


# ------------------------------------------------------------------ the mappings kernel's bandwidth
PROJECTION_VARIANTS = (("bfloat16", "highest"), ("float32", "highest"), ("float32", "high"), ("float32", "medium"))
"""(stream dtype, ``torch.set_float32_matmul_precision``): the bf16 stream's projection on the tensor
cores (tf32), the fp32 stream's at each precision it takes (``triton_kernels.projection_precision``)."""


def _bandwidth(hidden: int, args, device) -> dict:
    """The projection kernel per ``PROJECTION_VARIANTS``: effective bandwidth against the GPU's
    peak, the bytes its loads request, the precision its product ran at."""
    import torch

    try:
        _check_triton_runs(device)
    except Absent as why:
        return dict(absent=str(why))
    from lightning_mhc.ops.triton_kernels import projection, projection_bytes, projection_precision
    from lightning_mhc.testing.precision import float32_matmul_precision

    name = torch.cuda.get_device_name(device)
    peak = next((value for key, value in PEAK_BANDWIDTH.items() if key in name), None)
    phi = torch.randn(N * hidden, N * N + 2 * N, device=device)
    variants = {}
    for dtype_name, matmul_precision in PROJECTION_VARIANTS:
        x = torch.randn(args.tokens, N * hidden, device=device, dtype=getattr(torch, dtype_name))
        with float32_matmul_precision(matmul_precision):
            precision = projection_precision(x.dtype)
            times = interleaved_times({"projection": lambda: (projection(x, phi, 1e-6), synchronize(device))},
                                      args.rounds)
        seconds = median(times["projection"])
        traffic = projection_bytes(args.tokens, N * hidden, N * N + 2 * N, x.element_size())
        moved = traffic["minimum"]  # effective bandwidth: the bytes the work needs over the time it took
        variants[f"{dtype_name}, {precision}"] = dict(
            stream=dtype_name, matmul_precision=matmul_precision, precision=precision,
            median_s=seconds, bytes=moved, bytes_per_s=moved / seconds, peak_bytes_per_s=peak,
            fraction_of_peak=moved / seconds / peak if peak else None, requested_bytes=traffic["requested"],
            requested_bytes_per_s=traffic["requested"] / seconds, phi_share_of_stream=traffic["phi_share"])
    return dict(device=name, variants=variants)


# ------------------------------------------------------------------ the 4-layer model
def _model(args, device) -> dict:
    import torch

    from lightning_mhc.model import MHCTransformerConfig

    seq, batch = (2048, 2) if device.type == "cuda" else (128, 2)
    tokens = torch.randint(0, 256, (batch, seq), generator=torch.Generator().manual_seed(0)).to(device)
    autocast = torch.bfloat16 if device.type == "cuda" else None
    hidden = args.model_hidden
    runs = {}
    for label, hc, policy in (("no_hc", False, "none"), ("hc/none", True, "none"), ("hc/mhc_block", True, "mhc_block")):
        cfg = MHCTransformerConfig(
            num_layers=4, hidden_size=hidden, num_attention_heads=max(2, hidden // 128), ffn_hidden_size=4 * hidden,
            vocab_size=256, max_sequence_length=seq, hidden_dropout=0.0, attention_dropout=0.0,
            enable_hyper_connections=hc, num_residual_streams=N if hc else 1, mhc_implementation="auto")
        runs[label] = gpt_training_step(cfg, policy, tokens, tokens.roll(-1, 1), autocast=autocast)
    times = interleaved_times({k: v[0] for k, v in runs.items()}, args.rounds)
    t = {k: median(v) for k, v in times.items()}
    return dict(hidden=hidden, seq=seq, micro_batch=batch, precision="bf16-mixed" if autocast else "32-true",
                median_step_s=t, retained_bytes={k: v[1] for k, v in runs.items()},
                hc_vs_no_hc=t["hc/none"] / t["no_hc"], mhc_block_vs_none=t["hc/mhc_block"] / t["hc/none"])


def _measure(rank: int, world_size: int, args: argparse.Namespace) -> dict:
    import torch

    from lightning_mhc.distributed.layout import ParallelLayout, destroy_parallel

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    ParallelLayout().build()
    try:
        megatron_source = _megatron_module(args.megatron_lm)[1]
    except Absent as why:
        megatron_source = f"absent: {why}"
    table = {}
    for hidden in args.hidden:
        table[hidden] = dict(sublayer=_sublayer(hidden, args, device, dtype),
                             mappings_bandwidth=_bandwidth(hidden, args, device))
        _print_sublayer(hidden, table[hidden]["sublayer"])
    model = _model(args, device)
    destroy_parallel()
    return dict(device=torch.cuda.get_device_name() if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads",
                dtype=str(dtype).removeprefix("torch."), torch=torch.__version__, megatron_lm=megatron_source,
                table=table, model=model)


def _print_sublayer(hidden: int, rows: dict) -> None:
    for name, row in rows.items():
        if "absent" in row:
            print(f"C = {hidden} {name:<18} absent: {row['absent']}")
        else:
            peak = f"{row['peak_bytes'] / 2**20:,.0f} MiB peak" if row["peak_bytes"] is not None else "peak absent"
            print(f"C = {hidden} {name:<18} {1e3 * row['median_s']:8.2f} ms  {row['saved_bytes_per_token']:>9,.0f} "
                  f"saved B/token  {peak}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--hidden", type=int, nargs="+", default=None, help="default: 2048 4096 on a GPU, 256 on CPU")
    parser.add_argument("--tokens", type=int, default=None, help="default: 8192 on a GPU, 1024 on CPU")
    parser.add_argument("--model-hidden", type=int, default=None, help="default: 4096 on a GPU, 256 on CPU")
    parser.add_argument("--megatron-lm", type=pathlib.Path, default=None,
                        help="a Megatron-LM checkout, its hyper_connection.py, or a folder holding that file alone")
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS / "gpu_mhc.json")
    args = parser.parse_args()
    import torch

    gpu = torch.cuda.is_available()
    args.hidden = args.hidden or ([2048, 4096] if gpu else [256])
    args.tokens = args.tokens or (8192 if gpu else 1024)
    args.model_hidden = args.model_hidden or (4096 if gpu else 256)

    from lightning_mhc.testing.launch import spawn_ranks

    result = spawn_ranks(_measure, 1, args, timeout_s=3600, threads_per_rank=os.cpu_count() or 1)[0]
    _report(result, args)
    write_json(args.out, dict(n=N, sinkhorn_iterations=ITERATIONS, tokens=args.tokens, rounds=args.rounds,
                              **{k: (str(v) if isinstance(v, pathlib.Path) else v) for k, v in result.items()}))
    _plot(result, args.out.with_suffix(".png"), args.tokens)


def _report(result: dict, args) -> None:
    print(f"\n{result['device']}, {result['dtype']}, {args.tokens} tokens, n = {N}, medians of {args.rounds} "
          f"interleaved rounds; Megatron-LM's mHC: {result['megatron_lm']}")
    for hidden, entry in result["table"].items():
        rows = entry["sublayer"]
        triton = rows.get("triton", {}).get("median_s")
        for name, row in rows.items():
            if "median_s" in row:
                row["time_vs_no_hc"] = row["median_s"] / rows["no_hc"]["median_s"]
                if triton and name.startswith("megatron"):
                    row["time_vs_triton"] = row["median_s"] / triton
        ratios = ", ".join(f"{k} {v['time_vs_no_hc']:.2f}x" for k, v in rows.items() if "time_vs_no_hc" in v)
        print(f"C = {hidden}: sub-layer time vs no-HC: {ratios}")
        bandwidth = entry["mappings_bandwidth"]
        if "absent" in bandwidth:
            print(f"C = {hidden}: mappings kernel bandwidth absent ({bandwidth['absent']})")
        for variant in bandwidth.get("variants", {}).values():
            fraction = variant["fraction_of_peak"]
            print(f"C = {hidden}: projection kernel, {variant['stream']} stream, {variant['precision']} products: "
                  f"{variant['bytes_per_s'] / 1e9:,.0f} GB/s effective (the bytes it needs / its time)"
                  + (f" = {fraction:.0%} of {variant['peak_bytes_per_s'] / 1e12:.2f} TB/s peak" if fraction else "")
                  + f"; its loads ask for {variant['requested_bytes'] / variant['bytes']:.2f}x those bytes "
                  f"(phi re-read per tile of tokens: {variant['phi_share_of_stream']:.0%} of the stream's)")
    model = result["model"]
    print(f"model, 4 layers, C = {model['hidden']}, {model['precision']}: HC / no-HC {model['hc_vs_no_hc']:.3f}, "
          f"mhc_block / none {model['mhc_block_vs_none']:.3f}")


def _plot(result: dict, path: pathlib.Path, tokens: int) -> None:
    plt = pyplot()
    if plt is None:
        return
    hiddens = list(result["table"])
    names = [n for n in SUBLAYER if any("median_s" in result["table"][h]["sublayer"][n] for h in hiddens)]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4))
    width = 0.8 / max(len(names), 1)
    for i, name in enumerate(names):
        xs = [j + (i - (len(names) - 1) / 2) * width for j in range(len(hiddens))]
        rows = [result["table"][h]["sublayer"][name] for h in hiddens]
        ax1.bar(xs, [1e3 * r.get("median_s", 0) for r in rows], width, label=name)
        ax2.bar(xs, [r.get("saved_bytes_per_token", 0) / 1024 for r in rows], width, label=name)
    for ax, label in ((ax1, "fwd + bwd time (ms)"), (ax2, "saved by autograd (KiB per token)")):
        ax.set_xticks(range(len(hiddens)), [f"C={h}" for h in hiddens])
        ax.set_ylabel(label)
    ax1.legend(fontsize=8)
    fig.suptitle(f"one mHC sub-layer, {tokens} tokens, n = {N}, {result['dtype']}, {result['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
