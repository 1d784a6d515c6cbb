"""The benchmarks run as written (tiny sizes, one round): their JSON has every variant and ratio.
The figures themselves are taken by hand (README, "Fast mHC")."""
from __future__ import annotations

import importlib.util
import json
import math
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import pytest

from script_runs import run_on_ranks
from subprocess_env import child_env

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"


def _run(script: str, *args: str) -> None:
    proc = subprocess.run([sys.executable, str(BENCHMARKS / script), "--rounds", "1", *args],
                          cwd=BENCHMARKS, env=child_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]


def _run_on_a_rank(script: str, *args: str) -> None:
    """``python script *args`` in the benchmarks' folder, on a rank forked from the preloaded server
    (``run_on_ranks``): for a one-process benchmark whose subject is the JSON it writes, not how its
    interpreter starts (a fresh one spends about 7 s of CPU importing torch, Lightning and
    megatron-core). A failure, a non-zero ``sys.exit`` included, raises ``RankError``."""
    run_on_ranks(str(BENCHMARKS / script), 1, *args, cwd=BENCHMARKS, timeout=600)


def test_mhc_overhead(tmp_path):
    out = tmp_path / "overhead.json"
    _run("mhc_overhead.py", "--hidden", "64", "--out", str(out))
    result = json.loads(out.read_text())
    row = result["table"]["64"]
    assert set(row) == {"no_hc", "reference/none", "reference/mhc_block", "fused/none", "fused/mhc_block", "ratios"}
    for impl in ("reference", "fused"):
        ratios = row["ratios"][impl]
        assert ratios["block_vs_no_hc_bytes"] <= 1.0  # block recompute keeps no more than the model without mHC
    assert row["ratios"]["fused"]["hc_vs_no_hc_bytes"] < row["ratios"]["reference"]["hc_vs_no_hc_bytes"]


def test_mhc_sublayer(tmp_path):
    """The headline comparison with the ``hyper-connections`` package (in the dev extra, so it runs
    here): every variant timed, the peer's included, and the fused sub-layer saves fewer bytes than
    the reference and than the peer."""
    out = tmp_path / "sublayer.json"
    _run("mhc_sublayer.py", "--hidden", "64", "--tokens", "128", "--out", str(out))
    row = json.loads(out.read_text())["table"]["64"]
    assert set(row) == {"reference", "fused", "hyper-connections"}
    assert all(v["median_s"] > 0 and v["time_vs_fused"] > 0 for v in row.values()), row
    assert row["fused"]["saved_bytes_per_token"] < row["reference"]["saved_bytes_per_token"]
    assert row["fused"]["saved_bytes_per_token"] < row["hyper-connections"]["saved_bytes_per_token"]


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="the hf extra: pip install -e '.[hf]'")
def test_byom_vs_model_parallel(tmp_path, monkeypatch):
    """The benchmark's ``main`` (one round of 3 steps), each of its fits the script's own ``--variant``
    run on 2 ranks forked from the preloaded server (``run_on_ranks``, as under torchrun, which
    Lightning's ``ModelParallelStrategy`` and ours both join), not a fresh script whose Lightning
    launches a fresh second rank: the subject is the JSON it writes from the fits, and the 5 fresh
    interpreters (the script, then a script and its rank 1 per fit) were most of its CPU."""
    out = tmp_path / "byom.json"
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    byom = importlib.import_module("byom_vs_model_parallel")

    def run_fit(variant: str, steps: int) -> dict:
        fit_out = tmp_path / f"{variant}.json"
        run_on_ranks(str(BENCHMARKS / "byom_vs_model_parallel.py"), 2, "--variant", variant, "--steps", str(steps),
                     "--fit-out", str(fit_out), cwd=BENCHMARKS, timeout=600)
        return json.loads(fit_out.read_text())

    monkeypatch.setattr(byom, "run_fit", run_fit)
    monkeypatch.setattr(sys, "argv", ["byom_vs_model_parallel.py", "--rounds", "1", "--steps", "3", "--out", str(out)])
    byom.main()
    result = json.loads(out.read_text())
    assert set(result["median_step_seconds"]) == {"lightning", "ours"}
    assert all(len(runs) == 1 and len(runs[0]) == 1 for runs in result["step_seconds"].values())
    assert result["user_lines"]["ours"] < result["user_lines"]["lightning"]
    assert result["ratios"]["step_time_ours_vs_lightning"] > 0
    for losses in result["first_losses"].values():  # both trained a tiny Llama from scratch: about ln(vocab)
        assert abs(losses[0] - math.log(result["model"]["vocab"])) < 0.5


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="the hf extra: pip install -e '.[hf]'")
def test_mhc_any_model(tmp_path):
    out = tmp_path / "mhc_any_model.json"
    _run_on_a_rank("mhc_any_model.py", "--rounds", "1", "--no-parallel", "--hidden", "64", "--layers", "2", "--out",
                   str(out), "--plot", str(tmp_path / "plot.png"))
    result = json.loads(out.read_text())
    one = result["one_process"]
    assert set(one["retained_bytes"]) == {"plain, none", "mHC, none", "plain, full", "mHC, mhc_block"}
    assert one["step_time_ratio"] > 0 and one["retained_ratio"] > 0
    assert len(result["exactness"]) == 10  # every built-in family
    assert all(diff <= 1e-5 for row in result["exactness"].values() for diff in row.values())


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="the hf extra: pip install -e '.[hf]'")
def test_retrofit(tmp_path):
    """The retrofit benchmark at a tiny size: pretrained, saved, continued in three variants; at
    step 0 the 4 streams at gating factor 0 are the plain model (its validation loss within 1e-5),
    every variant logs its validation losses at the same steps, and the streams' divergence is
    reported for the hyper-connected ones."""
    out = tmp_path / "retrofit.json"
    _run_on_a_rank("retrofit.py", "--hidden", "32", "--layers", "2", "--seq", "16", "--batch", "2", "--pretrain-steps",
                   "3", "--steps", "2", "--eval-every", "1", "--seeds", "0", "--max-bytes", "400000", "--out", str(out),
                   "--plot", str(tmp_path / "retrofit.png"))
    result = json.loads(out.read_text())
    runs = result["seeds"]["0"]
    assert set(runs) == {"plain", "mHC, gate 0", "mHC, gate 0.01"}
    assert all(list(run["validation"]) == ["0", "1", "2"] for run in runs.values())
    assert result["summary"]["mHC, gate 0"]["step0_vs_plain"] < 1e-5
    assert runs["plain"]["divergence"] is None and len(runs["mHC, gate 0.01"]["divergence"]) == 2
    assert result["corpus"]["tokens"]["train"] > 10_000 and result["model"]["parameters"] > 0


