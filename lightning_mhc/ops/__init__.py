"""The hyper-connection math as plain functions of tensors (torch only, no megatron).

``reference``: the readable op-by-op math, differentiated by autograd op by op.
``fused``: the same math as few autograd nodes with hand-written backwards that
save O(n^2) values per token (``docs/fused_hyper_connection.md``), computed by a kernel set:
eager ops with C++ kernels on CPU (``hyper_connection.EagerKernels``), or Triton's
(``triton_kernels.TritonKernels``, ``mhc_implementation='triton'``, and 'auto' on CUDA).
``compile``: the reference math compiled by ``torch.compile`` (fused code without Triton's kernels
of our own; inductor itself generates Triton on CUDA and C++ on CPU).
Each computes this project's mHC or DeepSeek-V4's convention (``convention.py``);
``deepseek_v4.py`` runs transformers' DeepSeek-V4 hyper-connection modules on them.
"""
from __future__ import annotations

import functools
import importlib.util
import os

MHC_IMPLEMENTATIONS = ("auto", "fused", "reference", "triton", "compile")
"""Values of ``mhc_implementation``: 'fused' the fused ops with the eager kernel set (C++ on CPU);
'triton' the fused ops with Triton's kernels (on CPU only under ``TRITON_INTERPRET=1``);
'auto' Triton's on CUDA when Triton imports, else 'fused'; 'reference' the op-by-op math;
'compile' the op-by-op math compiled by ``torch.compile``."""


def is_fused(mhc_implementation: str) -> bool:
    """Whether ``mhc_implementation`` runs the fused autograd nodes ('auto', 'fused', 'triton')."""
    return mhc_implementation not in ("reference", "compile")


@functools.cache
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def triton_runs_on(device_type: str) -> bool:
    """Whether Triton's kernels run on this device type: CUDA, or the CPU under Triton's interpreter
    (``TRITON_INTERPRET=1`` set before Python starts)."""
    return device_type == "cuda" or (device_type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")


TRITON_NOT_HERE = ("Triton compiles for CUDA GPUs. On CPU, set TRITON_INTERPRET=1 before starting Python to run the "
                   "kernels in Triton's interpreter (slow, for checking), or use mhc_implementation='fused' (the C++ "
                   "CPU kernels).")
"""Why ``mhc_implementation='triton'`` cannot run on a device where ``triton_runs_on`` is False."""


def fused_kernels(mhc_implementation: str, device_type: str):
    """The kernel set of the fused hyper-connection for this implementation on this device."""
    if mhc_implementation == "triton" or (mhc_implementation == "auto" and device_type == "cuda"
                                          and triton_available()):
        from lightning_mhc.ops.triton_kernels import TritonKernels

        return TritonKernels
    from lightning_mhc.ops.hyper_connection import EagerKernels

    return EagerKernels
