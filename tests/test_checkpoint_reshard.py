"""Reshardable checkpoints through Trainer.fit: saved on TP 2 x PP 2 (AdamW, mid-epoch), continued
on other layouts with the same losses as continuing on TP 2 x PP 2.

Model: SwiGLU (``linear_fc1`` is split across TP with stride 2) and tied embeddings (the last
stage holds a copy of the embedding, stored once under the embedding's name).
"""
from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch

from script_runs import fit_gpt, run_module_on_a_rank, run_on_ranks
from subprocess_env import child_env

STEPS_AFTER = slice(2, 5)  # the checkpoint is at step 2 of 5


def _compare(name: str, continued: list[float], reference: list[float]) -> None:
    diff = (torch.tensor(continued) - torch.tensor(reference)).abs().max().item()
    print(f"saved on TP2 x PP2 at step 2, continued on {name}: max |loss - continued on TP2 x PP2| = {diff:.3g}")
    torch.testing.assert_close(torch.tensor(continued), torch.tensor(reference), rtol=0, atol=1e-5,
                               msg=lambda m: f"continued on {name}: {m}")


@pytest.mark.slow
def test_checkpoint_of_tp2_pp2_continues_on_other_layouts(tmp_path):
    saved = fit_gpt(tmp_path / "save", "--devices", "4", "--scenario", "reshard", timeout=600)
    assert {".metadata", "metadata.json", "trainer_state.pt"} <= set(saved["checkpoint_files"])
    uninterrupted = saved["uninterrupted"]
    reference = saved["tp2_pp2"]
    assert len(uninterrupted) == 5 and len(reference) == 3
    torch.testing.assert_close(torch.tensor(reference), torch.tensor(uninterrupted[STEPS_AFTER]), rtol=0, atol=1e-6)
    for name in ("pp2_dp2", "pp4", "tp2_sp_pp2_v2"):
        _compare(name, saved[name], reference)
    for name, layout in (("tp2", ("--devices", "2", "--tp", "2")), ("one process", ("--devices", "1"))):
        continued = fit_gpt(tmp_path / name.replace(" ", "_"), *layout, "--scenario", "reshard",
                            "--ckpt", saved["checkpoint"])["continued"]
        _compare(name, continued, reference)

    # one-process use of the final (step 5) checkpoint: lightning-mhc-export, then load_exported /
    # MHCGPTModule.load_from_checkpoint against the TP2 x PP2 logits, each on one rank forked from
    # the preloaded server (no strategy, no groups: what a fresh interpreter would be, without its 7 s
    # of imports; the generate command below keeps its fresh process, whose printed text is checked)
    final, export_dir = tmp_path / "save" / "final.ckpt", tmp_path / "export"
    run_module_on_a_rank("lightning_mhc.cli.export", str(final), str(export_dir))
    assert sorted(p.name for p in export_dir.iterdir()) == ["config.json", "model.safetensors"]
    assert json.loads((export_dir / "config.json").read_text())["activation"] == "swiglu"
    run_on_ranks("check_export.py", 1, str(final), str(export_dir), str(tmp_path / "save" / "logits.pt"),
                 str(tmp_path / "export.json"), timeout=300)
    checked = json.loads((tmp_path / "export.json").read_text())
    print(f"exported vs TP2 x PP2 logits: {checked['export_vs_training']:.3g}; "
          f"load_from_checkpoint: {checked['checkpoint_vs_training']:.3g}")
    assert checked["shape"] == [4, 16, 256]
    assert checked["export_vs_training"] <= 1e-5 and checked["checkpoint_vs_training"] <= 1e-5, checked
    assert checked["generate_equals_argmax"]
    proc = subprocess.run([sys.executable, "-m", "lightning_mhc.cli.generate", f"ckpt_path={export_dir}", "prompt=ab",
                           "max_new_tokens=5"], capture_output=True, text=True, timeout=300, env=child_env())
    assert proc.returncode == 0 and proc.stdout.startswith("ab"), proc.stderr[-3000:]


def test_data_position_is_by_global_sample_and_refuses_another_global_batch():
    from torch.utils.data import DataLoader

    from lightning_mhc import ConfigError
    from lightning_mhc.data.resumable_loader import ResumableLoader

    def loader(batch: int, dp: int) -> ResumableLoader:
        return ResumableLoader(DataLoader(list(range(64)), batch_size=batch), lambda: (1, 3), dp)

    state = loader(8, 1).state_dict()
    assert state == dict(epoch=1, batches_completed=3, global_batch_size=8, consumed_samples=24)
    loader(4, 2).load_state_dict(state)  # DP 1 -> 2 with the same global batch: the same samples
    with pytest.raises(ConfigError, match=r"global batches of 8 .* this run's global batch is 16 \(8 x 2\)"):
        loader(8, 2).load_state_dict(state)


