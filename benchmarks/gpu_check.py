"""One command for a lent GPU (``make gpu-check``): the GPU test set, the GPU benchmark and a short
training run within one time budget, every result in one JSON written after every step.

    python benchmarks/gpu_check.py [--budget-s 540] [--out-dir DIR] [--megatron-lm PATH] [--dry-run]
    python benchmarks/gpu_check.py --download-wheels .whl [--megatron-lm CHECKOUT]   # here, with the index

A lent GPU machine runs one command for at most 10 minutes, has no package index, and returns only
the files left in the folder named by ``$OUT``. So:

- **One budget** (``--budget-s``, default 540 s, inside the 600 s a command may take): the steps run
  in order of value, each with what is left of the budget (and at most its own cap), and the JSON
  is written after every step: a run cut short still says what it saw. A step past its time is
  killed with every process it started; SIGTERM ends the run the same way, JSON written.
- **Results in ``$OUT``** when it is set (else ``benchmarks/results/gpu``; ``--out-dir`` wins):
  ``gpu_check.json``, ``gpu_check.log`` (every step's output), ``gpu_tests.jsonl`` (a line per test
  as it starts and ends), ``gpu_mhc.json``, ``v4_hyper_connection.json`` and the plots
  ``gpu_mhc.png``, ``train_small.png``: 7 files, one folder, names the device tool returns.
- **Nothing from outside**: what the package imports that the image lacks (``GPU_WHEELS``:
  megatron-core, Hydra, OmegaConf, ANTLR's runtime) is installed offline into ``.gpu-site/`` from
  ``.whl/``, which ``--download-wheels`` fills where the index is reachable (``make gpu-wheels``,
  which also prints the device call that carries it). Megatron-LM's mHC (in no megatron-core
  release) comes from ``.megatron-lm/hyper_connection.py`` when present: ``--download-wheels
  .whl --megatron-lm CHECKOUT`` copies it there from a Megatron-LM checkout.

Steps, in order: ``environment`` (the offline install), ``gpu_tests`` (``pytest -m gpu
tests/test_gpu.py``: each test's outcome, seconds and message; on a GPU a skipped test fails the
step, as Triton missing would), ``gpu_mhc`` (``benchmarks/gpu_mhc.py``; on a GPU the Triton rows
must run), ``train_small`` (``lightning-mhc-train trainer=gpu model=small recompute=mhc_block``,
50 steps on the shipped stdlib corpus: losses, which must fall, step time, tokens/s, peak CUDA
memory), ``v4_hyper_connection`` (``benchmarks/v4_hyper_connection.py``: DeepSeek-V4's sub-layer
on our kernels beside transformers' module, when the image's transformers has it). A failure (a raised error, a missing file, a step past its time) is recorded with its
message and output tail, and the next step runs; the exit status is 1 when any step failed.

``--dry-run`` (what happens without CUDA): the same steps on CPU, small (the GPU set's CPU dry run,
``LIGHTNING_MHC_GPU_TESTS_ON_CPU=1``; the benchmark at its CPU sizes; 8 steps of ``trainer=cpu``):
it checks this command and the GPU tests' own logic, and measures nothing of a GPU.
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import importlib.metadata
import importlib.util
import json
import os
import pathlib
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Callable

from _harness import RESULTS, pyplot, save_figure

ROOT = pathlib.Path(__file__).resolve().parents[1]
SITE = ROOT / ".gpu-site"
WHEELS = ROOT / ".whl"
MEGATRON_LM_COPY = ROOT / ".megatron-lm"
MEGATRON_LM_FILE = "megatron/core/transformer/hyper_connection.py"
GPU_WHEELS = ("megatron-core==0.19.2", "hydra-core==1.3.8", "omegaconf==2.3.1", "antlr4-python3-runtime==4.9.3")
"""What the package imports that a GPU image (PyTorch, Triton, Lightning, tokenizers) lacks;
megatron-core as tested on Python 3.12. ANTLR's runtime exists only as a (pure Python) sdist:
``--download-wheels`` builds its wheel."""
IMPORTS = ("torch", "lightning", "megatron.core", "hydra", "omegaconf", "tokenizers", "safetensors", "pytest")
VERSIONS = ("torch", "triton", "lightning", "megatron-core", "hydra-core", "omegaconf", "transformers", "numpy",
            "pytest")
DEFAULT_BUDGET_S = 540.0
DEVICE_TIMEOUT_S = 600
"""The device tool's limit for one command: the budget leaves time for Python and make around it."""
MIN_STEP_S = 15.0
"""A step with less of the budget left is not started (it could not say anything)."""
REPORT_RESERVE_S = 5.0
"""Kept back from each step's time for reading its results, plotting and writing the JSON."""
TRAIN_STEPS = 50
OUTPUTS = ("gpu_check.json", "gpu_check.log", "gpu_tests.jsonl", "gpu_mhc.json", "gpu_mhc.png", "train_small.png",
           "v4_hyper_connection.json")
