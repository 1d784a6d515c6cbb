"""How far the fused hyper-connection is from exact: one hyper-connected sub-layer (n = 4 streams,
20 Sinkhorn iterations, a linear branch with a bias), forward and every gradient, by the fused ops
and by the op-by-op reference at the stream's precision, each against the reference evaluated in
fp64 on the same values (``tests/model_utils.py``: ``errors_against_fp64``; the test suite holds
the fused ops to ``ERROR_FACTOR`` times the reference's error plus ``ERROR_FLOOR``).

    python benchmarks/fp64_accuracy.py [--hidden 4096] [--tokens 8192] [--implementation fused]
                                       [--out PATH]

Cases: fp32 and bf16 streams as they run by default; then the projection's tensor-core precisions
(``triton_kernels.projection_precision``): with ``fused``, its product emulated as the tensor cores
compute it (``tensor_core_projection``: tf32x3 and tf32 on an fp32 stream, tf32 on a bf16 one);
with ``triton`` (on a GPU; on CPU only under ``TRITON_INTERPRET=1``, slowly, and the interpreter
ignores the precision), the kernels under ``torch.set_float32_matmul_precision("high")`` and
``("medium")``, the reference under ``highest``. Writes JSON (default
``benchmarks/results/fp64_accuracy.json``).
"""
from __future__ import annotations

import argparse
import pathlib
import sys

import torch

from _harness import RESULTS, write_json

ROOT = pathlib.Path(__file__).resolve().parents[1]
STREAMS = 4


def cases(implementation: str):
    """``(label, stream dtype, implementation or kernel set, torch's fp32 matmul precision)``."""
    from model_utils import tensor_core_projection

    yield "float32", torch.float32, implementation, "highest"
    yield "bfloat16", torch.bfloat16, implementation, "highest"
    if implementation == "triton":  # the projection takes its precision from torch's setting
        yield "float32, matmul high (projection tf32x3)", torch.float32, implementation, "high"
        yield "float32, matmul medium (projection tf32)", torch.float32, implementation, "medium"
    else:
        for dtype, precision in ((torch.float32, "tf32x3"), (torch.float32, "tf32"), (torch.bfloat16, "tf32")):
            yield (f"{str(dtype).removeprefix('torch.')}, projection {precision} (emulated)", dtype,
                   tensor_core_projection(precision), "highest")


def measure(implementation, hidden: int, tokens: int, dtype: torch.dtype, device: str, matmul_precision: str) -> dict:
    from model_utils import errors_against_fp64, hc_sublayer_inputs

    inputs, upstream = hc_sublayer_inputs(tokens, STREAMS, hidden, dtype, device)
    errors = errors_against_fp64(implementation, inputs, upstream, STREAMS, iterations=20,
                                 matmul_precision=matmul_precision)
    return {name: dict(ours=ours, reference=reference) for name, (ours, reference) in errors.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--implementation", choices=["fused", "triton"], default="fused")
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS / "fp64_accuracy.json")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "tests"))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    result = dict(hidden=args.hidden, tokens=args.tokens, streams=STREAMS, sinkhorn_iterations=20, device=device,
                  implementation=args.implementation, torch=torch.__version__, errors={})
    for label, dtype, implementation, matmul_precision in cases(args.implementation):
        errors = measure(implementation, args.hidden, args.tokens, dtype, device, matmul_precision)
        result["errors"][label] = errors
        print(f"{label}: error against fp64, ours (torch matmul precision {matmul_precision}) / op-by-op reference")
        for name, e in errors.items():
            print(f"  {name:12s} {e['ours']:.2e} / {e['reference']:.2e}  ratio {e['ours'] / e['reference']:.2f}")
    write_json(args.out, result)


if __name__ == "__main__":
    main()