def test_export_refuses_missing_incomplete_and_earlier_format(tmp_path, capsys, no_model_parallel):
    from lightning_mhc.checkpoint import commit
    from lightning_mhc.checkpoint.format import LEGACY_FORMAT
    from lightning_mhc.cli.export import main

    old = tmp_path / "old.ckpt"
    old.mkdir()
    commit.write_metadata(old, dict(format=LEGACY_FORMAT, world_size=4, tensor_model_parallel_size=2,
                                    pipeline_model_parallel_size=2, data_parallel_size=1))
    (tmp_path / "partial.ckpt").mkdir()
    for path, message in ((tmp_path / "absent.ckpt", "does not exist"),
                          (tmp_path / "partial.ckpt", "metadata.json is missing"),
                          (old, r"per-\(tp, pp\) format .* convert it once with torchrun --nproc-per-node 4 -m lightning_mhc.cli.convert")):
        with pytest.raises(SystemExit) as exit_info:
            main([str(path), str(tmp_path / "out")])
        assert exit_info.value.code == 2
        assert re.search(message, capsys.readouterr().err), message
    assert not (tmp_path / "out").exists()
    from megatron.core import parallel_state

    assert not parallel_state.model_parallel_is_initialized()  # refused before building anything


# ------------------------------------------------ the earlier format, converted once
_CONVERT_MODEL = dict(num_layers=2, hidden_size=32, num_attention_heads=2, vocab_size=64, max_sequence_length=8)


def _earlier_format_and_reference_on_tp2(rank: int, world: int, old: str, reference: str) -> None:
    """A rank of TP 2: an MHCGPTModule after one AdamW step, saved in the earlier per-(tp, pp) format
    as it was written (each stage's local state dicts, the trainer state, metadata.json) and in
    today's format (the reference the conversion must give)."""
    from pathlib import Path

    import torch.distributed as dist

    from lightning_mhc.checkpoint import commit
    from lightning_mhc.checkpoint.format import LEGACY_FORMAT, TRAINER_STATE, model_state, optimizer_state, save
    from lightning_mhc.distributed.layout import ParallelLayout
    from lightning_mhc.lightning import MHCGPTModule

    layout = ParallelLayout(tensor_model_parallel_size=2, world_size=world).build()
    module = MHCGPTModule(_CONVERT_MODEL)
    module.handed_layout = layout
    module.configure_model()
    optimizer = module.configure_optimizers(max_steps=1)["optimizer"]
    for k, parameter in enumerate(module.parameters()):  # a step with AdamW's moments to carry over
        parameter.grad = torch.full_like(parameter, 0.01 * (k + 1))
    optimizer.step()
    trainer_state = {"hyper_parameters": dict(module.hparams), "global_step": 1, "epoch": 0}
    old = Path(old)
    old.mkdir(exist_ok=True)
    torch.save({"state_dict": module.state_dict(), "optimizer_states": [optimizer.state_dict()]},
               old / f"model_tp{layout.tensor_model_parallel_rank}_pp0.pt")
    if rank == 0:
        torch.save(trainer_state, old / TRAINER_STATE)
    dist.barrier()
    if rank == 0:
        commit.write_metadata(old, dict(format=LEGACY_FORMAT, world_size=2, tensor_model_parallel_size=2,
                                        pipeline_model_parallel_size=1, data_parallel_size=1, global_step=1))
    save({**trainer_state, "state_dict": model_state(module, layout),
          "optimizer_states": [optimizer_state(optimizer, module, layout)]}, Path(reference), layout, rank)


def test_the_earlier_format_is_converted_once_then_loads(tmp_path, no_model_parallel):
    """``torchrun --nproc-per-node 2 -m lightning_mhc.cli.convert OLD NEW`` on a TP 2 checkpoint of the
    earlier format: NEW holds bit for bit the model and AdamW state that saving on TP 2 gives, and the
    trainer state; it loads whole in one process, where OLD is refused naming the command."""
    from lightning_mhc import ConfigError, MHCGPTModule
    from lightning_mhc.checkpoint.format import read_tensors, read_trainer_state
    from lightning_mhc.testing.launch import spawn_ranks

    old, new, reference = tmp_path / "old.ckpt", tmp_path / "new.ckpt", tmp_path / "reference.ckpt"
    spawn_ranks(_earlier_format_and_reference_on_tp2, 2, str(old), str(reference), timeout_s=240)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m",
                           "lightning_mhc.cli.convert", str(old), str(new)],
                          capture_output=True, text=True, timeout=300, env=child_env())
    assert proc.returncode == 0, proc.stderr[-4000:]
    for prefix in ("state_dict.", "optimizer_states."):
        converted, expected = read_tensors(new, prefix), read_tensors(reference, prefix)
        assert converted.keys() == expected.keys() and expected, prefix
        assert all(torch.equal(converted[k], expected[k]) for k in expected), prefix
    state = read_trainer_state(new)
    assert state["global_step"] == 1 and state["hyper_parameters"]["model_config"] == _CONVERT_MODEL
    with pytest.raises(ConfigError, match=r"earlier per-\(tp, pp\) format .* torchrun --nproc-per-node 2 -m "
                                          r"lightning_mhc.cli.convert"):
        MHCGPTModule.load_from_checkpoint(old)
    assert MHCGPTModule.load_from_checkpoint(new).model_config.num_layers == 2