"""Every file a run writes (an earlier run's are removed first, so none is read stale)."""


def device_call(carry: list[str]) -> str:
    """The device tool's call that runs this check on a lent GPU with what it must carry (the
    ignored folders ``make gpu-wheels`` fills; git-ignored paths travel only when carried)."""
    return f'run(command="make gpu-check", carry={json.dumps(carry)}, timeout_s={DEVICE_TIMEOUT_S})'


@dataclasses.dataclass
class Step:
    name: str
    run: Callable[["Context"], dict]
    cap_s: float
    """The most of the budget this step may take, so a hung step leaves the later ones their turn."""
    so_far: Callable[["Context"], dict] | None = None
    """What the step had seen when SIGTERM interrupted it (the tests that had finished)."""


@dataclasses.dataclass
class Context:
    args: argparse.Namespace
    env: dict
    dry: bool
    out_dir: pathlib.Path
    timeout_s: float = 0.0
    """This step's share of the budget, set before it runs."""

    @property
    def log(self) -> pathlib.Path:
        return self.out_dir / "gpu_check.log"


class StepFailed(RuntimeError):
    """A step's failure: its reason, its output's tail, and what it measured before it failed."""

    def __init__(self, reason: str, output: str = "", result: dict | None = None) -> None:
        super().__init__(reason)
        self.output = output
        self.result = result or {}


