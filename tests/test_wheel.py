"""The package as a user gets it from an index: a wheel built from this tree, installed into a
fresh virtual environment, and ``lightning-mhc-train`` run from an empty directory, far from the
checkout. Catches what the editable install of the dev venv hides: package data (the Hydra configs,
the C++ kernel sources) left out of the wheel, and code that reads files relative to the repo."""
from __future__ import annotations

import json
import os
import pathlib
import shutil
import site
import subprocess
import sys
import time
import zipfile

import pytest

from subprocess_env import child_env

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lightning_mhc"
TIMEOUT = 600
# The user's own experiment, in ./conf of the directory the command runs in: 5 steps of the tiny
# model on the default data (the standard library's sources), offline: the csv logger, one
# validation (2 batches) and one checkpoint, at the last step
USER_EXPERIMENT = """\
# @package _global_
defaults:
  - override /model: tiny
  - override /logger: csv
trainer:
  max_steps: 5
  val_check_interval: 5
  limit_val_batches: 2
  checkpoint_every_n_steps: 5
  log_every_n_steps: 1
  enable_progress_bar: false
"""
TRAIN_OVERRIDES = ["experiment=my_run"]


def _run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=TIMEOUT, **kwargs)
    assert proc.returncode == 0, f"{cmd}\nstdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-6000:]}"
    return proc


def _tail(text: str, n: int) -> list[str]:
    return [line for line in text.splitlines() if line.strip()][-n:]


def _build_wheel(tmp_path: pathlib.Path) -> pathlib.Path:
    """``pip wheel .`` from the repo root. setuptools' build/ and *.egg-info go to tmp_path
    (``DIST_EXTRA_CONFIG``): a build/lib left in the checkout by an earlier build keeps files that
    have since been removed and would be packed again, hiding a missing file from this test."""
    cfg = tmp_path / "dist.cfg"
    cfg.write_text(f"[build]\nbuild_base = {tmp_path / 'build'}\n[egg_info]\negg_base = {tmp_path}\n")
    wheels = tmp_path / "wheels"
    # setuptools and wheel are in the dev venv (the build requirements): no isolated build env
    # to download; without them pip's default isolation fetches them from the index
    try:
        import setuptools  # noqa: F401
        import wheel  # noqa: F401
        isolation = ["--no-build-isolation"]
    except ImportError:
        isolation = []
    _run([sys.executable, "-m", "pip", "wheel", ".", "--no-deps", *isolation, "-w", wheels],
         cwd=ROOT, env=child_env(DIST_EXTRA_CONFIG=str(cfg)))
    (whl,) = list(wheels.glob("lightning_mhc-*.whl"))
    print(f"\nwheel: {whl.name} ({whl.stat().st_size} bytes)")
    return whl


def _check_wheel_contents(whl: pathlib.Path) -> None:
    names = set(zipfile.ZipFile(whl).namelist())
    expected = {p.relative_to(ROOT).as_posix() for pattern in ("cli/conf/*.yaml", "cli/conf/*/*.yaml", "ops/csrc/*.cpp")
                for p in PACKAGE.glob(pattern)}
    assert "lightning_mhc/cli/conf/config.yaml" in expected
    assert {"model", "parallel", "recompute", "data", "trainer", "logger", "experiment"} <= {
        pathlib.PurePosixPath(n).parent.name for n in expected if n.count("/") == 4}, sorted(expected)
    assert any(n.startswith("lightning_mhc/ops/csrc/") for n in expected)
    # and every module: a subpackage without __init__.py is not found by packages.find
    expected |= {p.relative_to(ROOT).as_posix() for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts}
    missing = sorted(expected - names)
    assert not missing, f"{whl.name} lacks {missing}"
    data = sorted(n for n in names if n.endswith((".yaml", ".cpp")))
    print(f"wheel holds {len(names)} files, {len(data)} of them package data (.yaml/.cpp), "
          f"all {len(expected)} expected from the source tree")


def _fresh_venv(tmp_path: pathlib.Path, whl: pathlib.Path) -> pathlib.Path:
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", venv])
    python = venv / "bin" / "python"
    _run([python, "-m", "pip", "install", "--no-deps", "--no-index", whl])
    (venv_site,) = [pathlib.Path(p) for p in json.loads(_run(
        [python, "-c", "import json, site; print(json.dumps(site.getsitepackages()))"]).stdout)]
    # The dependencies (torch, lightning, megatron-core, hydra, ...) from the running interpreter's
    # site-packages instead of a download of gigabytes: a .pth line appends each directory to
    # sys.path, after the fresh venv's own site-packages, which holds the wheel's lightning_mhc.
    # That directory also holds the dev venv's editable install of lightning_mhc, but that is a
    # finder installed by a .pth file there (__editable__.lightning_mhc-*.pth), and .pth files in a
    # directory added by a .pth line are not processed: the checkout never becomes importable
    # (asserted below, and by the run's config sources).
    (venv_site / "_dev_venv_dependencies.pth").write_text("".join(f"{p}\n" for p in site.getsitepackages()))
    return venv