def test_fp64_accuracy(tmp_path):
    """Every output and gradient of the sub-layer, fp32 and bf16 and the projection's emulated
    tensor-core precisions, with both errors (not timed: no rounds): each within the bound the
    suite holds the fused path to (``ERROR_FACTOR`` x the reference's + ``ERROR_FLOOR``), except
    plain tf32 on an fp32 stream, which must break it."""
    import torch
    from model_utils import ERROR_FACTOR, ERROR_FLOOR

    out = tmp_path / "accuracy.json"
    _run_on_a_rank("fp64_accuracy.py", "--hidden", "32", "--tokens", "16", "--out", str(out))
    errors = json.loads(out.read_text())["errors"]
    assert set(errors) == {"float32", "bfloat16", "float32, projection tf32x3 (emulated)",
                           "float32, projection tf32 (emulated)", "bfloat16, projection tf32 (emulated)"}
    for label, table in errors.items():  # the bound the test suite holds the fused path to
        dtype = torch.float32 if label.startswith("float32") else torch.bfloat16
        within = {name: e["ours"] <= ERROR_FACTOR * e["reference"] + ERROR_FLOOR[dtype] for name, e in table.items()}
        assert len(table) == 8 and all(e["reference"] > 0 for e in table.values()), table
        # plain tf32 products on an fp32 stream: about 2000x the fp32 reference (why fp32 keeps fp32)
        assert all(within.values()) if label != "float32, projection tf32 (emulated)" else not any(within.values()), \
            (label, table)
    assert max(e["reference"] for e in errors["float32"].values()) < 1e-5  # fp32 itself, not a looser dtype


