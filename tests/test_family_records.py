"""One record per Hugging Face family (``any_model/families.py``): every capability a record claims
is exercised on a tiny model of that family, and every one it does not claim is refused in one
line naming the family. In one process, on the meta device, through ``check_parallelize`` on
layouts not built (no process group): the TP plan's patterns and sizes at TP 2, the pipeline
contract (blocks, embedding, final norm, head) at PP 2, the hyper-connection plan at 4 streams,
CP 2 and EP 2. Also: the other tables are views of the records, and the docs' table of families
is the records'."""
from __future__ import annotations

import dataclasses
import fnmatch
import pathlib
import re

import pytest

transformers = pytest.importorskip("transformers")

from lightning_mhc import ConfigError  # noqa: E402
from lightning_mhc.any_model import (  # noqa: E402
    HC_PLANS, PLANS, check_parallelize, check_plan, record_module_init, supported_families)
from lightning_mhc.any_model import deepseek_v4, experts as experts_module, families, hy_v4  # noqa: E402
from lightning_mhc.any_model import plan as plan_module  # noqa: E402
from lightning_mhc.any_model.context_parallel import SUPPORTED_FAMILIES  # noqa: E402
from lightning_mhc.any_model.experts import is_fused_experts  # noqa: E402
from lightning_mhc.any_model.families import FAMILIES, RECORDS, FamilyRecord  # noqa: E402
from lightning_mhc.any_model.pipeline import find_parts  # noqa: E402
from lightning_mhc.distributed.layout import ParallelLayout  # noqa: E402
from v4_utils import tiny_hy_v4_config, tiny_v4_config  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
COMMON = dict(vocab_size=64, hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, bos_token_id=0, eos_token_id=1, pad_token_id=0)
"""Small enough to build 16 models on the meta device in a second; every size divides by 2."""
HEAD = dict(head_dim=8)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
CONFIGS = {
    "gpt2": lambda: transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=64),
    "llama": lambda: transformers.LlamaConfig(**COMMON),
    "phi3": lambda: transformers.Phi3Config(**{**COMMON, "num_key_value_heads": 4}, original_max_position_embeddings=64),
    "gpt_neox": lambda: transformers.GPTNeoXConfig(**{k: v for k, v in COMMON.items() if k != "num_key_value_heads"}),
    "opt": lambda: transformers.OPTConfig(**{k: v for k, v in COMMON.items() if k not in ("intermediate_size",
                                                                                           "num_key_value_heads")},
                                          ffn_dim=32, word_embed_proj_dim=32),
    "mistral": lambda: transformers.MistralConfig(**COMMON, sliding_window=None),
    "qwen2": lambda: transformers.Qwen2Config(**COMMON),
    "gemma": lambda: transformers.GemmaConfig(**COMMON, **HEAD),
    "gemma2": lambda: transformers.Gemma2Config(**COMMON, **HEAD),
    "qwen3": lambda: transformers.Qwen3Config(**COMMON, **HEAD),
    "gemma3_text": lambda: transformers.Gemma3TextConfig(**COMMON, **HEAD),
    "mixtral": lambda: transformers.MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(**COMMON, **MOE, shared_expert_intermediate_size=16),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(**COMMON, **HEAD, **MOE),
    "olmoe": lambda: transformers.OlmoeConfig(**{**COMMON, "num_key_value_heads": 4}, num_experts=4,
                                              num_experts_per_tok=2),
    "deepseek_v4": lambda: tiny_v4_config(layers=2),
    "hy_v4": lambda: tiny_hy_v4_config(layers=2, indexer_types=["full", "full"]),  # each stage of two begins full
}
"""A tiny config of each family, without a sliding window where it can go (so the CP claim is the
record's, not the config's)."""
ALIASES = {"gemma3": "gemma3_text"}
"""transformers builds ``model_type`` ``gemma3`` as the multimodal ``Gemma3ForConditionalGeneration``
(its text tower under ``model.language_model``), which no record fits: the ``gemma3`` record is the
text model's (``Gemma3ForCausalLM``, ``model_type`` ``gemma3_text``) by name."""


