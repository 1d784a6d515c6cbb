"""HY-V4 (``hy_v4``) through ``parallelize(model, plan="auto")`` (``any_model/hy_v4.py``, its family
record): its own hyper-connections kept as they are (``hc_mult`` streams, none added, carried flat
between pipeline stages as DeepSeek-V4's), from ``save_pretrained`` files in several shards (its
checkpoint's own tensor names), against the model in one process (fp32).

A tiny HY-V4 (tests/v4_utils.py's ``tiny_hy_v4_config``: a dense layer then three MoE layers with a shared expert
and a score-correction bias, every attention's indexer picking 4 of 16 keys, full and shared
indexer layers in turn, the experts' clamp cutting, every map moved off its init): on one process bit-exact; one spawned
4-rank group (``group``) runs TP 2 x PP 2, PP 2 x EP 2, TP 2 x EP 2, under context parallelism
(``any_model/hy_v4_context.py``: CP 2, TP 2 x CP 2, PP 2 x CP 2, CP 2 with a left-padded batch; the indexer's
picks and the causal and padding masks cross the chunk borders) and with sequence parallelism (TP 2,
TP 2 x PP 2, TP 2 x CP 2) with step-0 logits within 1e-5 of one process; 3 SGD steps through
``Trainer.fit`` on TP 2 x EP 2, TP 2 x CP 2, CP 2, CP 2 x EP 2, TP 2 with sequence parallelism, with
the block recompute of its hyper-connections (``mhc_block``) on TP 2 x PP 2, CP 2 and EP 2 (after
``use_our_ops``; each also against the same layout without it, 1e-6, fewer bytes), TP 2 x DP 2 with ZeRO-1
and TP 2 x PP 2 (its step-2 checkpoint continued on PP 2 x EP 2, then read in one process,
exported and read back by ``HYV4ForCausalLM.from_pretrained``, greedy ``generate``), losses and
weights within 1e-5; in one process ``mhc_block`` gives the same logits and gradients (1e-5)
keeping fewer bytes. The command line trains it on ``parallel=tp2cp2`` (TP 2 with sequence
parallelism x CP 2, the documented command). What is not built (a stage beginning with a
shared-indexer layer, GLM-5-next and HY-V4-VL, a key/value cache under CP) is refused in one line.
The spawned group's helpers are DeepSeek-V4's (tests/test_deepseek_v4_parallel.py): they read the
model from its directory.
"""
from __future__ import annotations

import pathlib

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.hy_v4")

from lightning_mhc import ConfigError  # noqa: E402
from lightning_mhc.any_model import check_parallelize  # noqa: E402
from lightning_mhc.any_model.hy_v4_context import context_parallel_attention_forward  # noqa: E402
from lightning_mhc.distributed.layout import ParallelLayout  # noqa: E402
from lightning_mhc.testing.launch import spawn_ranks  # noqa: E402
from test_deepseek_v4_parallel import (  # noqa: E402
    BLOCK_RECOMPUTE, MEASURED, RECOMPUTED, SP, _all_layouts, _fit, _refusal, check_against_one_process,
    check_block_recompute_against_without, check_block_recompute_in_one_process,
    check_checkpoint_and_export, check_command_line_against_one_process, check_one_process_bit_for_bit,
    check_zero_one, meta_model, save_moved)
from v4_utils import tiny_hy_v4_config  # noqa: E402


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> pathlib.Path:
    return save_moved(tmp_path_factory.mktemp("hy_v4"), tiny_hy_v4_config())


LAYOUTS = {"tp2pp2": dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2),
           "pp2ep2": dict(pipeline_model_parallel_size=2, expert_model_parallel_size=2),
           "tp2ep2": dict(tensor_model_parallel_size=2, expert_model_parallel_size=2),
           "cp2": dict(context_parallel_size=2), "tp2cp2": dict(tensor_model_parallel_size=2, context_parallel_size=2),
           "pp2cp2": dict(pipeline_model_parallel_size=2, context_parallel_size=2),
           "cp2 padded": dict(context_parallel_size=2), "tp2 sp": dict(tensor_model_parallel_size=2, **SP),
           "tp2pp2 sp": dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, **SP),
           "tp2cp2 sp": dict(tensor_model_parallel_size=2, context_parallel_size=2, **SP)}