def test_distributed_optimizer(tmp_path):
    """Its state per rank is the ideal (AdamW's / DP) within 2 %, on DP 1 and 2 (4 in the figures)."""
    out = tmp_path / "zero.json"
    _run("distributed_optimizer.py", "--hidden", "32", "--vocab", "256", "--dp", "1", "2", "--out", str(out))
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert {(r["dp"], r["optimizer"]) for r in rows} == {(dp, o) for dp in (1, 2) for o in ("AdamW", "distributed")}
    peak = result["peak_resident_mib"]  # measured at the largest DP asked for, each variant alone
    assert peak["dp"] == 2 and all(len(ranks) == 2 for ranks in peak["per_rank"].values())
    assert all(v > 0 for sizes in peak["largest"].values() for v in sizes.values())
    for row in rows:
        if row["optimizer"] == "distributed":
            assert abs(row["state_vs_ideal"] - 1) <= 0.02, row
            assert len(row["per_rank_bytes"]) == row["dp"]


def test_moe(tmp_path):
    """EP 1 and 2 on 2 ranks: the experts' bytes and their AdamW state per rank halve at EP 2; both
    models timed (4 ranks and EP 4 in the figures)."""
    out = tmp_path / "moe.json"
    _run("moe.py", "--world", "2", "--hidden", "32", "--experts", "4", "--out", str(out))
    rows = json.loads(out.read_text())["rows"]
    assert [r["ep"] for r in rows] == [1, 2]
    assert rows[1]["expert_bytes_vs_ep1"] == rows[1]["expert_state_vs_ep1"] == 0.5
    assert all(r["mhc_ratio"] > 0 and set(r["tokens_per_s"]) == {"mHC", "no mHC"} for r in rows)


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="the hf extra: pip install -e '.[hf]'")
def test_pretrained_loading(tmp_path):
    """TP 2 x PP 2 reading a 20 MiB Llama: each rank's peak allocation stays near its part (7 MiB;
    measured 7.4 MiB). Building modules whole before the split, and reading whole slices at once,
    took 15.6 to 19.0 MiB."""
    out = tmp_path / "loading.json"
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "pretrained_loading.py"), "--hidden", "256", "--layers",
                           "4", "--vocab", "8192", "--out", str(out)], cwd=BENCHMARKS, env=child_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert len(result["parallel"]) == 4
    for rank in result["parallel"]:
        assert rank["part_mib"] < result["whole"]["model_mib"]
        assert rank["anon_mib"] <= 1.25 * rank["part_mib"] + 1.0, rank


def test_preprocess_throughput(tmp_path):
    out = tmp_path / "preprocess.json"
    _run("preprocess_throughput.py", "--copies", "1", "--out", str(out))
    result = json.loads(out.read_text())
    assert set(result["median_tokens_per_sec"]) == {"workers=1", "workers=2", "encode_batch"}
    assert result["corpus"]["tokens"] > 100_000 and all(v > 0 for v in result["median_tokens_per_sec"].values())


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs Triton's kernels in its interpreter")
def test_gpu_mhc_triton_rows_run_their_gpu_code_under_the_interpreter(monkeypatch, capsys, tmp_path):
    """``gpu_mhc.py``'s Triton rows run only on a GPU (their times mean nothing in the interpreter),
    so their code would first run on a lent GPU's minutes: here it runs on CPU tensors in Triton's
    interpreter, the CUDA check bypassed and the device named as an H100. The sub-layer row and the
    projection at each variant (bf16 tf32; fp32 under each of torch's matmul precisions), their
    report lines and the plot."""
    import argparse

    import torch

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    gpu_mhc = importlib.import_module("gpu_mhc")
    monkeypatch.setattr(gpu_mhc, "_check_triton_runs", lambda device: None)
    monkeypatch.setattr(gpu_mhc, "SUBLAYER", ("no_hc", "triton"))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: "NVIDIA H100 80GB HBM3")
    args, cpu = argparse.Namespace(tokens=5, rounds=1, megatron_lm=None), torch.device("cpu")
    rows = gpu_mhc._sublayer(8, args, cpu, torch.float32)
    assert rows["triton"]["median_s"] > 0 and rows["triton"]["saved_bytes_per_token"] > 0
    bandwidth = gpu_mhc._bandwidth(8, args, cpu)
    variants = bandwidth["variants"]
    assert [(v["stream"], v["matmul_precision"], v["precision"]) for v in variants.values()] == [
        ("bfloat16", "highest", "tf32"), ("float32", "highest", "ieee"), ("float32", "high", "tf32x3"),
        ("float32", "medium", "tf32")]
    assert all(v["fraction_of_peak"] > 0 and v["requested_bytes"] >= v["bytes"] for v in variants.values())
    assert torch.get_float32_matmul_precision() == "highest"  # restored
    result = dict(device="NVIDIA H100 80GB HBM3", dtype="float32", megatron_lm="absent", model=dict(
        hidden=8, precision="32-true", hc_vs_no_hc=1.0, mhc_block_vs_none=1.0),
                  table={8: dict(sublayer=rows, mappings_bandwidth=bandwidth)})
    gpu_mhc._report(result, args)
    printed = capsys.readouterr().out
    assert printed.count("projection kernel, ") == 4 and "tf32x3 products" in printed
    gpu_mhc._plot(result, tmp_path / "plot.png", args.tokens)