def meta_model(config):
    with record_module_init():
        return transformers.AutoModelForCausalLM.from_config(config)


def model_of(name: str):
    """A tiny model of family ``name`` on the meta device (the alias's for ``gemma3``)."""
    model = meta_model(CONFIGS[ALIASES.get(name, name)]())
    assert model.config.model_type == ALIASES.get(name, name)
    return model


def refusal(call, *args, **kwargs) -> str:
    """The one-line message ``call`` refuses with."""
    with pytest.raises(ConfigError) as raised:
        call(*args, **kwargs)
    message = str(raised.value)
    assert "\n" not in message, message
    return message


def layout(**sizes) -> ParallelLayout:
    return ParallelLayout(**sizes)  # not built: check_parallelize makes no group


# ------------------------------------------------------------------ the one table
def test_every_table_of_families_is_a_view_of_the_records():
    assert tuple(FAMILIES) == supported_families() == tuple(r.model_type for r in RECORDS)
    assert set(CONFIGS) | set(ALIASES) == set(FAMILIES)
    assert all(isinstance(r, FamilyRecord) and FAMILIES[r.model_type] is r for r in RECORDS)
    assert PLANS == {name: r.tp for name, r in FAMILIES.items()}
    assert HC_PLANS == {name: r.hyper_connections for name, r in FAMILIES.items() if r.hyper_connections is not None}
    assert SUPPORTED_FAMILIES == tuple(name for name, r in FAMILIES.items() if r.context_parallel)
    for alias, name in ALIASES.items():  # one family under two names: the same claims
        assert dataclasses.replace(FAMILIES[alias], model_type=name) == FAMILIES[name]
    for record in RECORDS:
        assert record.tp.output == record.pipeline.head, record.model_type
        # a router loss and a router bias are a MoE family's
        assert record.router_loss is None or record.experts is not None, record.model_type
        assert record.router_bias is None or record.experts is not None, record.model_type


def test_a_record_claims_cp_or_says_why_not_and_hyper_connections_of_one_kind():
    llama = FAMILIES["llama"]
    assert "CP refusal" in refusal(dataclasses.replace, llama, context_parallel=False, context_parallel_refusal=None)
    assert "CP refusal" in refusal(dataclasses.replace, llama, context_parallel_refusal="no")
    assert "streams of its own" in refusal(dataclasses.replace, llama, native_streams="hc_mult")
    assert "native_streams and carry_streams together" in refusal(
        dataclasses.replace, llama, hyper_connections=None, native_streams="hc_mult")


# ------------------------------------------------------------------ TP, pipeline, hyper-connections
@pytest.mark.parametrize("name", list(FAMILIES))
def test_the_records_tp_plan_pipeline_and_hyper_connections_fit_a_model_of_the_family(name):
    """At TP 2 every pattern of the plan matches a module of the family's model and fits it; at
    PP 2 the stage split uses the record's block list, which is also the one found without it, with
    the embedding first and the final norm and head last; 4 streams wire every block."""
    record, model = FAMILIES[name], model_of(name)
    check_plan(model, record.tp, 2)  # refuses a pattern that matches no module
    contract = record.pipeline
    streams = None if record.native_streams else 4  # a family with streams of its own takes none of ours
    plan, parts, ranges = check_parallelize(model, name, layout=layout(tensor_model_parallel_size=2,
                                                                      pipeline_model_parallel_size=2),
                                            hyper_connections=streams)
    assert parts.block_path == contract.blocks and ranges == [(0, 1), (1, 2)]
    assert find_parts(model, after_blocks=record.tp.after_blocks).block_path == contract.blocks
    assert contract.embedding in parts.first and {contract.final_norm, contract.head} <= set(parts.last), parts
    if record.native_streams:
        assert not any(hasattr(block, "hyper_connection_wiring") for block in parts.blocks)
        assert families.native_stream_count(model) == getattr(model.config, record.native_streams) > 1
        return
    assert all(hasattr(block, "hyper_connection_wiring") for block in parts.blocks)
    assert len(parts.blocks[0].hyper_connection_wiring.plan.branches) == len(
        record.hyper_connection_plan(model.config).branches)


