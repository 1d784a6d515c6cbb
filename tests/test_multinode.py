"""Several nodes, launched the ways clusters launch, through ``lightning-mhc-train``: two torchrun
"nodes" of 2 processes (separate torchrun invocations, ``--nnodes 2 --node-rank k``) and
``examples/train.sbatch`` under a fake SLURM (the ``SLURM_*`` variables Lightning's
``SLURMEnvironment`` reads, and an ``srun`` that starts the tasks on this machine). They train TP
2 x DP 2 (torchrun) and TP 2 (SLURM) with the distributed optimizer and must give one process's
per-step losses.
"""
from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys

import pytest
import torch

from conftest import CLI_REFERENCE_RUN
from lightning_mhc.testing.launch import free_port
from subprocess_env import child_env
from train_cli import train_losses

ROOT = pathlib.Path(__file__).parents[1]
FAKE_SLURM = pathlib.Path(__file__).parent / "scripts" / "fake_slurm"
# global batch 8: one process takes 2 microbatches of 4 (conftest's cli_reference_losses), TP 2 x
# DP 2 one of 4 per DP rank
RUN = CLI_REFERENCE_RUN
TP2_DP2 = ["parallel=tp2", "optim.use_distributed_optimizer=true"]
TIMEOUT = 420


def _wait_all(procs: list[subprocess.Popen]) -> list[tuple[int, str]]:
    """Wait for every process (each started in its own session); on a timeout kill them all."""
    try:
        outputs = [p.communicate(timeout=TIMEOUT) for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            os.killpg(p.pid, signal.SIGKILL)
        raise
    return [(p.returncode, out + err) for p, (out, err) in zip(procs, outputs)]


def _check_against(run_dir: pathlib.Path, reference: dict[int, float], what: str) -> None:
    losses = train_losses(run_dir / "metrics.csv")
    assert losses.keys() == reference.keys() and len(reference) == 6, what
    diff = max(abs(losses[k] - reference[k]) for k in reference)
    print(f"{what}: max |loss - one process| over 6 steps = {diff:.3g}")
    torch.testing.assert_close(torch.tensor(list(losses.values())), torch.tensor(list(reference.values())),
                               rtol=0, atol=1e-5, msg=lambda m: f"{what}: {m}")


@pytest.mark.slow
def test_two_torchrun_nodes_match_one_process(tmp_path, cli_reference_losses):
    run_dir = tmp_path / "run"
    port = free_port()
    procs = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
         "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(port),
         "-m", "lightning_mhc.cli.train", *RUN, *TP2_DP2, "trainer.devices=2", "trainer.num_nodes=2",
         f"hydra.run.dir={run_dir}"],
        cwd=tmp_path, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True) for node in (0, 1)]
    for node, (status, output) in enumerate(_wait_all(procs)):
        assert status == 0, f"node {node}:\n{output[-6000:]}"
    _check_against(run_dir, cli_reference_losses, "torchrun, 2 nodes x 2 processes, TP 2 x DP 2, distributed optimizer")


@pytest.mark.slow
def test_the_sbatch_script_runs_under_slurm(tmp_path, cli_reference_losses):
    """``bash examples/train.sbatch <overrides>`` as sbatch runs it on the first node, with the
    variables SLURM sets for the job: 2 nodes of 1 task, TP 2 across them; the fake ``srun``
    starts the 2 tasks here."""
    slurm = dict(SLURM_JOB_ID="4242", SLURM_JOB_NAME="lightning-mhc", SLURM_NNODES="2", SLURM_NTASKS_PER_NODE="1",
                 SLURM_NODELIST="localhost", SLURM_CPUS_PER_TASK="1", MASTER_PORT=str(free_port()),
                 MHC_TRAINER="debug", MHC_MODEL="tiny", MHC_PARALLEL="tp2",
                 PATH=os.pathsep.join([str(FAKE_SLURM), str(pathlib.Path(sys.executable).parent), os.environ["PATH"]]))
    proc = subprocess.Popen(["bash", str(ROOT / "examples" / "train.sbatch"), *RUN[1:]], cwd=tmp_path,
                            env=child_env(**slurm), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    ((status, output),) = _wait_all([proc])
    assert status == 0, output[-6000:]
    _check_against(tmp_path / "outputs" / "slurm-4242", cli_reference_losses,
                   "examples/train.sbatch under SLURM, 2 nodes x 1 task, TP 2, distributed optimizer")