DRY_RUN_PASSED = {
    "test_auto_runs_tritons_kernels_on_the_gpu",
    *(f"test_triton_kernels_against_an_fp64_evaluation_at_real_shapes[{p}]"
      for p in ("dtype0-highest", "dtype1-highest", "dtype2-high", "dtype3-medium")),
    "test_res_post_kernel_at_real_shapes[0.0]", "test_res_post_kernel_at_real_shapes[0.1]",
    "test_block_recompute_is_bit_exact_with_dropout[fused]", "test_block_recompute_is_bit_exact_with_dropout[compile]",
    "test_compile_of_a_model_with_recompute_hooks",
    "test_deepseek_v4_convention_on_triton_against_an_fp64_evaluation[False]",
    "test_deepseek_v4_convention_on_triton_against_an_fp64_evaluation[True]",
    "test_hy_v4_connection_on_triton_against_an_fp64_evaluation[False]",
    "test_hy_v4_connection_on_triton_against_an_fp64_evaluation[True]"}
DRY_RUN_SKIPPED = {
    "test_the_kernels_run_compiled_not_in_the_interpreter", "test_block_recompute_is_bit_exact_with_dropout[auto]",
    "test_retained_bytes_match_the_cuda_allocator[none]", "test_retained_bytes_match_the_cuda_allocator[mhc_block]",
    "test_the_strategy_groups_on_nccl_at_world_size_one", "test_training_on_one_gpu_with_bf16_and_the_fused_kernels"}
"""The GPU set's outcomes in the CPU dry run (Triton's interpreter): the CUDA-only checks skip."""
RETURNED_NAME = re.compile(r"[A-Za-z0-9._-]+")


def _device_tool_returns(out: pathlib.Path) -> None:
    """What the device tool brings back from ``$OUT``: at most 8 files of at most 16 MiB, two
    folders deep, names of letters, digits, '.', '_' and '-'."""
    files = [p for p in out.rglob("*") if p.is_file()]
    assert 0 < len(files) <= 8, files
    for path in files:
        relative = path.relative_to(out)
        assert len(relative.parts) <= 3 and all(RETURNED_NAME.fullmatch(part) for part in relative.parts), relative
        assert path.stat().st_size <= 16 * 2**20, path


@pytest.fixture(scope="module")
def gpu_check_dry_run(tmp_path_factory) -> tuple[subprocess.CompletedProcess, pathlib.Path]:
    """``make gpu-check``'s command on a machine without CUDA, with ``$OUT`` set as the device tool
    sets it: the process and its ``$OUT``. Run once for the tests that read what it wrote (its
    DeepSeek-V4 step is ``test_v4_hyper_connection``'s benchmark at its sizes: run once, not twice)."""
    tmp_path = tmp_path_factory.mktemp("gpu_check")
    out = tmp_path / "out"
    out.mkdir()
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "gpu_check.py")], cwd=tmp_path,
                          env=child_env(OUT=str(out)), capture_output=True, text=True, timeout=600)
    return proc, out


