"""One command for a lent GPU (``make gpu-check``): the GPU test set, the GPU benchmark and a short
training run, with every figure in one JSON.

    python benchmarks/gpu_check.py [--megatron-lm DIR] [--out-dir benchmarks/results/gpu] [--dry-run]
    python benchmarks/gpu_check.py --download-wheels .whl     # here, on a machine with the index

1. **Environment**: a GPU machine lent for minutes has PyTorch, Triton and Lightning in its image
   and no package index. What the package needs beyond them (``GPU_WHEELS``: megatron-core, Hydra,
   OmegaConf, ANTLR's runtime) is installed into ``.gpu-site/`` from the wheels that
   ``--download-wheels`` saved into ``.whl/`` (``make gpu-wheels``, on a machine with the index),
   or from the index when there is no ``.whl/``. The repository runs from its checkout (PYTHONPATH).
2. **GPU test set**: ``pytest -m gpu tests/test_gpu.py``; every test's outcome and seconds (JUnit XML).
3. **Benchmark**: ``benchmarks/gpu_mhc.py`` (against Megatron-LM's mHC with ``--megatron-lm``).
4. **Training**: ``lightning-mhc-train trainer=gpu model=small recompute=mhc_block`` for 50 steps on
   the shipped stdlib corpus: per-step loss, step time, tokens/s and peak CUDA memory.

Writes ``gpu_check.json`` (the device, the versions, each step's status, seconds and figures) and
the plots (``gpu_mhc.png``, ``train_small.png``) under ``--out-dir``. Each step has its own time
limit; a failed step is recorded with its output's tail and the others still run; the exit status
is 1 when any failed. Meant to end within 8 minutes on one H100.

``--dry-run`` (what happens without CUDA): the same steps on CPU, small (the GPU set's CPU dry run,
``LIGHTNING_MHC_GPU_TESTS_ON_CPU=1``; the benchmark at its CPU sizes; 4 steps of ``trainer=cpu``):
it checks this command and the GPU tests' own logic, and measures nothing of a GPU.
"""
from __future__ import annotations

import argparse
import csv
import importlib.metadata
import importlib.util
import json
import os
import pathlib
import platform
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree

from _harness import RESULTS, pyplot, save_figure, write_json

ROOT = pathlib.Path(__file__).resolve().parents[1]
SITE = ROOT / ".gpu-site"
WHEELS = ROOT / ".whl"
GPU_WHEELS = ("megatron-core==0.19.2", "hydra-core==1.3.8", "omegaconf==2.3.1", "antlr4-python3-runtime==4.9.3")
"""What the package imports that a GPU image (PyTorch, Triton, Lightning, tokenizers) lacks;
megatron-core as tested on Python 3.12. ANTLR's runtime exists only as a (pure Python) sdist:
``--download-wheels`` builds its wheel."""
IMPORTS = ("torch", "lightning", "megatron.core", "hydra", "omegaconf", "tokenizers", "safetensors", "pytest")
VERSIONS = ("torch", "triton", "lightning", "megatron-core", "hydra-core", "transformers", "pytest")
TRAIN_STEPS = 50


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", type=pathlib.Path, default=RESULTS / "gpu")
    parser.add_argument("--megatron-lm", type=pathlib.Path, default=None, help="a Megatron-LM checkout")
    parser.add_argument("--dry-run", action="store_true", help="on CPU, small: checks the command, not a GPU")
    parser.add_argument("--download-wheels", type=pathlib.Path, default=None, metavar="DIR",
                        help="save GPU_WHEELS for Python 3.12 on x86-64 Linux into DIR, then exit")
    args = parser.parse_args()
    if args.download_wheels:
        return download_wheels(args.download_wheels)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    env = prepare_environment()
    import torch

    dry = args.dry_run or not torch.cuda.is_available()
    if dry and not args.dry_run:
        print("gpu_check: no CUDA device here: a dry run on CPU (it measures nothing of a GPU)")
    report = {"dry_run": dry, "device": _device(torch), "versions": _versions(), "steps": {}}
    started = time.monotonic()
    for name, step in (("gpu_tests", gpu_tests), ("gpu_mhc", gpu_benchmark), ("train_small", train_small)):
        print(f"gpu_check: {name} ...", flush=True)
        begin = time.monotonic()
        try:
            result = {"status": "passed", **step(args, env, dry)}
        except StepFailed as failure:
            result = {"status": "failed", "reason": str(failure), "output_tail": failure.output[-4000:]}
        result["seconds"] = round(time.monotonic() - begin, 1)
        report["steps"][name] = result
        print(f"gpu_check: {name} {result['status']} in {result['seconds']} s", flush=True)
    report["seconds"] = round(time.monotonic() - started, 1)
    write_json(args.out_dir / "gpu_check.json", report)
    failed = [name for name, step in report["steps"].items() if step["status"] != "passed"]
    print(f"gpu_check: {'failed: ' + ', '.join(failed) if failed else 'every step passed'} "
          f"({report['seconds']} s on {report['device']['name']})")
    return 1 if failed else 0