class Interrupted(BaseException):
    """SIGTERM (the device tool's own time limit): the running step is killed and the JSON written."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", type=pathlib.Path, default=None,
                        help="default: $OUT when it is set (the device tool returns it), else benchmarks/results/gpu")
    parser.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S,
                        help=f"seconds for everything (default {DEFAULT_BUDGET_S:.0f}, inside the device tool's "
                             f"{DEVICE_TIMEOUT_S} s a command)")
    parser.add_argument("--megatron-lm", type=pathlib.Path, default=None,
                        help=f"Megatron-LM's mHC: a checkout or its hyper_connection.py (default: "
                             f"{MEGATRON_LM_COPY.name}/ when present)")
    parser.add_argument("--dry-run", action="store_true", help="on CPU, small: checks the command, not a GPU")
    parser.add_argument("--download-wheels", type=pathlib.Path, default=None, metavar="DIR",
                        help="save GPU_WHEELS for Python 3.12 on x86-64 Linux into DIR (and with --megatron-lm "
                             f"copy its hyper_connection.py into {MEGATRON_LM_COPY.name}/), print the device call, exit")
    args = parser.parse_args(argv)
    if not 0 < args.budget_s <= DEVICE_TIMEOUT_S:
        parser.error(f"--budget-s {args.budget_s:g}: give the seconds for everything, more than 0 and at most the "
                     f"device tool's {DEVICE_TIMEOUT_S} s a command (default {DEFAULT_BUDGET_S:.0f})")
    if args.download_wheels:
        return download_wheels(args.download_wheels, args.megatron_lm)
    if args.megatron_lm is None and MEGATRON_LM_COPY.is_dir():
        args.megatron_lm = MEGATRON_LM_COPY
    out_dir = args.out_dir or (pathlib.Path(os.environ["OUT"]) if os.environ.get("OUT") else RESULTS / "gpu")
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in OUTPUTS:
        (out_dir / name).unlink(missing_ok=True)
    print(f"gpu_check: results in {out_dir}, budget {args.budget_s:.0f} s", flush=True)
    return Check(args, out_dir).run()


class Check:
    """The run: the report, the budget, and the steps in order."""

    def __init__(self, args: argparse.Namespace, out_dir: pathlib.Path) -> None:
        self.args, self.out_dir = args, out_dir
        self.started = time.monotonic()
        self.deadline = self.started + args.budget_s
        self.running: tuple[Step, float] | None = None
        """The step running now and when it began (what SIGTERM interrupts)."""
        self.report = {"budget_s": args.budget_s, "dry_run": args.dry_run, "device": None, "versions": None,
                       "steps": {name: {"status": "pending"} for name in ("environment", *(s.name for s in STEPS))}}

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def run(self) -> int:
        previous = signal.signal(signal.SIGTERM, _interrupt)
        try:
            prepared = self.step("environment", lambda: prepare_environment(min(180.0, self.left())))
            self.describe_machine()
            ctx = Context(self.args, prepared["env"] if prepared else _child_env(), self.report["dry_run"], self.out_dir)
            for step in STEPS:
                if self.left() < MIN_STEP_S:
                    self.record(step.name, {"status": "not run", "reason": f"{max(self.left(), 0):.0f} s of the "
                                            f"{self.args.budget_s:.0f} s budget left"})
                    continue
                ctx.timeout_s = min(step.cap_s, self.left() - REPORT_RESERVE_S)
                self.running = (step, time.monotonic())
                self.step(step.name, lambda: step.run(ctx))
                self.running = None
        except Interrupted:
            if self.running is not None:
                step, begin = self.running
                seen = step.so_far(ctx) if step.so_far is not None else {}
                self.record(step.name, {"status": "failed", "reason": "interrupted by SIGTERM", **seen,
                                        "seconds": round(time.monotonic() - begin, 1)})
            elif self.report["steps"]["environment"]["status"] == "running":
                self.record("environment", {"status": "failed", "reason": "interrupted by SIGTERM"})
            self.finish()
            return 143
        finally:
            signal.signal(signal.SIGTERM, previous)
        return self.finish()

    def step(self, name: str, work: Callable[[], dict]):
        """Runs one step, records its outcome and writes the JSON; returns its value (None when it
        failed)."""
        print(f"gpu_check: {name} ...", flush=True)
        self.record(name, {"status": "running"})
        begin = time.monotonic()
        value = None
        try:
            value = work()
            result = {"status": "passed", **(value if isinstance(value, dict) else {})}
        except StepFailed as failure:
            result = {"status": "failed", "reason": str(failure), **failure.result,
                      "output_tail": failure.output[-4000:]}
        except Exception as exc:  # a crash of this script's own step code: recorded, the next step runs
            result = {"status": "failed", "reason": f"{type(exc).__name__}: {exc}",
                      "output_tail": traceback.format_exc()[-4000:]}
        result["seconds"] = round(time.monotonic() - begin, 1)
        self.record(name, result)
        print(f"gpu_check: {name} {result['status']} in {result['seconds']} s"
              + (f": {result['reason']}" if result["status"] != "passed" else ""), flush=True)
        return value if result["status"] == "passed" else None

    def record(self, name: str, result: dict) -> None:
        self.report["steps"][name] = {k: v for k, v in result.items() if k != "env"}
        self.write()

    def write(self) -> None:
        self.report["seconds"] = round(time.monotonic() - self.started, 1)
        (self.out_dir / "gpu_check.json").write_text(json.dumps(self.report, indent=2))

    def describe_machine(self) -> None:
        try:
            import torch

            cuda = torch.cuda.is_available()
            self.report["device"] = _device(torch)
        except Exception as exc:  # torch itself missing or broken: said, and every step will say more
            cuda, self.report["device"] = False, {"error": f"{type(exc).__name__}: {exc}"}
        if not cuda and not self.args.dry_run:
            print("gpu_check: no CUDA device here: a dry run on CPU (it measures nothing of a GPU)", flush=True)
        self.report["dry_run"] = self.args.dry_run or not cuda
        self.report["versions"] = _versions()

    def finish(self) -> int:
        self.write()
        failed = [name for name, step in self.report["steps"].items() if step["status"] != "passed"]
        device = (self.report["device"] or {}).get("name", "an unknown device")
        print(f"gpu_check: {'not passed: ' + ', '.join(failed) if failed else 'every step passed'} "
              f"({self.report['seconds']} s on {device}); wrote {self.out_dir / 'gpu_check.json'}", flush=True)
        return 1 if failed else 0


def _interrupt(signum, frame):
    raise Interrupted()


# ------------------------------------------------------------------ environment
def download_wheels(into: pathlib.Path, megatron_lm: pathlib.Path | None) -> int:
    """``GPU_WHEELS`` for the GPU image's Python (3.12, x86-64 manylinux), without their
    dependencies (the image has them); Megatron-LM's mHC module copied from ``megatron_lm``; then
    the device call that carries them."""
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
    print(f"saved {len(list(into.iterdir()))} files in {into}")
    if megatron_lm is not None:
        source_file = megatron_lm / MEGATRON_LM_FILE if megatron_lm.is_dir() else megatron_lm
        if not source_file.is_file():
            print(f"gpu_check: {source_file} not found: give a Megatron-LM checkout or its hyper_connection.py")
            return 1
        MEGATRON_LM_COPY.mkdir(exist_ok=True)
        shutil.copy(source_file, MEGATRON_LM_COPY / "hyper_connection.py")
        print(f"copied {source_file} to {MEGATRON_LM_COPY}/")
    carry = [p.name for p in (into, MEGATRON_LM_COPY) if p.is_dir()]
    print(f"on the lent GPU (the device tool), from the repository root:\n    {device_call(carry)}")
    return 0


def _importable(name: str) -> bool:
    """Whether ``name`` imports (``find_spec`` of ``a.b`` raises when ``a`` itself is absent)."""
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def _child_env() -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SITE), str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.pop("TRITON_INTERPRET", None)  # tests/conftest.py sets it where there is no CUDA, and only there
    return env


def prepare_environment(timeout_s: float) -> dict:
    """Installs what is missing into ``.gpu-site`` (offline from ``.whl/``); the step's result
    holds the child processes' environment (PYTHONPATH: ``.gpu-site`` and the checkout)."""
    sys.path[:0] = [str(SITE), str(ROOT)]
    missing = [name for name in IMPORTS if not _importable(name)]
    installed = []
    if missing:
        if not WHEELS.is_dir():
            raise StepFailed(f"missing {', '.join(missing)} and no {WHEELS.name}/ to install them from: run `make "
                             f"gpu-wheels` where the package index is reachable and carry {WHEELS.name}/ here")
        wheels = sorted(map(str, WHEELS.iterdir()))
        print(f"gpu_check: installing into {SITE} (missing: {', '.join(missing)}) from {WHEELS}", flush=True)
        try:
            proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                                   "--no-compile", "--upgrade", "--target", str(SITE), *wheels],
                                  capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise StepFailed(f"pip install from {WHEELS.name}/ took over {timeout_s:.0f} s") from None
        importlib.invalidate_caches()
        still = [name for name in missing if not _importable(name)]
        if proc.returncode or still:
            raise StepFailed(f"cannot import {', '.join(still or missing)} after installing {WHEELS.name}/ "
                             f"(pip exit status {proc.returncode})", proc.stdout + proc.stderr)
        installed = [pathlib.Path(w).name for w in wheels]
    return {"missing": missing, "installed": installed, "env": _child_env()}