"""The layouts of the 4 ranks (DP fills the rest); "padded": the batch left-padded (DeepSeek-V4's
test's ``PADS``: up to 7 pad tokens, past the first chunk border); "sp": with sequence parallelism
(each TP rank's half of the sequence between the TP regions, the attention's latent and indexer on
the gathered sequence). Under CP 2 each sequence of 16
tokens is cut into 4 chunks of 4: a query's causal keys and the indexer's 4 picks among them lie
in other chunks, on the other rank."""
FITS = {"tp2ep2": dict(tensor_model_parallel_size=2, expert_model_parallel_size=2),
        "tp2cp2": dict(tensor_model_parallel_size=2, context_parallel_size=2),
        "cp2ep2": dict(context_parallel_size=2, expert_model_parallel_size=2),
        "tp2 sp": dict(tensor_model_parallel_size=2, **SP),
        "tp2pp2 mhc_block": dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                                 recompute=BLOCK_RECOMPUTE, **MEASURED),
        "cp2": dict(context_parallel_size=2, **MEASURED),
        "cp2 mhc_block": dict(context_parallel_size=2, recompute=BLOCK_RECOMPUTE, **MEASURED),
        "ep2 our ops": dict(expert_model_parallel_size=2, our_ops=True, **MEASURED),
        "ep2 our ops mhc_block": dict(expert_model_parallel_size=2, our_ops=True, recompute=BLOCK_RECOMPUTE,
                                      **MEASURED)}
"""The layouts trained through ``Trainer.fit``: the rotary key's gradient summed over TP, the
experts' over their ranks; under CP (CP 2, CP 2 x EP 2, TP 2 x CP 2) the gathered latent's
gradient reduce-scattered back to its ranks, the loss each rank's part of the mean; under sequence
parallelism ("sp") the rotary key's and the latent's gradients summed once, by the gathered
sequence's reduce-scatter, and the replicated parameters' over TP; the block recompute of its
hyper-connections (a group of 2 layers) on TP 2 x PP 2, CP 2 and EP 2 (DP 4), the last with its
connections and head on our kernels (``use_our_ops``: "our ops"), each beside the same layout without it
(``RECOMPUTED``, DeepSeek-V4's pairs), their retained activation bytes measured. (The group also trains ZeRO-1 on TP 2 x DP 2 and
TP 2 x PP 2 saved at step 2, continued on PP 2 x EP 2: DeepSeek-V4's test's ``ZERO``,
``SAVED_ON`` and ``RESUMED_ON``.)"""


@pytest.fixture(scope="module")
def group(saved, tmp_path_factory) -> tuple[list[dict], pathlib.Path]:
    """One spawned group of 4 ranks running every distributed case of this file (``_all_layouts``),
    and where its checkpoints are."""
    checkpoints = tmp_path_factory.mktemp("hy_v4_checkpoints")
    return spawn_ranks(_all_layouts, 4, str(saved), FITS, LAYOUTS, None, str(checkpoints), timeout_s=420,
                       init_group=False), checkpoints


@pytest.fixture(scope="module")
def one_process(saved) -> dict:
    """The same 3 steps in one process, through the same ``Trainer.fit``."""
    return _fit(saved, 1, keep_model=True)


def test_one_process_is_the_model_bit_for_bit(saved):
    check_one_process_bit_for_bit(saved)


def test_layouts_equal_one_process(saved, group, one_process):
    results, _ = group
    check_against_one_process(saved, results, LAYOUTS, FITS, one_process)


def test_the_distributed_optimizer_trains_it_as_one_process(group, one_process):
    check_zero_one(group[0], one_process)


def test_a_checkpoint_goes_on_on_another_layout_and_exports_for_from_pretrained(saved, group, one_process, tmp_path):
    """Save and go on (TP 2 x PP 2 at step 2, continued on PP 2 x EP 2), read in one process with
    its score-correction biases, exported by ``lightning-mhc-export`` and read back by
    ``HYV4ForCausalLM.from_pretrained`` (logits 1e-5, the hyper-connections kept fp32 in bf16),
    greedy ``generate`` on it the one-process trained model's tokens (DeepSeek-V4's check)."""
    results, checkpoints = group
    check_checkpoint_and_export(saved, results, checkpoints, one_process, tmp_path, transformers.HYV4ForCausalLM,
                                "e_score_correction_bias", "model.hc_pre.hc_head.hc_head_fn")