@pytest.mark.slow
def test_gpu_check_without_cuda_is_a_dry_run_of_every_step(gpu_check_dry_run):
    """``make gpu-check``'s command on a machine without CUDA: the GPU test set's CPU dry run (so a
    broken GPU test shows here before a lent GPU's minutes are spent on it; every test's outcome as
    expected), ``gpu_mhc.py`` at CPU sizes with the GPU columns absent and why (Triton's times,
    peak memory, the kernel's bandwidth, Megatron's mHC without a checkout), and 8 training steps
    with ``mhc_block`` whose loss falls; one JSON in ``$OUT`` holds the device, the versions and
    every step, and every file there is one the device tool returns."""
    proc, out = gpu_check_dry_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["dry_run"] and report["device"]["name"].startswith("CPU") and report["versions"]["torch"]
    assert report["seconds"] <= report["budget_s"] == 540
    tests = report["steps"]["gpu_tests"]
    outcomes = {name: test["outcome"] for name, test in tests["tests"].items()}
    assert {name for name, o in outcomes.items() if o == "passed"} == DRY_RUN_PASSED, outcomes
    assert set(tests["skipped"]) == {name for name, o in outcomes.items() if o == "skipped"} == DRY_RUN_SKIPPED
    assert all(tests["skipped"].values())  # each with its reason

    result = report["steps"]["gpu_mhc"]["figures"]
    (hidden,) = result["table"]
    rows = result["table"][hidden]["sublayer"]
    assert set(rows) == {"no_hc", "reference", "compile", "fused", "triton", "megatron_eager", "megatron_compiled"}
    for name in ("no_hc", "reference", "compile", "fused"):
        assert rows[name]["median_s"] > 0 and rows[name]["peak_bytes"] is None
    assert "needs CUDA" in rows["triton"]["absent"]
    assert "needs CUDA" in result["table"][hidden]["mappings_bandwidth"]["absent"]
    if (BENCHMARKS.parent / ".megatron-lm").is_dir():  # make gpu-wheels MEGATRON_LM=... was run here
        assert rows["megatron_eager"]["median_s"] > 0 and rows["megatron_compiled"]["median_s"] > 0
    else:
        assert "--megatron-lm" in rows["megatron_eager"]["absent"]
    assert rows["fused"]["saved_bytes_per_token"] < rows["reference"]["saved_bytes_per_token"]
    assert result["model"]["hc_vs_no_hc"] > 0 and result["model"]["mhc_block_vs_none"] > 0

    v4 = report["steps"]["v4_hyper_connection"]
    assert v4["status"] == "passed", v4
    assert set(v4["figures"]["table"]["32"]) == {"transformers", "fused", "reference"}

    train = report["steps"]["train_small"]
    assert len(train["losses"]) == 8 and train["loss_fell_by_fraction"] >= 0.05, train["losses"]
    assert train["median_step_time_ms"] > 0 and train["max_cuda_mb"] is None
    assert {p.name for p in out.iterdir()} >= {"gpu_check.json", "gpu_check.log", "gpu_tests.jsonl", "gpu_mhc.json"}
    _device_tool_returns(out)


def _gpu_check(monkeypatch):
    """``benchmarks/gpu_check.py`` imported here, its import path changes undone after the test."""
    monkeypatch.setattr(sys, "path", [str(BENCHMARKS), *sys.path])
    monkeypatch.delitem(sys.modules, "gpu_check", raising=False)
    return importlib.import_module("gpu_check")


SLEEPER = """import os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
open(sys.argv[1], "w").write(str(child.pid))
time.sleep(300)
"""