class StepFailed(RuntimeError):
    def __init__(self, reason: str, output: str = "") -> None:
        super().__init__(reason)
        self.output = output


# ------------------------------------------------------------------ environment
def download_wheels(into: pathlib.Path) -> int:
    """``GPU_WHEELS`` for the GPU image's Python (3.12, x86-64 manylinux), without their
    dependencies (the image has them)."""
    platforms = [f"--platform={p}" for p in ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")]
    pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--python-version", "3.12", "--implementation", "cp",
           "-d", str(into)]
    binary = [w for w in GPU_WHEELS if not w.startswith("antlr4")]
    source = [w for w in GPU_WHEELS if w.startswith("antlr4")]
    # the sdist built here into a pure-Python wheel: the GPU machine then installs wheels alone
    wheel = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(into)]
    for command in ([*pip, "--only-binary=:all:", *platforms, *binary], [*wheel, *source]):
        if subprocess.run(command).returncode:
            return 1
    print(f"saved {len(list(into.iterdir()))} files in {into}: carry it to the GPU machine beside the repository")
    return 0


def prepare_environment() -> dict[str, str]:
    """The environment of the child processes (PYTHONPATH: ``.gpu-site`` and the checkout), after
    installing what is missing into ``.gpu-site``."""
    sys.path[:0] = [str(SITE), str(ROOT)]
    missing = [name for name in IMPORTS if importlib.util.find_spec(name.split(".")[0]) is None
               or importlib.util.find_spec(name) is None]
    if missing:
        source = (["--no-index", *map(str, sorted(WHEELS.iterdir()))] if WHEELS.is_dir() else list(GPU_WHEELS))
        print(f"gpu_check: installing into {SITE} (missing: {', '.join(missing)}) from "
              f"{WHEELS if WHEELS.is_dir() else 'the package index'}", flush=True)
        proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                               "--no-compile", "--upgrade", "--target", str(SITE), *source])
        importlib.invalidate_caches()
        still = [name for name in missing if importlib.util.find_spec(name) is None]
        if proc.returncode or still:
            sys.exit(f"gpu_check: cannot import {', '.join(still or missing)}: run `make gpu-wheels` on a machine "
                     "with the package index and bring .whl/ with the repository")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SITE), str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.pop("TRITON_INTERPRET", None)  # tests/conftest.py sets it where there is no CUDA, and only there
    return env


def _device(torch) -> dict:
    if not torch.cuda.is_available():
        return {"name": f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"}
    props = torch.cuda.get_device_properties(0)
    smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True)
    return {"name": props.name, "capability": f"{props.major}.{props.minor}", "memory_gib": props.total_memory / 2**30,
            "multiprocessors": props.multi_processor_count, "cuda": torch.version.cuda,
            "driver": smi.stdout.strip() if smi.returncode == 0 else None}


def _versions() -> dict:
    found = {}
    for name in VERSIONS:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return {"python": platform.python_version(), **found}