def test_a_record_whose_pipeline_contract_does_not_fit_is_refused(monkeypatch):
    record = FAMILIES["llama"]
    wrong = dataclasses.replace(record, pipeline=dataclasses.replace(record.pipeline, final_norm="lm_head_norm"))
    monkeypatch.setitem(FAMILIES, "llama", wrong)
    message = refusal(check_parallelize, model_of("llama"), "auto", layout=layout(pipeline_model_parallel_size=2))
    assert "model_type 'llama'" in message and "lm_head_norm on the last stage" in message


def test_the_multimodal_gemma3_is_refused_by_its_plan():
    model = meta_model(transformers.Gemma3Config(text_config={**COMMON, **HEAD}))
    message = refusal(check_parallelize, model, "auto", layout=layout(tensor_model_parallel_size=2))
    assert "matches no module of Gemma3ForConditionalGeneration" in message


def test_hyper_connections_are_refused_on_a_family_with_streams_of_its_own(monkeypatch):
    """The place of the native-mHC families (DeepSeek-V4): ``native_streams`` names the config's
    stream count, and ``hyper_connections=n`` is refused, whatever the plan; without a plan of its
    own a family is refused its hyper-connections by name."""
    native = dataclasses.replace(FAMILIES["llama"], hyper_connections=None, native_streams="hc_mult",
                                 carry_streams=FAMILIES["deepseek_v4"].carry_streams)
    monkeypatch.setitem(FAMILIES, "llama", native)
    model = model_of("llama")
    model.config.hc_mult = 4
    message = refusal(check_parallelize, model, "auto", layout=layout(), hyper_connections=4)
    assert "model_type 'llama'" in message and "carries its own (hc_mult=4 streams)" in message
    check_parallelize(model, "auto", layout=layout(pipeline_model_parallel_size=2))  # the rest is unchanged
    monkeypatch.setitem(FAMILIES, "llama", dataclasses.replace(native, native_streams=None, carry_streams=None))
    message = refusal(check_parallelize, model, "auto", layout=layout(), hyper_connections=4)
    assert "model_type 'llama'" in message and "has no built-in plan" in message


# ------------------------------------------------------------------ CP
@pytest.mark.parametrize("name", list(CONFIGS))
def test_cp_runs_where_the_record_claims_it_and_is_refused_in_one_line_elsewhere(name):
    record, model = FAMILIES[name], model_of(name)
    if record.context_parallel:
        check_parallelize(model, "auto", layout=layout(context_parallel_size=2))
        return
    message = refusal(check_parallelize, model, "auto", layout=layout(context_parallel_size=2))
    assert message.startswith(f"context parallelism: {type(model).__name__} (model_type {name!r}): "), message
    config_reason = "sliding-window" in message or "softcapping" in message  # the config's values say it first
    assert config_reason or record.context_parallel_refusal in message, message
    assert "the families split over CP are llama, mistral, qwen2, qwen3" in message


def test_cp_follows_the_record(monkeypatch):
    """A record that stops claiming CP is refused with its own reason; one that claims it runs."""
    monkeypatch.setitem(FAMILIES, "llama", dataclasses.replace(FAMILIES["llama"], context_parallel=False,
                                                               context_parallel_refusal="a reason of the record's"))
    monkeypatch.setitem(FAMILIES, "gemma", dataclasses.replace(FAMILIES["gemma"], context_parallel=True,
                                                               context_parallel_refusal=None))
    message = refusal(check_parallelize, model_of("llama"), "auto", layout=layout(context_parallel_size=2))
    assert "(model_type 'llama'): a reason of the record's; the families split over CP are mistral, qwen2, gemma, qwen3" in message
    check_parallelize(model_of("gemma"), "auto", layout=layout(context_parallel_size=2))


