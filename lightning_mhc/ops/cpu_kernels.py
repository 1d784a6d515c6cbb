"""C++ CPU kernels of the fused hyper-connection, built on first use.

Eager PyTorch runs Sinkhorn as ~120 tiny ops forward and ~300 backward per call,
and the stream mixing (``H_pre @ x``, ``H_res @ x + H_post^T out`` and their gradients) as
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

import contextlib
import fcntl
import hashlib
import importlib.util
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
    """The compiled module (``sinkhorn_forward``/``_backward``, ``aggregate_forward``/``_backward``,
    ``res_post_forward``/``_backward``), or None."""
    if not _state["tried"]:
        _state["tried"] = True
        if os.environ.get("LIGHTNING_MHC_CPU_KERNELS", "1") == "0":
            _state["error"] = "disabled by LIGHTNING_MHC_CPU_KERNELS=0"
            return None
        start = time.perf_counter()
        errors = []
        # at::parallel_for splits tokens across torch's OpenMP threads only when built with OpenMP
        # (torch's own libgomp is the one loaded); a compiler without it gets a one-thread build
        for kind, flags in (("", ["-fopenmp"]), ("_serial", [])):
            try:
                from torch.utils.cpp_extension import load

                name = f"lightning_mhc_cpu_kernels{kind}_{_build_digest(flags)}"
                with _exclusive_build(name) as (build_dir, sources):
                    _state["module"] = _built(name, build_dir) or load(
                        name=name, sources=sources, build_directory=build_dir,
                        extra_cflags=["-O3", *flags], extra_ldflags=flags, verbose=False)
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


def _build_digest(flags: list[str]) -> str:
    """Names a build by what its binary depends on: the sources, the flags and torch's version."""
    digest = hashlib.sha256(f"{torch.__version__}\0{' '.join(flags)}\0".encode())
    for path in _SOURCES:
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:12]


def _built(name: str, build_dir: str):
    """The module a finished build left (called under the build lock, so none is half written),
    imported without asking ninja: ninja rebuilds when the ninja binary differs from the one that
    built (the system's and the ``ninja`` package's hash command lines differently), and processes
    of one run see either, by their ``PATH``. None when there is none or it does not load."""
    path = pathlib.Path(build_dir) / f"{name}.so"
    if not path.exists():
        return None
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    except (ImportError, OSError) as exc:  # a build killed while linking: build again
        log.warning("rebuilding the CPU kernels: %s did not load (%s)", path, exc)
        return None


@contextlib.contextmanager
def _exclusive_build(name: str):
    """Yields the build directory and the sources copied into it, holding an OS lock on it
    (released when the process dies).

    The directory is named by the sources' digest and builds from copies kept there, so two
    checkouts (or versions) of this package neither share a module nor rebuild each other's.
    ``torch.utils.cpp_extension`` marks a build in progress with a plain ``lock`` file; a
    process killed while building (a preempted job, a fault test) leaves it behind and every
    later process waits on it for ever. Under this lock no other process of ours is building,
    so a ``lock`` file found here is stale and is removed."""
    from torch.utils.cpp_extension import _get_build_directory

    build_dir = pathlib.Path(_get_build_directory(name, verbose=False))
    with open(build_dir / "lightning_mhc.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            stale = build_dir / "lock"
            if stale.exists():
                log.warning("removing a stale build lock left by a killed process: %s", stale)
                stale.unlink()
            sources = []
            for path in _SOURCES:
                copy = build_dir / path.name
                if not copy.exists() or copy.read_bytes() != path.read_bytes():  # same bytes: keep the mtime
                    copy.write_bytes(path.read_bytes())
                sources.append(str(copy))
            yield str(build_dir), sources
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def kernel_status() -> dict:
    """Whether the kernels were tried, how long building/loading took, and why it is missing."""
    return {k: _state[k] for k in ("tried", "load_s", "error")} | {"available": _state["module"] is not None}


def kernels_for(*tensors):
    """The compiled module when every tensor is fp32 on the CPU and it built, else None."""
    if all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors):
        return load_cpu_kernels()
    return None
