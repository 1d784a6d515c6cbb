"""C++ CPU kernels of the fused hyper-connection, built on first use.

Eager PyTorch runs Sinkhorn as ~120 tiny ops forward and ~300 backward per call,
and the stream mixing (``H_pre @ x``, ``H_res @ x`` and their gradients) as
batched ``[n, n] x [n, C]`` products whose per-batch overhead dominates at these
shapes. The kernels do one token per pass: all Sinkhorn iterations
(``csrc/sinkhorn_cpu.cpp``) and all stream products (``csrc/stream_mix_cpu.cpp``).
``torch.utils.cpp_extension`` compiles them once per machine (about 40-60 s on
two cores; cached under ``~/.cache/torch_extensions``, later processes load it in
well under a second). Without a C++ compiler, or with
``LIGHTNING_MHC_CPU_KERNELS=0``, the fused path uses eager ops instead (same
values up to rounding). On CUDA the eager ops run.
"""
from __future__ import annotations

import logging
import os
import pathlib
import time
import warnings

import torch

log = logging.getLogger(__name__)

_SOURCES = [pathlib.Path(__file__).resolve().parent / "csrc" / name
            for name in ("sinkhorn_cpu.cpp", "stream_mix_cpu.cpp", "bindings.cpp")]
_state: dict = {"tried": False, "module": None, "load_s": None, "error": None}


def load_cpu_kernels():
    """The compiled module (``sinkhorn_forward``/``_backward``, ``stream_mix_forward``/``_backward``,
    ``h_post_backward``), or None."""
    if not _state["tried"]:
        _state["tried"] = True
        if os.environ.get("LIGHTNING_MHC_CPU_KERNELS", "1") == "0":
            _state["error"] = "disabled by LIGHTNING_MHC_CPU_KERNELS=0"
            return None
        start = time.perf_counter()
        errors = []
        # at::parallel_for splits tokens across torch's OpenMP threads only when built with OpenMP
        # (torch's own libgomp is the one loaded); a compiler without it gets a one-thread build
        for name, flags in (("lightning_mhc_cpu_kernels", ["-fopenmp"]), ("lightning_mhc_cpu_kernels_serial", [])):
            try:
                from torch.utils.cpp_extension import load

                _state["module"] = load(name=name, sources=[str(p) for p in _SOURCES], extra_cflags=["-O3", *flags],
                                        extra_ldflags=flags, verbose=False)
                break
            except Exception as exc:  # no compiler, no headers: the eager path works everywhere
                errors.append(f"{type(exc).__name__}: {exc}")
        if _state["module"] is None:
            _state["error"] = errors[-1]
            warnings.warn(f"lightning_mhc: the CPU kernels did not build ({_state['error'][:300]}); "
                          "using the eager fused path (slower on CPU, same values up to rounding).")
        _state["load_s"] = time.perf_counter() - start
        if _state["module"] is not None:
            log.info("CPU kernels ready in %.1f s", _state["load_s"])
    return _state["module"]


def kernel_status() -> dict:
    """Whether the kernels were tried, how long building/loading took, and why it is missing."""
    return {k: _state[k] for k in ("tried", "load_s", "error")} | {"available": _state["module"] is not None}


def kernels_for(*tensors):
    """The compiled module when every tensor is fp32 on the CPU and it built, else None."""
    if all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors):
        return load_cpu_kernels()
    return None