# ------------------------------------------------------------------ EP
@pytest.mark.parametrize("name", list(CONFIGS))
def test_ep_finds_the_records_fused_experts_and_a_dense_family_is_refused(name):
    record, model = FAMILIES[name], model_of(name)
    if record.experts is not None:
        check_parallelize(model, "auto", layout=layout(expert_model_parallel_size=2))
        found = [n for n, module in model.named_modules() if is_fused_experts(module)]
        assert found and all(fnmatch.fnmatchcase(n, record.experts.path) for n in found), found
        if record.router_loss is not None:
            assert isinstance(getattr(model.config, record.router_loss.coef), float)  # the aux loss's coefficient
        return
    message = refusal(check_parallelize, model, "auto", layout=layout(expert_model_parallel_size=2))
    assert f"has no fused experts" in message and f"model_type {name!r} is a dense family" in message, message


def test_ep_follows_the_record_not_the_module_shapes(monkeypatch):
    """Fused experts elsewhere than the record says, or in a family whose record claims none, are
    refused naming the family (the shapes alone would split them)."""
    record = FAMILIES["mixtral"]
    monkeypatch.setitem(FAMILIES, "mixtral", dataclasses.replace(record, experts=families.FusedExperts("*.moe")))
    message = refusal(check_parallelize, model_of("mixtral"), "auto", layout=layout(expert_model_parallel_size=2))
    assert "model_type 'mixtral'" in message and "fused experts at model.layers.0.mlp.experts" in message
    monkeypatch.setitem(FAMILIES, "mixtral", dataclasses.replace(record, experts=None, router_loss=None))
    message = refusal(check_parallelize, model_of("mixtral"), "auto", layout=layout(expert_model_parallel_size=2))
    assert "model_type 'mixtral' is a dense family" in message


# ------------------------------------------------------------------ the docs' table
def _constant_name(value, *modules) -> str:
    return next(name for module in modules for name, v in vars(module).items() if v is value and name.isupper())


def _branches(record: FamilyRecord) -> str:
    if record.native_streams is not None:
        return f"its own (`{record.native_streams}`)"
    plan = record.hyper_connection_plan(None)  # the default config's plan (the docs' notes say when it changes)
    return "; ".join(f"`{b.entry}` → `{b.exit}`" + (" (parallel)" if b.parallel else "")
                     + (f" (then the block's `{b.dropout}`)" if b.dropout else "") for b in plan.branches)


def table_row(record: FamilyRecord) -> str:
    """The docs' row of ``record`` (docs/mhc_any_model.md, "Built-in families")."""
    contract = record.pipeline
    cp = "yes" if record.context_parallel else f"no: {record.context_parallel_refusal}"
    ep = f"`{record.experts.path}`" if record.experts is not None else "no: dense"
    return (f"| `{record.model_type}` | `{_constant_name(record.tp, plan_module, experts_module, deepseek_v4, hy_v4)}` | {_branches(record)} "
            f"| {cp} | {ep} | `{contract.blocks}`; `{contract.embedding}`; `{contract.final_norm}`; "
            f"`{contract.head}` |")


def test_the_docs_table_of_families_is_the_records():
    text = (ROOT / "docs" / "mhc_any_model.md").read_text()
    rows = re.findall(r"^\| `[a-z0-9_]+` \| `[A-Z0-9_]+` \|.*\|$", text.split("## Built-in families", 1)[1], re.M)
    expected = [table_row(record) for record in RECORDS]
    assert rows == expected, "\n".join(["docs/mhc_any_model.md's table should read:", *expected])
