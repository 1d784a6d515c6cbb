"""Shared fixtures: a one-rank gloo group with megatron-core's model-parallel state.

Where no CUDA device is present, ``TRITON_INTERPRET=1`` is set here, before anything imports
Triton (megatron-core does, when it is installed): Triton reads it when its language module
loads, and then runs the hyper-connection's kernels on CPU tensors (tests/test_triton_kernels.py).
On a GPU it stays unset: there the kernels (and torch.compile's Inductor, which obeys the same
variable) must be compiled, or the GPU test set would time the interpreter (tests/test_gpu.py
checks). Without Triton it changes nothing."""
from __future__ import annotations

import os

# One intra-op thread per process unless the caller says otherwise: the suite runs two pytest
# workers and groups of up to 8 ranks on 2 cores, where more threads only contend (a 4-rank run
# beside a busy process took 121 s with torch's default of one thread per core, 85 s with one)
os.environ.setdefault("OMP_NUM_THREADS", "1")
import getpass  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

# The child processes' temporary folder: one of this process's own (one per worker), removed when
# it ends (pytest_unconfigure). Every process that imports megatron-core imports wandb (an optional
# import of megatron.core.inference), which makes two temporary folders (`tmp*wandb-media`,
# `tmp*wandb-artifacts`) that only an exit handler removes: ranks that end in os._exit and the
# processes the fault tests kill left them in /tmp on every run. What is shared between runs and
# processes stays where it was: the port locks (lightning_mhc.testing.launch names them in the
# environment), Inductor's compiled kernels (its default folder, named before TMPDIR changes) and
# the Triton kernels compiled ahead of time.
SYSTEM_TMP = tempfile.gettempdir()  # this process keeps it (pytest's own tmp_path folders included)
SUITE_TMP = tempfile.mkdtemp(prefix="lightning_mhc_tests_")
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(SYSTEM_TMP, f"torchinductor_{getpass.getuser()}"))
TRITON_AOT_CACHE = os.path.join(SYSTEM_TMP, f"triton_aot_{getpass.getuser()}")
"""Triton's cache for the kernels compiled ahead of time (tests/test_triton_kernels.py), kept
between runs like Inductor's: a compile is keyed by everything that goes into it."""
os.environ["TMPDIR"] = SUITE_TMP
# data.blend=sample indexes the shipped corpus once into the user's cache: the suite's own folder
# instead (one per worker, shared by its child processes), so no test writes into the real ~/.cache
os.environ.setdefault("LIGHTNING_MHC_CACHE", os.path.join(SUITE_TMP, "lightning_mhc_cache"))

import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch.distributed as dist  # noqa: E402

from lightning_mhc.testing import launch  # noqa: E402
from lightning_mhc.testing.launch import free_port  # noqa: E402

# The suite's fork server also holds Lightning: most of its forked ranks run Trainer.fit or Fabric
# (tests/script_runs.py's run_on_ranks), and each would import it again (about 3 s of CPU); and the
# CLI's entry point with Hydra, for the command-line runs on forked ranks (train_cli.run_train_on_ranks)
launch.PRELOAD += ("lightning.pytorch", "lightning_mhc.lightning", "lightning_mhc.cli.train")


# `make test`'s two workers take a whole file at a time (``--dist loadfile``), and xdist hands the
# files out by their number of tests, most first: the long files of few tests (real launches, the
# wheel, preemption, the gpu-check dry run) came last, and one worker ran the last of them while
# the other sat idle. Handed out longest first, the files left at the end are short ones. The
# order below is each file's CPU in a whole run (`-p cpu_time` with LIGHTNING_MHC_CPU_TIMES: the
# tests' total_s, ranks and child processes included, summed per file; 2026-11-28: 2490 s in all,
# test_parallelize.py 323 s, test_benchmarks.py 291 s, test_preemption.py 176 s ... 27 s for the
# last named; then test_parallelize.py's example run moved to forked ranks, 50 s less, below
# test_benchmarks.py), longest first, or its time where the CPU count misses most of it: the compile ahead
# of time (test_triton_kernels.py, about 190 s of CI's durations), preemption's waits for its
# signals, the wheel's pip (95 to 145 s) and the fault tests' killed ranks, which report nothing.
# The files it does not name follow, most tests first (each under 25 s of CPU). By their few
# tests, test_context_parallel_fit.py (47 s of CPU in 2 tests), test_entry_point.py (73 s in 7),
# test_moe_runtime.py (39 s in 7), test_pipeline.py (104 s in 12) and test_fabric.py (126 s in 8)
# had come late in the order; so would the planner's grids (2026-11-29: test_planner_hf.py 154 to 197 s
# of CPU in 8 tests, test_planner_activations.py 150 s of wall alone in 2).
LONGEST_FILES = ("test_triton_kernels.py", "test_benchmarks.py", "test_parallelize.py", "test_preemption.py",
                 "test_fabric.py", "test_hydra.py", "test_docs.py", "test_planner_hf.py", "test_planner_activations.py",
                 "test_distributed_optimizer.py",
                 "test_pipeline.py", "test_validation.py", "test_lightning.py", "test_deepseek_v4_parallel.py",
                 "test_wheel.py", "test_multinode.py", "test_entry_point.py", "test_checkpoint_faults.py",
                 "test_checkpoint_reshard.py", "test_context_parallel_fit.py", "test_hf_idioms.py",
                 "test_hy_v4_parallel.py", "test_cli_hf.py", "test_moe_runtime.py", "test_recompute_policies.py",
                 "test_deepseek_v4_ops.py", "test_context_parallel_hf.py")


