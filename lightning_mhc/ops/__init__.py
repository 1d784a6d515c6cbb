"""The hyper-connection math as plain functions of tensors (torch only, no megatron).

``reference``: the readable op-by-op math, differentiated by autograd op by op.
``fused``: the same math as few autograd nodes with hand-written backwards that
save O(n^2) values per token (``docs/fused_hyper_connection.md``), computed by a kernel set:
eager ops with C++ kernels on CPU (``hyper_connection.EagerKernels``), or Triton's
(``triton_kernels.TritonKernels``, ``mhc_implementation='triton'``).
"""
from __future__ import annotations

import functools
import importlib.util

MHC_IMPLEMENTATIONS = ("auto", "fused", "reference", "triton")
"""Values of ``mhc_implementation``: 'auto' and 'fused' pick the fused ops with the eager kernel set
(C++ on CPU); 'triton' Triton's kernels (on CPU only under ``TRITON_INTERPRET=1``); 'reference'
the op-by-op math. 'auto' is to pick Triton on CUDA once the kernels have passed the GPU test
set on a GPU; until then they are checked only under Triton's interpreter, so they are opt-in."""


def is_fused(mhc_implementation: str) -> bool:
    """Whether ``mhc_implementation`` runs the fused ops (every value but 'reference')."""
    return mhc_implementation != "reference"


@functools.cache
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


AUTO_PICKS_TRITON = False
"""Whether 'auto' runs Triton's kernels on CUDA (when Triton imports): off until they have run on a GPU."""


def fused_kernels(mhc_implementation: str, device_type: str):
    """The kernel set of the fused hyper-connection for this implementation on this device."""
    if mhc_implementation == "triton" or (AUTO_PICKS_TRITON and mhc_implementation == "auto"
                                          and device_type == "cuda" and triton_available()):
        from lightning_mhc.ops.triton_kernels import TritonKernels

        return TritonKernels
    from lightning_mhc.ops.hyper_connection import EagerKernels

    return EagerKernels