def _gone(pid: int, within_s: float = 10.0) -> bool:
    """Whether process ``pid`` has ended (or is a zombie waiting for its reaper) within the time."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            state = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return True
        if state == "Z":
            return True
        time.sleep(0.1)
    return False


def test_gpu_check_records_each_failing_step_and_runs_the_next(monkeypatch, tmp_path):
    """Each step fails in turn, each its own way: one raises, one finds no ``metrics.csv`` (the
    training step's own reading, its command stubbed), one runs past its time (its process and
    that process's child killed); a step after them reads the JSON written so far and finds every
    earlier step's result there; the exit status is 1, the report names each failure, and a stale
    ``gpu_tests.jsonl`` from an earlier run in the folder is removed, not read."""
    gpu_check = _gpu_check(monkeypatch)
    (tmp_path / "gpu_tests.jsonl").write_text('{"test": "stale", "event": "finished", "outcome": "passed"}\n')
    pid_file = tmp_path / "grandchild.pid"
    seen = {}

    def raises(ctx):
        raise RuntimeError("a crash in a benchmark")

    def no_metrics(ctx):
        with monkeypatch.context() as patch:
            patch.setattr(gpu_check, "_run", lambda *args, **kwargs: "the training command's output")
            return gpu_check.train_small(ctx)

    def past_its_time(ctx):
        gpu_check._run([sys.executable, "-c", SLEEPER, str(pid_file)], ctx)

    def reads_the_report(ctx):
        seen.update(json.loads((ctx.out_dir / "gpu_check.json").read_text())["steps"])
        return {"stale_tests_file": (ctx.out_dir / "gpu_tests.jsonl").exists()}

    monkeypatch.setattr(gpu_check, "STEPS", [
        gpu_check.Step("raises", raises, 60), gpu_check.Step("no_metrics", no_metrics, 60),
        gpu_check.Step("past_its_time", past_its_time, 4), gpu_check.Step("reads_the_report", reads_the_report, 60)])
    assert gpu_check.main(["--out-dir", str(tmp_path), "--budget-s", "120", "--dry-run"]) == 1
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    steps = report["steps"]
    assert steps["environment"]["status"] == "passed"
    assert steps["raises"]["status"] == "failed" and steps["raises"]["reason"] == "RuntimeError: a crash in a benchmark"
    assert steps["no_metrics"]["status"] == "failed" and "wrote no metrics.csv" in steps["no_metrics"]["reason"]
    assert steps["past_its_time"]["status"] == "failed" and "killed past its 4 s" in steps["past_its_time"]["reason"]
    assert 4 <= steps["past_its_time"]["seconds"] < 15
    assert _gone(int(pid_file.read_text())), "the step's own child outlived the kill"
    assert steps["reads_the_report"] == {"status": "passed", "stale_tests_file": False, **{
        "seconds": steps["reads_the_report"]["seconds"]}}
    assert {name: seen[name]["status"] for name in ("environment", "raises", "no_metrics", "past_its_time")} == {
        "environment": "passed", "raises": "failed", "no_metrics": "failed", "past_its_time": "failed"}
    assert seen["reads_the_report"]["status"] == "running"


def test_the_training_step_asks_a_loss_that_falls_by_more_than_chance(monkeypatch):
    """The losses of two real dry-run trainings (8 steps, ``trainer=cpu model=tiny``, batches that
    differ each step): at the default learning rate the check passes; at ``optim.lr=1e-9``, where
    nothing is learnt, the last loss is still below the first by chance, and the check fails."""
    gpu_check = _gpu_check(monkeypatch)
    learns = [5.4640, 5.2429, 5.2416, 5.1437, 5.0384, 4.9501, 4.9461, 4.8510]
    learns_nothing = [5.4640, 5.3454, 5.4283, 5.4357, 5.3845, 5.3422, 5.4127, 5.3706]
    assert learns_nothing[-1] < learns_nothing[0]  # what the old check (last < first) accepted
    assert gpu_check.loss_fall(learns) >= gpu_check.MIN_LOSS_FALL > gpu_check.loss_fall(learns_nothing)


def test_gpu_check_without_its_wheels_says_so_and_goes_on(monkeypatch, tmp_path):
    """A budget that could not work is refused in one line (exit 2) before anything runs. On a
    machine that lacks what the package imports and has no ``.whl/`` to install it from,
    the environment step fails with its own message (``find_spec('megatron.core')`` without
    ``megatron`` raises; it is asked safely), and the steps after it still run and are recorded;
    a missing ``nvidia-smi`` is recorded as such."""
    gpu_check = _gpu_check(monkeypatch)
    for budget in ("0", "-5", "900"):  # a budget that could not work is refused before anything runs
        with pytest.raises(SystemExit) as refused:
            gpu_check.main(["--out-dir", str(tmp_path), "--budget-s", budget])
        assert refused.value.code == 2 and not (tmp_path / "gpu_check.json").exists()
    monkeypatch.setattr(gpu_check, "IMPORTS", ("torch", "megatron_absent_package.core"))
    monkeypatch.setattr(gpu_check, "WHEELS", tmp_path / ".whl")
    monkeypatch.setattr(gpu_check, "STEPS", [gpu_check.Step("after", lambda ctx: {"ran": True}, 60)])
    assert gpu_check.main(["--out-dir", str(tmp_path), "--budget-s", "60", "--dry-run"]) == 1
    steps = json.loads((tmp_path / "gpu_check.json").read_text())["steps"]
    assert steps["environment"]["status"] == "failed"
    assert steps["environment"]["reason"].startswith("missing megatron_absent_package.core and no .whl/")
    assert "make gpu-wheels" in steps["environment"]["reason"]
    assert steps["after"]["status"] == "passed" and steps["after"]["ran"]

    class CudaTorch:  # a CUDA device whose machine has no nvidia-smi on its PATH
        class cuda:
            is_available = staticmethod(lambda: True)
            get_device_properties = staticmethod(lambda index: type("Props", (), dict(
                name="NVIDIA H100 80GB HBM3", major=9, minor=0, total_memory=80 * 2**30, multi_processor_count=132)))

        class version:
            cuda = "13.0"

    monkeypatch.setenv("PATH", str(tmp_path))
    assert gpu_check._device(CudaTorch)["driver"].startswith("nvidia-smi: [Errno 2] No such file")


def test_gpu_check_sigterm_kills_the_running_step_and_writes_the_report(tmp_path):
    """The device tool ends a command at its limit: SIGTERM to ``gpu_check.py`` kills the running
    step's processes, records the step as interrupted with its seconds and what it had seen (the
    GPU set: the tests that had finished), writes the JSON and exits 143."""
    driver = f"""import sys, time