def pytest_configure(config):
    if getattr(config.option, "dist", "no") == "loadfile":
        config.option.loadscopereorder = False  # xdist's own order (most tests first) would undo ours


def pytest_unconfigure(config):
    shutil.rmtree(SUITE_TMP, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    """In an xdist worker (whose collection the controller hands out in order), the files in
    ``LONGEST_FILES``' order, then the rest by their number of tests; each file's tests keep their
    order (every worker sorts the same collection the same way, as xdist requires)."""
    if not hasattr(config, "workerinput"):  # one process: nothing to balance
        return
    counts: dict[str, int] = {}
    for item in items:
        counts[item.path.name] = counts.get(item.path.name, 0) + 1

    def rank(item):
        name = item.path.name
        return (LONGEST_FILES.index(name), 0) if name in LONGEST_FILES else (len(LONGEST_FILES), -counts[name])

    items.sort(key=rank)  # stable: a file's tests stay in order, and together


@pytest.fixture(scope="session")
def single_rank_group():
    """A world of one gloo rank (megatron's layers need an initialised TP group)."""
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ["MASTER_PORT"] = str(free_port())
        dist.init_process_group("gloo", rank=0, world_size=1)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture
def model_parallel(single_rank_group):
    """TP = PP = 1 model-parallel state, torn down after the test; yields its ParallelLayout. A
    layout an earlier in-process ``Trainer.fit`` left (the strategy keeps its groups after fit,
    for ``save_checkpoint`` and the next entry point) is destroyed first."""
    from lightning_mhc.distributed.layout import ParallelLayout, destroy_parallel

    destroy_parallel()
    layout = ParallelLayout().build()
    torch.manual_seed(0)
    yield layout
    destroy_parallel()


@pytest.fixture
def no_model_parallel():
    """A process holding no model-parallel layout, for tests that check nothing gets built: an
    earlier in-process ``Trainer.fit`` keeps its layout on purpose (for ``save_checkpoint`` after
    ``fit``), so it is destroyed first."""
    from lightning_mhc.distributed.layout import destroy_parallel

    destroy_parallel()
    yield


# ``lightning-mhc-train`` in one process: 6 steps of the tiny model on synthetic tokens, global
# batch 8 in 2 microbatches of 4, dropout off; the reference of the CLI's multi-process runs
CLI_REFERENCE_RUN = ["trainer=debug", "data=synthetic", "trainer.log_every_n_steps=1", "data.global_batch_size=8",
                     "data.micro_batch_size=4", "model.hidden_dropout=0", "model.attention_dropout=0"]


@pytest.fixture(scope="session")
def cli_reference_run(tmp_path_factory):
    """The run directory of ``CLI_REFERENCE_RUN`` (run once per session; checkpoints at steps 3
    and 6, validation after steps 3 and 6)."""
    from train_cli import run_train_on_ranks

    cwd = tmp_path_factory.mktemp("cli_reference")
    run_train_on_ranks(cwd, *CLI_REFERENCE_RUN, f"hydra.run.dir={cwd / 'run'}")  # a reference, not a launch: forked
    return cwd / "run"


@pytest.fixture(scope="session")
def cli_reference_losses(cli_reference_run) -> dict[int, float]:
    """``{step: train_loss}`` of ``CLI_REFERENCE_RUN``."""
    from train_cli import train_losses

    return train_losses(cli_reference_run / "metrics.csv")
