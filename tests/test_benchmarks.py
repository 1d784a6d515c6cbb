"""The benchmarks run as written (tiny sizes, one round): their JSON has every variant and ratio.
The figures themselves are taken by hand (README, "Fast mHC")."""
from __future__ import annotations

import importlib.util
import json
import math
import os
import pathlib
import subprocess
import sys

import pytest

from subprocess_env import child_env

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"


def _run(script: str, *args: str) -> None:
    proc = subprocess.run([sys.executable, str(BENCHMARKS / script), "--rounds", "1", *args],
                          cwd=BENCHMARKS, env=child_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]


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


@pytest.mark.skipif(importlib.util.find_spec("hyper_connections") is None,
                    reason="the peer package is in the bench extra: pip install -e '.[bench]'")
def test_mhc_sublayer(tmp_path):
    out = tmp_path / "sublayer.json"
    _run("mhc_sublayer.py", "--hidden", "64", "--tokens", "128", "--out", str(out))
    row = json.loads(out.read_text())["table"]["64"]
    assert set(row) == {"reference", "fused", "hyper-connections"}
    assert row["fused"]["saved_bytes_per_token"] < row["reference"]["saved_bytes_per_token"]


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="the hf extra: pip install -e '.[hf]'")
def test_byom_vs_model_parallel(tmp_path):
    out = tmp_path / "byom.json"
    _run("byom_vs_model_parallel.py", "--steps", "3", "--out", str(out))
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
    _run("mhc_any_model.py", "--no-parallel", "--hidden", "64", "--layers", "2", "--out", str(out),
         "--plot", str(tmp_path / "plot.png"))
    result = json.loads(out.read_text())
    one = result["one_process"]
    assert set(one["retained_bytes"]) == {"plain, none", "mHC, none", "plain, full", "mHC, mhc_block"}
    assert one["step_time_ratio"] > 0 and one["retained_ratio"] > 0
    assert len(result["exactness"]) == 10  # every built-in family
    assert all(diff <= 1e-5 for row in result["exactness"].values() for diff in row.values())


def test_fp64_accuracy(tmp_path):
    """Every output and gradient of the sub-layer, fp32 and bf16 and the projection's emulated
    tensor-core precisions, with both errors (not timed: no rounds)."""
    out = tmp_path / "accuracy.json"
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "fp64_accuracy.py"), "--hidden", "32", "--tokens", "16",
                           "--out", str(out)], cwd=BENCHMARKS, env=child_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    errors = json.loads(out.read_text())["errors"]
    assert set(errors) == {"float32", "bfloat16", "float32, projection tf32x3 (emulated)",
                           "float32, projection tf32 (emulated)", "bfloat16, projection tf32 (emulated)"}
    for table in errors.values():
        assert len(table) == 8 and all(0 <= e["ours"] < 0.05 and 0 <= e["reference"] < 0.05 for e in table.values())


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


@pytest.mark.slow
def test_gpu_check_without_cuda_is_a_dry_run_of_every_step(tmp_path):
    """``make gpu-check``'s command on a machine without CUDA: the GPU test set's CPU dry run (so a
    broken GPU test shows here before a lent GPU's minutes are spent on it), ``gpu_mhc.py`` at CPU
    sizes with the GPU columns absent and why (Triton's times, peak memory, the kernel's bandwidth,
    Megatron's mHC without a checkout), and 4 training steps with ``mhc_block``; one JSON holds the
    device, the versions and every step."""
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "gpu_check.py"), "--out-dir", str(tmp_path)],
                          cwd=tmp_path, env=child_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["dry_run"] and report["device"]["name"].startswith("CPU") and report["versions"]["torch"]
    tests = report["steps"]["gpu_tests"]
    assert tests["counts"]["failed"] == 0 and tests["counts"]["passed"] >= 6, tests["counts"]
    assert tests["tests"]["test_the_kernels_run_compiled_not_in_the_interpreter"]["outcome"] == "skipped"

    result = report["steps"]["gpu_mhc"]["figures"]
    (hidden,) = result["table"]
    rows = result["table"][hidden]["sublayer"]
    assert set(rows) == {"no_hc", "reference", "compile", "fused", "triton", "megatron_eager", "megatron_compiled"}
    for name in ("no_hc", "reference", "compile", "fused"):
        assert rows[name]["median_s"] > 0 and rows[name]["peak_bytes"] is None
    assert "needs CUDA" in rows["triton"]["absent"]
    assert "needs CUDA" in result["table"][hidden]["mappings_bandwidth"]["absent"]
    assert "--megatron-lm" in rows["megatron_eager"]["absent"]
    assert rows["fused"]["saved_bytes_per_token"] < rows["reference"]["saved_bytes_per_token"]
    assert result["model"]["hc_vs_no_hc"] > 0 and result["model"]["mhc_block_vs_none"] > 0

    train = report["steps"]["train_small"]
    assert len(train["losses"]) == 4 and train["median_step_time_ms"] > 0 and train["max_cuda_mb"] is None
    assert {p.name for p in tmp_path.iterdir()} >= {"gpu_check.json", "gpu_tests.xml", "gpu_mhc.json"}
