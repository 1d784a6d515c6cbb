"""HY-V4 (``hy_v4``) through ``parallelize(model, plan="auto")`` (``any_model/hy_v4.py``, its family
record): its own hyper-connections kept as they are (``hc_mult`` streams, none added, carried flat
between pipeline stages as DeepSeek-V4's), from ``save_pretrained`` files in several shards (its
checkpoint's own tensor names), against the model in one process (fp32).

A tiny HY-V4 (tests/v4_utils.py's ``tiny_hy_v4_config``: a dense layer then three MoE layers with a shared expert
and a score-correction bias, every attention's indexer picking 4 of 16 keys, full and shared
indexer layers in turn, the experts' clamp cutting, every map moved off its init): on one process bit-exact; one spawned
4-rank group runs TP 2 x PP 2, PP 2 x EP 2 and TP 2 x EP 2 (step-0 logits within 1e-5 of one
process) and 3 SGD steps through ``Trainer.fit`` on TP 2 x EP 2 and, with the block recompute of its
hyper-connections (``mhc_block``), on TP 2 x PP 2 (losses and weights within 1e-5); in one process
``mhc_block`` gives the same logits and gradients (1e-5) keeping fewer bytes.
The command line trains it on TP 2 x PP 2. What is not built (CP, sequence parallelism, a stage
beginning with a shared-indexer layer, GLM-5-next and HY-V4-VL) is refused in one line before anything is built.
The spawned group's helpers are DeepSeek-V4's (tests/test_deepseek_v4_parallel.py): they read the
model from its directory.
"""
from __future__ import annotations

import pathlib

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.hy_v4")

from lightning_mhc.any_model import check_parallelize  # noqa: E402
from lightning_mhc.distributed.layout import ParallelLayout  # noqa: E402
from lightning_mhc.testing.launch import spawn_ranks  # noqa: E402
from test_deepseek_v4_parallel import (  # noqa: E402
    BLOCK_RECOMPUTE, _all_layouts, _refusal, check_against_one_process, check_block_recompute_in_one_process,
    check_command_line_against_one_process, check_one_process_bit_for_bit, meta_model, save_moved)
from v4_utils import tiny_hy_v4_config  # noqa: E402


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> pathlib.Path:
    return save_moved(tmp_path_factory.mktemp("hy_v4"), tiny_hy_v4_config())


LAYOUTS = {"tp2pp2": dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2),
           "pp2ep2": dict(pipeline_model_parallel_size=2, expert_model_parallel_size=2),
           "tp2ep2": dict(tensor_model_parallel_size=2, expert_model_parallel_size=2)}
"""The layouts of the 4 ranks (DP fills the rest)."""
FITS = {"tp2ep2": dict(tensor_model_parallel_size=2, expert_model_parallel_size=2),
        "tp2pp2 mhc_block": dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                                 recompute=BLOCK_RECOMPUTE)}
"""The layouts trained through ``Trainer.fit`` (DP 2): the rotary key's gradient summed over TP, the
experts' over their ranks; TP 2 x PP 2 with the block recompute of its hyper-connections (a group
of 2 layers per stage)."""


def test_one_process_is_the_model_bit_for_bit(saved):
    check_one_process_bit_for_bit(saved)


def test_block_recompute_of_its_hyper_connections_in_one_process(saved, monkeypatch):
    check_block_recompute_in_one_process(saved, at_most=0.75, monkeypatch=monkeypatch)


def test_layouts_equal_one_process(saved):
    results = spawn_ranks(_all_layouts, 4, str(saved), FITS, LAYOUTS, timeout_s=240, init_group=False)
    check_against_one_process(saved, results, LAYOUTS, FITS)


def test_what_is_not_built_is_refused_in_one_line(saved):
    model = meta_model(saved)
    message = _refusal(model=model, layout=ParallelLayout(), hyper_connections=4)
    assert "model_type 'hy_v4'" in message and "carries its own (hc_mult=4 streams)" in message
    message = _refusal(model=model, layout=ParallelLayout(tensor_model_parallel_size=2, sequence_parallel=True))
    assert "(model_type 'hy_v4'): sequence_parallel=True is not built" in message, message
    message = _refusal(model=model, layout=ParallelLayout(expert_model_parallel_size=3))  # 4 experts
    assert "4 experts, which do not split evenly over 3 ranks" in message, message
    message = _refusal(model=model, layout=ParallelLayout(tensor_model_parallel_size=8))  # 4 heads
    assert "self_attn.num_heads=4 cannot be divided by tensor_model_parallel_size=8" in message, message
    message = _refusal(model=model, layout=ParallelLayout(context_parallel_size=2))
    assert "(model_type 'hy_v4')" in message and "top-k keys over the whole sequence" in message, message
    check_parallelize(model, "auto", layout=ParallelLayout(), recompute="mhc_block")  # on its own hyper-connections
    # layer 1's indexer reuses layer 0's picks: a stage cannot begin there
    message = _refusal(model=model, layout=ParallelLayout(pipeline_model_parallel_size=2), pipeline_split=[1, 3])
    assert "pipeline stage 1 would begin with layer 1, whose indexer is 'shared'" in message, message
    check_parallelize(model, "auto", layout=ParallelLayout(pipeline_model_parallel_size=2))  # [0, 1], [2, 3] run


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


def test_the_command_line_trains_it_on_tp2_pp2_as_one_process(saved, tmp_path):
    """``lightning-mhc-train model=hf model.pretrained=DIR parallel=tp2pp2`` (its entry point on
    forked ranks; synthetic tokens below the model's vocabulary of 64): 3 AdamW steps' losses
    equal the same command on one process (1e-5)."""
    check_command_line_against_one_process(saved, tmp_path, "TP 2 x PP 2", "parallel=tp2pp2")