def test_block_recompute_trains_as_the_same_layout_without_it_keeping_fewer_bytes(group):
    check_block_recompute_against_without(group[0], RECOMPUTED, BLOCK_RECOMPUTE_BYTES)


BLOCK_RECOMPUTE_BYTES = {"TP 2 x PP 2": 0.65, "CP 2": 0.75, "EP 2 on our ops": 0.8}
"""Measured (the tiny HY-V4: no Sinkhorn, no stream mixing, so less to recompute than V4's): TP 2 x
PP 2 0.59x (328,552 B against 559,976 B), CP 2 0.71x (289,468 B against 405,180 B), EP 2 on our
ops 0.72x (290,620 B against 406,332 B, measured when ``use_our_ops`` swapped its head alone; the
case now runs its ``attn_hc`` / ``ffn_hc`` on our ops too and holds the bound, not re-measured)."""


def test_block_recompute_of_its_hyper_connections_in_one_process(saved, monkeypatch):
    check_block_recompute_in_one_process(saved, at_most=0.75, monkeypatch=monkeypatch)


def test_what_is_not_built_is_refused_in_one_line(saved):
    model = meta_model(saved)
    message = _refusal(model=model, layout=ParallelLayout(), hyper_connections=4)
    assert "model_type 'hy_v4'" in message and "carries its own (hc_mult=4 streams)" in message
    # sequence parallelism runs (with CP too): nothing refused
    check_parallelize(model, "auto", layout=ParallelLayout(tensor_model_parallel_size=2, context_parallel_size=2,
                                                           sequence_parallel=True))
    message = _refusal(model=model, layout=ParallelLayout(expert_model_parallel_size=3))  # 4 experts
    assert "4 experts, which do not split evenly over 3 ranks" in message, message
    message = _refusal(model=model, layout=ParallelLayout(tensor_model_parallel_size=8))  # 4 heads
    assert "self_attn.num_heads=4 cannot be divided by tensor_model_parallel_size=8" in message, message
    check_parallelize(model, "auto", layout=ParallelLayout(), recompute="mhc_block")  # on its own hyper-connections
    # layer 1's indexer reuses layer 0's picks: a stage cannot begin there
    message = _refusal(model=model, layout=ParallelLayout(pipeline_model_parallel_size=2), pipeline_split=[1, 3])
    assert "pipeline stage 1 would begin with layer 1, whose indexer is 'shared'" in message, message
    check_parallelize(model, "auto", layout=ParallelLayout(pipeline_model_parallel_size=2))  # [0, 1], [2, 3] run
    check_parallelize(model, "auto", layout=ParallelLayout(context_parallel_size=2))  # CP too (its own attention)
    # under CP its attention refuses a key/value cache (generation), before it reads anything else
    with pytest.raises(ConfigError) as raised:
        context_parallel_attention_forward(None, None, torch.zeros(1, 4, 32), None, None, cache=object())
    assert str(raised.value) == ("HY-V4 under context parallelism: a key/value cache (generation) is not split over "
                                 "the sequence; generate with context_parallel_size=1."), raised.value


@pytest.mark.parametrize("model_type, model_class, family", [
    ("glm5_next", "Glm5NextForConditionalGeneration", "GLM-5-next"),
    ("hy_v4_vl", "HYV4VLForConditionalGeneration", "HY-V4-VL")])
def test_the_multimodal_members_are_refused_naming_them(model_type, model_class, family):
    pytest.importorskip(f"transformers.models.{model_type}")
    from lightning_mhc.any_model import record_module_init

    with record_module_init():
        model = transformers.AutoModelForImageTextToText.from_config(transformers.AutoConfig.for_model(model_type))
    message = _refusal(model=model, layout=ParallelLayout())
    assert message.startswith(f"plan='auto': {model_class} (model_type '{model_type}') is not built in: {family}: "), \
        message


def test_the_command_line_trains_it_on_tp2_cp2_as_one_process(saved, tmp_path):
    """``lightning-mhc-train model=hf model.pretrained=DIR parallel=tp2cp2`` (TP 2 with sequence
    parallelism x CP 2; docs/native_mhc.md's worked command, on its entry point on forked ranks;
    synthetic tokens below the model's vocabulary of 64): 3 AdamW steps' losses equal the same
    command on one process (1e-5)."""
    check_command_line_against_one_process(saved, tmp_path, "TP 2 (SP) x CP 2", "parallel=tp2cp2")
