"""Compile the Triton kernels of lightning_mhc ahead of time, on a machine without a GPU: Triton's
frontend, MLIR, LLVM, PTX and ptxas, over the variants the code can launch: n = 2, 3, 4, 6 and 8
(6 pads to 8), fp32, bf16 and fp16 streams, a bf16 or fp16 sub-layer output on an fp32 stream
(bf16-mixed: the stream stays fp32), the bias/dropout variants, the projection at each precision it
can take (``projection_precision``), the mappings in both conventions; for sm_90 (the H100) every
n, for sm_80 and sm_100 (when this ptxas knows them) n = 4.

By default the stream mix's bias/dropout variants are covered in pairs (every pair of the four
options, stream types, n, bias and dropout, is compiled at least once: variant ``(i + j) mod 4`` for
the i-th stream types and the j-th n), 155 kernels; ``--all`` compiles every combination, 365
kernels (about 2.4 times the CPU). A failure the pairs miss needs three options at once.

It catches what Triton's interpreter does not: a branch whose two sides give tensors of different
shapes, a dot of unsupported shape, a type the compiler refuses. Run without ``TRITON_INTERPRET``
(under it the kernels are Python functions). Prints one line per kernel, marked ``[tensor cores]``
where its PTX multiplies on them; exit 1 when one fails.
"""
from __future__ import annotations

import os
import re
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from lightning_mhc.ops import triton_kernels as tk

TARGETS = {"sm_90": (GPUTarget("cuda", 90, 32), (2, 3, 4, 6, 8)),
           "sm_80": (GPUTarget("cuda", 80, 32), (4,)),
           "sm_100": (GPUTarget("cuda", 100, 32), (4,))}
F32, I32 = "*fp32", "*i32"
STREAMS = (("*fp32", "*fp32"), ("*bf16", "*bf16"), ("*fp16", "*fp16"), ("*fp32", "*bf16"), ("*fp32", "*fp16"))
"""(stream, sub-layer output) pointer types."""


BIAS_DROPOUT = tuple((bias, drop) for bias in (True, False) for drop in (True, False))


def _cases(ns: tuple[int, ...], every_combination: bool):
    """``(kernel, pointer and scalar types by argument name, constexprs)`` for every kernel: each
    stream mix's bias/dropout variants all, or the one that covers its pairs (the module's doc)."""
    for i, (stream, out) in enumerate(STREAMS):
        for j, n in enumerate(ns):
            shape = dict(N=n, NP=triton.next_power_of_2(n))
            stream_mix = dict(**shape, BLOCK_C=64)
            chosen = BIAS_DROPOUT if every_combination else (BIAS_DROPOUT[(i + j) % len(BIAS_DROPOUT)],)
            variants = [dict(**stream_mix, HAS_BIAS=bias, DROPOUT=drop) for bias, drop in chosen]
            if out == stream:  # the aggregate reads and writes the stream's type
                yield tk._aggregate_fwd, dict(x_ptr=stream, hpre_ptr=F32, agg_ptr=stream, C="i32"), stream_mix
                yield tk._aggregate_bwd, dict(x_ptr=stream, hpre_ptr=F32, gagg_ptr=stream, dx_ptr=stream,
                                              dhpre_ptr=F32, C="i32"), stream_mix
            for variant in variants:
                yield tk._res_post_fwd, dict(x_ptr=stream, hres_ptr=F32, hpost_ptr=F32, out_ptr=out,
                                             bias_ptr=out, seed_ptr=I32, y_ptr=stream, C="i32", p="fp32",
                                             scale="fp32"), variant
                yield tk._res_post_bwd, dict(x_ptr=stream, hres_ptr=F32, hpost_ptr=F32, out_ptr=out,
                                             bias_ptr=out, seed_ptr=I32, g_ptr=stream, dx_ptr=stream,
                                             dhres_ptr=F32, dhpost_ptr=F32, dout_ptr=out, C="i32", p="fp32",
                                             scale="fp32"), variant
            if (stream, out) == ("*fp32", "*fp32"):  # the mappings are fp32 whatever the stream
                mappings = dict(raw_ptr=F32, r_ptr=F32, alpha_ptr=F32, bias_ptr=F32, T="i32", M="i32",
                                iterations="i32", eps="fp32")
                for v4 in (False, True):  # the mHC and DeepSeek-V4 conventions
                    yield tk._mappings_fwd, dict(**mappings, hpre_ptr=F32, hpost_ptr=F32, hres_ptr=F32), \
                        dict(**shape, BLOCK_T=16, V4=v4)
                    yield tk._mappings_bwd, dict(**mappings, hpre_ptr=F32, hpost_ptr=F32, ghpre_ptr=F32,
                                                 ghpost_ptr=F32, ghres_ptr=F32, dz_ptr=F32), \
                        dict(**shape, BLOCK_T=16, V4=v4)
        if out == stream:  # a tile of 128 fp32 or 256 bf16/fp16 tokens (projection_plan), each precision
            block_t = tk.PROJECTION_TILE_BYTES // (4 if stream == "*fp32" else 2)
            precisions = tk.PRECISION_OF_FP32_MATMULS.values() if stream == "*fp32" else ("tf32",)
            for precision in precisions:
                yield tk._projection_fwd, dict(x_ptr=stream, phi_ptr=F32, part_ptr=F32, sq_ptr=F32, T="i32",
                                               K="i32", M="i32", k_per_split="i32"), \
                    dict(MP=32, BLOCK_T=block_t, BLOCK_K=32, PRECISION=precision)


MMA = re.compile(r"\b(wgmma\.mma_async|mma\.sync|tcgen05\.mma)\.")
TENSOR_CORES = " [tensor cores]"
"""Marks a kernel whose PTX has a matrix-multiply-accumulate instruction (sm_80 ``mma``, sm_90
``wgmma``, sm_100 ``tcgen05.mma``)."""
OPTIONS = {"_projection_fwd": dict(num_warps=8)}
"""Launch options of kernels launched with other than Triton's defaults (as ``triton_kernels`` does)."""


def _source(kernel, types: dict, constexprs: dict) -> ASTSource:
    names = kernel.arg_names
    signature = {name: types.get(name, "constexpr") for name in names}
    return ASTSource(fn=kernel, signature=signature,
                     constexprs={(names.index(name),): value for name, value in constexprs.items()})


def main(argv: list[str]) -> int:
    if argv not in ([], ["--all"]):
        print("usage: compile_triton_kernels.py [--all]")
        return 2
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("unset TRITON_INTERPRET: under the interpreter nothing is compiled")
        return 2
    failed = 0
    for arch, (target, ns) in TARGETS.items():
        for kernel, types, constexprs in _cases(ns, every_combination=argv == ["--all"]):
            label = f"{arch} {kernel.__name__} {types.get('x_ptr')}/{types.get('out_ptr', '-')} {constexprs}"
            try:
                compiled = triton.compile(_source(kernel, types, constexprs), target=target,
                                          options=OPTIONS.get(kernel.__name__, {}))
                print(f"ok   {label}{TENSOR_CORES if MMA.search(compiled.asm['ptx']) else ''}")
            except Exception as error:  # report every kernel, then fail
                failed += 1
                print(f"FAIL {label}: {type(error).__name__}: {str(error)[:2000]}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
