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

from script_runs import fit_gpt, run_script
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

    # one-process use of the final (step 5) checkpoint, in fresh processes: lightning-mhc-export,
    # then load_exported / MHCGPTModule.load_from_checkpoint against the TP2 x PP2 logits
    final, export_dir = tmp_path / "save" / "final.ckpt", tmp_path / "export"
    proc = subprocess.run([sys.executable, "-m", "lightning_mhc.cli.export", str(final), str(export_dir)],
                          capture_output=True, text=True, timeout=300, env=child_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in export_dir.iterdir()) == ["config.json", "model.safetensors"]
    assert json.loads((export_dir / "config.json").read_text())["activation"] == "swiglu"
    proc = run_script("check_export.py", str(final), str(export_dir), str(tmp_path / "save" / "logits.pt"),
                      str(tmp_path / "export.json"), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
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
    from lightning_mhc.checkpoint import commit, legacy
    from lightning_mhc.cli.export import main

    old = tmp_path / "old.ckpt"
    old.mkdir()
    commit.write_metadata(old, dict(format=legacy.FORMAT, world_size=4, tensor_model_parallel_size=2,
                                    pipeline_model_parallel_size=2, data_parallel_size=1))
    (tmp_path / "partial.ckpt").mkdir()
    for path, message in ((tmp_path / "absent.ckpt", "does not exist"),
                          (tmp_path / "partial.ckpt", "metadata.json is missing"),
                          (old, r"per-\(tp, pp\) format .* To convert it, resume it once on TP=2, PP=2")):
        with pytest.raises(SystemExit) as exit_info:
            main([str(path), str(tmp_path / "out")])
        assert exit_info.value.code == 2
        assert re.search(message, capsys.readouterr().err), message
    assert not (tmp_path / "out").exists()
    from megatron.core import parallel_state

    assert not parallel_state.model_parallel_is_initialized()  # refused before building anything