def _device(torch) -> dict:
    if not torch.cuda.is_available():
        return {"name": f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"}
    props = torch.cuda.get_device_properties(0)
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        driver = smi.stdout.strip() if smi.returncode == 0 else f"nvidia-smi exit status {smi.returncode}"
    except (OSError, subprocess.TimeoutExpired) as exc:
        driver = f"nvidia-smi: {exc}"
    return {"name": props.name, "capability": f"{props.major}.{props.minor}", "memory_gib": props.total_memory / 2**30,
            "multiprocessors": props.multi_processor_count, "cuda": torch.version.cuda, "driver": driver}


def _versions() -> dict:
    found = {}
    for name in VERSIONS:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return {"python": platform.python_version(), **found}


def _run(command: list[str], ctx: Context, cwd: pathlib.Path | None = None, env: dict | None = None) -> str:
    """Runs ``command`` in a session of its own within the step's time, its output appended to
    ``gpu_check.log``; returns that output, or raises StepFailed with its tail. Past its time (or on
    SIGTERM) the whole session is killed: a benchmark's or a test's own children too."""
    with open(ctx.log, "a") as log:
        log.write(f"\n$ {' '.join(command)}\n")
        log.flush()
        start = log.tell()
        proc = subprocess.Popen(command, env=env or ctx.env, cwd=cwd or ROOT, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            returncode = proc.wait(timeout=ctx.timeout_s)
        except subprocess.TimeoutExpired:
            returncode = None
        finally:
            if proc.poll() is None or returncode is None:
                _kill_session(proc)
    with open(ctx.log, errors="replace") as log:
        log.seek(start)
        output = log.read()
    if returncode is None:
        raise StepFailed(f"killed past its {ctx.timeout_s:.0f} s of the budget", output)
    if returncode:
        raise StepFailed(f"exit status {returncode}", output)
    return output


def _kill_session(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


# ------------------------------------------------------------------ steps
def gpu_tests(ctx: Context) -> dict:
    """The GPU test set, a line per test as it runs (``gpu_test_log.py``): each test's outcome,
    seconds and message; failed when a test failed, when none passed, and on a GPU when any
    skipped (a GPU run must not pass by skipping: Triton missing, say)."""
    log = ctx.out_dir / "gpu_tests.jsonl"
    env = dict(ctx.env, GPU_TEST_LOG=str(log),
               PYTHONPATH=os.pathsep.join([str(ROOT / "benchmarks"), ctx.env.get("PYTHONPATH", "")]))
    if ctx.dry:
        env["LIGHTNING_MHC_GPU_TESTS_ON_CPU"] = "1"
    command = [sys.executable, "-m", "pytest", "-m", "gpu", "tests/test_gpu.py", "-q", "-p", "no:cacheprovider",
               "-p", "gpu_test_log"]
    try:
        _run(command, ctx, env=env)
        failure = None
    except StepFailed as exc:
        failure = exc
    result = _tests_so_far(ctx)
    problems = [str(failure)] if failure else []
    if not result["counts"]["passed"]:
        problems.append("no test passed")
    if result["skipped"] and not ctx.dry:
        problems.append(f"skipped on a GPU: {', '.join(result['skipped'])}")
    if problems:
        raise StepFailed(f"{result['counts']}: {'; '.join(problems)}", failure.output if failure else "", result)
    return result


def _tests_so_far(ctx: Context) -> dict:
    """The GPU tests' outcomes from the lines written so far: counts, each test, the skipped ones'
    reasons, and the test running when the step was stopped."""
    tests, running = _test_lines(ctx.out_dir / "gpu_tests.jsonl")
    outcomes = [t["outcome"] for t in tests.values()]
    result = {"counts": {o: outcomes.count(o) for o in ("passed", "failed", "skipped")}, "tests": tests,
              "skipped": {name: t["message"] for name, t in tests.items() if t["outcome"] == "skipped"}}
    if running:
        result["running_when_stopped"] = running
    return result


def _test_lines(path: pathlib.Path) -> tuple[dict, list[str]]:
    """``({test: outcome, seconds, message}, [tests started and never finished])`` from the plugin's lines."""
    tests, started = {}, []
    if path.exists():
        for line in path.read_text().splitlines():
            entry = json.loads(line)
            if entry["event"] == "started":
                started.append(entry["test"])
            else:
                tests[entry["test"]] = {k: entry[k] for k in ("outcome", "seconds", "message")}
    return tests, [name for name in started if name not in tests]


def gpu_benchmark(ctx: Context) -> dict:
    """``benchmarks/gpu_mhc.py``: its JSON's figures (and its plot beside this one's); on a GPU its
    Triton rows must have run."""
    out = ctx.out_dir / "gpu_mhc.json"
    command = [sys.executable, str(ROOT / "benchmarks" / "gpu_mhc.py"), "--out", str(out)]
    if ctx.dry:
        command += ["--rounds", "2", "--hidden", "64", "--tokens", "128", "--model-hidden", "64"]
    if ctx.args.megatron_lm:
        command += ["--megatron-lm", str(ctx.args.megatron_lm)]
    output = _run(command, ctx)
    if not out.exists():
        raise StepFailed(f"gpu_mhc.py exited 0 and wrote no {out.name}", output)
    figures = json.loads(out.read_text())
    if not ctx.dry:
        absent = [f"C = {hidden}: {row['absent']}" for hidden, entry in figures["table"].items()
                  for row in (entry["sublayer"]["triton"], entry["mappings_bandwidth"]) if "absent" in row]
        if absent:
            raise StepFailed(f"Triton's kernels did not run on the GPU: {'; '.join(absent)}", output,
                             {"figures": figures})
    return {"figures": figures}


def train_small(ctx: Context) -> dict:
    """``lightning-mhc-train`` with ``mhc_block``: per-step loss (it must fall) and the run's speed
    and memory."""
    steps = 8 if ctx.dry else TRAIN_STEPS
    overrides = (["trainer=cpu", "model=tiny", "data.seq_length=32"] if ctx.dry else ["trainer=gpu", "model=small"])
    with tempfile.TemporaryDirectory() as scratch:
        run_dir = pathlib.Path(scratch) / "run"
        output = _run([sys.executable, "-m", "lightning_mhc.cli.train", *overrides, "recompute=mhc_block",
                       f"trainer.max_steps={steps}", "trainer.log_every_n_steps=1", "trainer.val_check_interval=1000",
                       "trainer.checkpoint_every_n_steps=1000", "trainer.enable_progress_bar=false",
                       f"hydra.run.dir={run_dir}"], ctx, cwd=pathlib.Path(scratch))
        metrics = run_dir / "metrics.csv"
        if not metrics.exists():
            found = sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*")) if run_dir.exists() else []
            raise StepFailed(f"the run wrote no metrics.csv (its folder holds: {', '.join(found) or 'nothing'})",
                             output)
        rows = list(csv.DictReader(open(metrics)))
    series = {key: [(int(r["step"]), float(r[key])) for r in rows if r.get(key)]
              for key in ("train_loss", "step_time_ms", "tokens_per_sec", "max_cuda_mb")}
    losses = [value for _, value in series["train_loss"]]
    later = [value for step, value in series["step_time_ms"] if step > 2]  # after compilation and warm-up
    result = {"steps": steps, "overrides": overrides, "losses": losses,
              "loss_fell_by": losses[0] - losses[-1] if losses else None,
              "median_step_time_ms": sorted(later)[len(later) // 2] if later else None,
              "tokens_per_sec": series["tokens_per_sec"][-1][1] if series["tokens_per_sec"] else None,
              "max_cuda_mb": max((v for _, v in series["max_cuda_mb"]), default=None)}
    if len(losses) != steps:
        raise StepFailed(f"{len(losses)} losses logged for {steps} steps", output, result)
    result["loss_fell_by_fraction"] = loss_fall(losses)
    if result["loss_fell_by_fraction"] < MIN_LOSS_FALL:
        raise StepFailed(f"the loss did not fall in {steps} steps: the last third's mean is "
                         f"{result['loss_fell_by_fraction']:.1%} below the first loss (at least "
                         f"{MIN_LOSS_FALL:.0%} asked)", output, result)
    _plot_training(series, ctx.out_dir / "train_small.png")
    return result


MIN_LOSS_FALL = 0.05
"""How far the training step's loss must fall: the mean of its last third of steps at least 5 %
below its first loss. Batches differ from step to step, so a run that learns nothing still ends
lower by chance (8 dry-run steps at a learning rate of 1e-9: 1.6 %; at the default 3e-3: 10 %)."""


def loss_fall(losses: list[float]) -> float:
    """The fraction by which the mean of the last third of ``losses`` is below the first."""
    last = losses[-max(1, len(losses) // 3):]
    return 1 - sum(last) / len(last) / losses[0]


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


def v4_hyper_connection(ctx: Context) -> dict:
    """``benchmarks/v4_hyper_connection.py``: DeepSeek-V4's hyper-connection sub-layer on our
    kernels (Triton's on the GPU) beside transformers' module, time and saved bytes. Needs
    transformers with DeepSeek-V4 (5.24 or later) in the image: without it the step fails saying
    so, and the others have run."""
    if importlib.util.find_spec("transformers") is None or \
            importlib.util.find_spec("transformers.models.deepseek_v4") is None:
        raise StepFailed("transformers with DeepSeek-V4 (>= 5.24) is not installed here")
    out = ctx.out_dir / "v4_hyper_connection.json"
    command = [sys.executable, str(ROOT / "benchmarks" / "v4_hyper_connection.py"), "--out", str(out)]
    if ctx.dry:
        command += ["--rounds", "2", "--hidden", "32", "--tokens", "64", "--device", "cpu"]
    else:
        command += ["--hidden", "4096", "--tokens", "8192", "--implementations", "auto", "fused"]
    output = _run(command, ctx, cwd=ROOT / "benchmarks")
    if not out.exists():
        raise StepFailed(f"v4_hyper_connection.py exited 0 and wrote no {out.name}", output)
    return {"figures": json.loads(out.read_text())}


STEPS = [Step("gpu_tests", gpu_tests, cap_s=300, so_far=_tests_so_far), Step("gpu_mhc", gpu_benchmark, cap_s=240),
         Step("train_small", train_small, cap_s=180), Step("v4_hyper_connection", v4_hyper_connection, cap_s=90)]
"""In order of value: what the GPU tests show first, then the figures, then the training run."""


if __name__ == "__main__":
    sys.exit(main())
