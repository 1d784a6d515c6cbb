"""C++ CPU kernels for the Sinkhorn projection, built on first use.

Eager PyTorch runs Sinkhorn as ~120 tiny ops forward and ~300 backward per call,
whose dispatch cost dominates at the token counts of a micro-batch; this kernel
does all iterations of one token in a single pass (``csrc/sinkhorn_cpu.cpp``).
``torch.utils.cpp_extension`` compiles it once per machine (about 30-60 s on two
cores; cached under ``~/.cache/torch_extensions``, later processes load it in
well under a second). Without a C++ compiler, or with
``LIGHTNING_MHC_CPU_KERNELS=0``, the fused path uses the eager version instead
(same values up to rounding). On CUDA the eager version runs.
"""
from __future__ import annotations

import logging
import os
import pathlib
import time
import warnings

log = logging.getLogger(__name__)

_SOURCE = pathlib.Path(__file__).resolve().parent / "csrc" / "sinkhorn_cpu.cpp"
_state: dict = {"tried": False, "module": None, "load_s": None, "error": None}


def sinkhorn_cpu():
    """The compiled module (``sinkhorn_forward``, ``sinkhorn_backward``), or None."""
    if not _state["tried"]:
        _state["tried"] = True
        if os.environ.get("LIGHTNING_MHC_CPU_KERNELS", "1") == "0":
            _state["error"] = "disabled by LIGHTNING_MHC_CPU_KERNELS=0"
            return None
        start = time.perf_counter()
        try:
            from torch.utils.cpp_extension import load

            _state["module"] = load(name="lightning_mhc_sinkhorn_cpu", sources=[str(_SOURCE)],
                                    extra_cflags=["-O3"], verbose=False)
        except Exception as exc:  # no compiler, no headers: the eager path works everywhere
            _state["error"] = f"{type(exc).__name__}: {exc}"
            warnings.warn(f"lightning_mhc: the CPU Sinkhorn kernel did not build ({_state['error'][:300]}); "
                          "using the eager fused path (slower on CPU, same values up to rounding).")
        _state["load_s"] = time.perf_counter() - start
        if _state["module"] is not None:
            log.info("CPU Sinkhorn kernel ready in %.1f s", _state["load_s"])
    return _state["module"]


def kernel_status() -> dict:
    """Whether the kernel was tried, how long building/loading took, and why it is missing."""
    return {k: _state[k] for k in ("tried", "load_s", "error")} | {"available": _state["module"] is not None}
