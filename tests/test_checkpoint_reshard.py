"""Reshardable checkpoints through Trainer.fit: saved on TP 2 x PP 2 (AdamW, mid-epoch), continued
on other layouts with the same losses as continuing on TP 2 x PP 2.

Model: SwiGLU (``linear_fc1`` is split across TP with stride 2) and tied embeddings (the last
stage holds a copy of the embedding, stored once under the embedding's name).
"""
from __future__ import annotations

import torch

from script_runs import fit_gpt

STEPS_AFTER = slice(2, 5)  # the checkpoint is at step 2 of 5


def _compare(name: str, continued: list[float], reference: list[float]) -> None:
    diff = (torch.tensor(continued) - torch.tensor(reference)).abs().max().item()
    print(f"saved on TP2 x PP2 at step 2, continued on {name}: max |loss - continued on TP2 x PP2| = {diff:.3g}")
    torch.testing.assert_close(torch.tensor(continued), torch.tensor(reference), rtol=0, atol=1e-5,
                               msg=lambda m: f"continued on {name}: {m}")


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