@pytest.mark.slow
def test_wheel_installs_and_trains_from_an_empty_directory(tmp_path):
    start = time.perf_counter()
    whl = _build_wheel(tmp_path)
    _check_wheel_contents(whl)
    venv = _fresh_venv(tmp_path, whl)
    venv_site = next((venv / "lib").glob("python3*/site-packages"))
    installed = venv_site / "lightning_mhc"

    workdir = tmp_path / "empty"
    (workdir / "conf" / "experiment").mkdir(parents=True)
    (workdir / "conf" / "experiment" / "my_run.yaml").write_text(USER_EXPERIMENT)
    extensions = tmp_path / "torch_extensions"  # the CPU kernels compile from the wheel's sources
    env = {k: v for k, v in child_env().items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    # as in an activated fresh venv whose dependencies' scripts (ninja) are on PATH
    env.update(PATH=os.pathsep.join([str(venv / "bin"), str(pathlib.Path(sys.executable).parent), env.get("PATH", "")]),
               VIRTUAL_ENV=str(venv), WANDB_MODE="disabled", TORCH_EXTENSIONS_DIR=str(extensions))

    probe = _run([venv / "bin" / "python", "-c",
                  "import lightning_mhc, sys; from lightning_mhc.cli.preflight import CONF_DIR; "
                  "print(lightning_mhc.__file__); print(CONF_DIR); print('\\n'.join(sys.path))"],
                 cwd=workdir, env=env)
    module_file, conf_dir, *sys_path = probe.stdout.splitlines()
    print(f"fresh venv imports lightning_mhc from {module_file}")
    assert pathlib.Path(module_file) == installed / "__init__.py"
    assert pathlib.Path(conf_dir) == installed / "cli" / "conf"
    assert not any(p and pathlib.Path(p).resolve() == ROOT for p in sys_path), sys_path
    assert str(venv_site) in sys_path and sys_path.index(str(venv_site)) < min(
        sys_path.index(p) for p in site.getsitepackages()), sys_path

    script = venv / "bin" / "lightning-mhc-train"
    assert script.read_text().splitlines()[0] == f"#!{venv / 'bin' / 'python'}"
    train_start = time.perf_counter()
    proc = subprocess.run([str(script), *TRAIN_OVERRIDES], cwd=workdir, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT)
    train_s = time.perf_counter() - train_start
    print(f"$ {script.name} {' '.join(TRAIN_OVERRIDES)}  (exit {proc.returncode}, {train_s:.0f} s)")
    for line in _tail(proc.stdout, 6) + _tail(proc.stderr, 10):
        print(f"  | {line}")
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-8000:]}"

    (run_dir,) = list((workdir / "outputs").glob("*/*"))
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 5 and summary["final_val_loss"] is not None, summary
    assert (run_dir / "metrics.csv").is_file()
    assert (run_dir / "checkpoints" / "step-000005.ckpt").is_dir()
    # Hydra composed the run from the wheel's configs, not the checkout's
    hydra_yaml = (run_dir / ".hydra" / "hydra.yaml").read_text()
    assert f"path: {installed / 'cli' / 'conf'}" in hydra_yaml, hydra_yaml
    assert str(ROOT) not in hydra_yaml
    # and the experiment from ./conf, on the search path after the packaged groups
    assert f"- path: {workdir / 'conf'}\n      schema: file\n      provider: lightning_mhc-user" in hydra_yaml, hydra_yaml
    assert "experiment: my_run" in hydra_yaml
    assert sorted(p.name for p in workdir.iterdir()) == ["conf", "outputs"]  # nothing written outside the run dir
    elsewhere = tmp_path / "no_conf"
    elsewhere.mkdir()
    refused = subprocess.run([str(script), *TRAIN_OVERRIDES], cwd=elsewhere, env=env, capture_output=True, text=True,
                             timeout=TIMEOUT)
    assert refused.returncode == 2 and "the experiment group has no option 'my_run'" in refused.stderr, refused.stderr
    # the fused hyper-connection's CPU kernels were compiled (ninja) from the wheel's .cpp files
    assert "CPU kernels did not build" not in proc.stderr, proc.stderr[-4000:]
    if shutil.which(os.environ.get("CXX", "c++")):
        built = sorted(p.relative_to(extensions).as_posix() for p in extensions.glob("lightning_mhc_cpu_kernels*/*.so"))
        assert built, sorted(p.relative_to(extensions).as_posix() for p in extensions.rglob("*"))
        print(f"CPU kernels built from the wheel's sources: {built}")
    print(f"run directory {run_dir.relative_to(workdir)}: steps={summary['steps']}, "
          f"final_train_loss={summary['final_train_loss']:.4f}, final_val_loss={summary['final_val_loss']:.4f}")
    print(f"wheel test total: {time.perf_counter() - start:.0f} s")