sys.path.insert(0, {str(BENCHMARKS)!r})
import gpu_check
def sleeps(ctx):
    gpu_check._run([sys.executable, "-c", {SLEEPER!r}, {str(tmp_path / "grandchild.pid")!r}], ctx)
gpu_check.STEPS = [gpu_check.Step("sleeps", sleeps, 300, so_far=lambda ctx: {{"tests_finished": 2}})]
sys.exit(gpu_check.main(["--out-dir", {str(tmp_path)!r}, "--dry-run"]))
"""
    proc = subprocess.Popen([sys.executable, "-c", driver], env=child_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "grandchild.pid").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 143, output
    steps = json.loads((tmp_path / "gpu_check.json").read_text())["steps"]
    assert steps["sleeps"]["status"] == "failed" and steps["sleeps"]["reason"] == "interrupted by SIGTERM"
    assert steps["sleeps"]["seconds"] > 0 and steps["sleeps"]["tests_finished"] == 2  # what it had seen
    assert _gone(int((tmp_path / "grandchild.pid").read_text()))


@pytest.mark.slow
def test_gpu_check_ends_within_a_small_budget(tmp_path):
    """The real dry run with a 25 s budget (the GPU test set alone takes about 30 s with every cache
    warm; a step needs 15 s of the budget left to start, and on a loaded machine the environment
    step before it took 6 s: with 20 s the set did not start): it ends within the budget (plus
    Python's start), the GPU test set killed at what was left, the tests it finished and the one it
    was running as its lines say, the later steps not run for want of time, and none of its
    processes left."""
    budget_s = 25
    start = time.monotonic()
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "gpu_check.py"), "--budget-s", str(budget_s)], cwd=tmp_path,
                          env=child_env(OUT=str(tmp_path)), capture_output=True, text=True, timeout=300)
    elapsed = time.monotonic() - start
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["seconds"] <= budget_s and elapsed <= budget_s + 20, (report["seconds"], elapsed)
    tests = report["steps"]["gpu_tests"]
    assert tests["status"] == "failed" and "killed past its" in tests["reason"], tests
    lines = [json.loads(line) for line in (tmp_path / "gpu_tests.jsonl").read_text().splitlines()] \
        if (tmp_path / "gpu_tests.jsonl").exists() else []
    finished = {line["test"] for line in lines if line["event"] == "finished"}
    started = [line["test"] for line in lines if line["event"] == "started"]
    assert set(tests["tests"]) == finished and tests.get("running_when_stopped", []) == [
        name for name in started if name not in finished]
    for name in ("gpu_mhc", "train_small", "v4_hyper_connection"):
        assert report["steps"][name]["status"] == "not run" and "budget left" in report["steps"][name]["reason"]
    log = str(tmp_path / "gpu_tests.jsonl")
    left = [pid for pid in os.listdir("/proc") if pid.isdigit() and _environ_has(pid, f"GPU_TEST_LOG={log}")]
    assert not left, left


def _environ_has(pid: str, entry: str) -> bool:
    try:
        return entry.encode() in pathlib.Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False


def test_the_documented_gpu_call_is_what_make_gpu_wheels_prints(monkeypatch, tmp_path, capsys):
    """docs/benchmarks.md gives the one device call for a lent GPU: its command is a make target
    that runs ``gpu_check.py``, its ``carry`` is what ``make gpu-wheels`` fills (each path
    git-ignored, so it travels only when carried), its ``timeout_s`` the device limit the budget
    leaves room in, and it is the call ``make gpu-wheels`` prints."""
    gpu_check = _gpu_check(monkeypatch)
    root = BENCHMARKS.parent
    docs = (root / "docs" / "benchmarks.md").read_text()
    (call,) = set(re.findall(r'run\(command="[^"]*", carry=\[[^]]*\], timeout_s=\d+\)', docs))
    carry = [gpu_check.WHEELS.name, gpu_check.MEGATRON_LM_COPY.name]
    assert call == gpu_check.device_call(carry)
    command = re.search(r'command="([^"]*)"', call).group(1)
    assert command == "make gpu-check"
    makefile = (root / "Makefile").read_text()
    assert re.search(r"^gpu-check:\n\t\$\(GPU_PYTHON\) benchmarks/gpu_check.py", makefile, re.M)
    assert re.search(r"^gpu-wheels:\n\t\$\(PYTHON\) benchmarks/gpu_check.py --download-wheels \.whl ", makefile, re.M)
    folders = [f"{name}/" for name in carry]
    ignored = subprocess.run(["git", "check-ignore", "--no-index", *folders], cwd=root, capture_output=True, text=True)
    assert ignored.stdout.split() == folders
    assert gpu_check.DEFAULT_BUDGET_S + 30 <= gpu_check.DEVICE_TIMEOUT_S == int(re.search(r"timeout_s=(\d+)", call)[1])

    # make gpu-wheels MEGATRON_LM=CHECKOUT (pip's downloads stubbed): the module copied, the call printed
    checkout = tmp_path / "Megatron-LM"
    (checkout / gpu_check.MEGATRON_LM_FILE).parent.mkdir(parents=True)
    (checkout / gpu_check.MEGATRON_LM_FILE).write_text("class HyperConnectionModule: ...\n")
    monkeypatch.setattr(gpu_check, "MEGATRON_LM_COPY", tmp_path / ".megatron-lm")
    monkeypatch.setattr(gpu_check.subprocess, "run", lambda command: subprocess.CompletedProcess(command, 0))
    (tmp_path / ".whl").mkdir()
    assert gpu_check.download_wheels(tmp_path / ".whl", checkout) == 0
    assert (tmp_path / ".megatron-lm" / "hyper_connection.py").read_text() == "class HyperConnectionModule: ...\n"
    assert call in capsys.readouterr().out


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="the hf extra: pip install -e '.[hf]'")
def test_v4_hyper_connection(gpu_check_dry_run):
    """DeepSeek-V4's and HY-V4's sub-layers on our kernels beside transformers' modules: every
    variant timed, the fused one saves fewer bytes than transformers', and the conventions' H_res table (with the
    transpose the two orders are one computation: in fp64 they agree to rounding; fp32's bits depend on the
    CPU's summation order, 4e-5 apart on CI's machine). The benchmark as the gpu-check dry run
    runs it (``--hidden 32 --tokens 64 --device cpu``, 2 rounds): its JSON, read here."""
    pytest.importorskip("transformers.models.deepseek_v4")
    proc, out = gpu_check_dry_run
    step = json.loads((out / "gpu_check.json").read_text())["steps"]["v4_hyper_connection"]
    assert step["status"] == "passed", step
    result = json.loads((out / "v4_hyper_connection.json").read_text())
    row = result["table"]["32"]
    assert set(row) == {"transformers", "fused", "reference"}
    assert all(v["median_s"] > 0 for v in row.values()), row
    assert row["fused"]["saved_bytes_per_token"] < row["transformers"]["saved_bytes_per_token"]
    hy_v4 = result["hy_v4_table"]["32"]  # HY-V4's sub-layer in the same run
    assert set(hy_v4) == {"transformers", "fused", "reference"}
    assert all(v["median_s"] > 0 for v in hy_v4.values()), hy_v4
    assert hy_v4["fused"]["saved_bytes_per_token"] < hy_v4["transformers"]["saved_bytes_per_token"]
    assert all(r["with_transpose"] < 1e-12 for r in result["sinkhorn_conventions"]), result["sinkhorn_conventions"]
    assert all(r["without_transpose"] > 1e-5 for r in result["sinkhorn_conventions"]), result["sinkhorn_conventions"]