def _run(command: list[str], env: dict, timeout: float, cwd: pathlib.Path | None = None) -> str:
    """Runs ``command``; its stdout and stderr, or StepFailed with their tail."""
    try:
        proc = subprocess.run(command, env=env, cwd=cwd or ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        raise StepFailed(f"no result within {timeout:.0f} s", out) from None
    output = proc.stdout + proc.stderr
    if proc.returncode:
        raise StepFailed(f"exit status {proc.returncode}", output)
    return output


# ------------------------------------------------------------------ steps
def gpu_tests(args, env: dict, dry: bool) -> dict:
    """The GPU test set: each test's outcome and seconds; failed when any test failed."""
    junit = args.out_dir / "gpu_tests.xml"
    run_env = dict(env, LIGHTNING_MHC_GPU_TESTS_ON_CPU="1") if dry else env
    command = [sys.executable, "-m", "pytest", "-m", "gpu", "tests/test_gpu.py", "-q", "-p", "no:cacheprovider",
               f"--junitxml={junit}"]
    try:
        output = _run(command, run_env, timeout=300)
        failure = None
    except StepFailed as exc:
        output, failure = exc.output, exc
    tests = _junit_outcomes(junit) if junit.exists() else {}
    counts = {outcome: sum(1 for t in tests.values() if t["outcome"] == outcome)
              for outcome in ("passed", "failed", "skipped")}
    if failure is not None or not counts["passed"]:
        raise StepFailed(f"{counts}: {failure or 'no test passed'}", output)
    return {"counts": counts, "tests": tests}


def _junit_outcomes(path: pathlib.Path) -> dict:
    tests = {}
    for case in ElementTree.parse(path).getroot().iter("testcase"):
        outcome = next((child.tag for child in case if child.tag in ("failure", "error", "skipped")), "passed")
        tests[case.get("name")] = {"outcome": {"error": "failed", "failure": "failed"}.get(outcome, outcome),
                                   "seconds": round(float(case.get("time", 0)), 2)}
    return tests


def gpu_benchmark(args, env: dict, dry: bool) -> dict:
    """``benchmarks/gpu_mhc.py``: its JSON's figures (and its plot beside this one's)."""
    out = args.out_dir / "gpu_mhc.json"
    command = [sys.executable, str(ROOT / "benchmarks" / "gpu_mhc.py"), "--out", str(out)]
    if dry:
        command += ["--rounds", "2", "--hidden", "64", "--tokens", "128", "--model-hidden", "64"]
    if args.megatron_lm:
        command += ["--megatron-lm", str(args.megatron_lm)]
    _run(command, env, timeout=360)
    return {"figures": json.loads(out.read_text())}


def train_small(args, env: dict, dry: bool) -> dict:
    """``lightning-mhc-train`` with ``mhc_block``: per-step loss and the run's speed and memory."""
    steps = 4 if dry else TRAIN_STEPS
    overrides = (["trainer=cpu", "model=tiny", "data.seq_length=32"] if dry else ["trainer=gpu", "model=small"])
    with tempfile.TemporaryDirectory() as scratch:
        run_dir = pathlib.Path(scratch) / "run"
        _run([sys.executable, "-m", "lightning_mhc.cli.train", *overrides, "recompute=mhc_block",
              f"trainer.max_steps={steps}", "trainer.log_every_n_steps=1", "trainer.val_check_interval=1000",
              "trainer.checkpoint_every_n_steps=1000", "trainer.enable_progress_bar=false",
              f"hydra.run.dir={run_dir}"], env, timeout=300, cwd=pathlib.Path(scratch))
        rows = list(csv.DictReader(open(run_dir / "metrics.csv")))
    series = {key: [(int(r["step"]), float(r[key])) for r in rows if r.get(key)]
              for key in ("train_loss", "step_time_ms", "tokens_per_sec", "max_cuda_mb")}
    losses = [value for _, value in series["train_loss"]]
    if len(losses) != steps:
        raise StepFailed(f"{len(losses)} losses logged for {steps} steps")
    later = [value for step, value in series["step_time_ms"] if step > 2]  # after compilation and warm-up
    result = {"steps": steps, "overrides": overrides, "losses": losses, "loss_fell_by": losses[0] - losses[-1],
              "median_step_time_ms": sorted(later)[len(later) // 2] if later else None,
              "tokens_per_sec": series["tokens_per_sec"][-1][1] if series["tokens_per_sec"] else None,
              "max_cuda_mb": max((v for _, v in series["max_cuda_mb"]), default=None)}
    _plot_training(series, args.out_dir / "train_small.png")
    return result


def _plot_training(series: dict, path: pathlib.Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.5))
    ax1.plot(*zip(*series["train_loss"]), marker=".")
    ax1.set(xlabel="step", ylabel="train loss", title="model=small, recompute=mhc_block")
    if series["step_time_ms"]:
        ax2.plot(*zip(*series["step_time_ms"]), marker=".")
    ax2.set(xlabel="step", ylabel="step time (ms)", title="step time")
    save_figure(fig, path)


if __name__ == "__main__":
    sys.exit(main())
