"""Recompute policy selection: every invalid combination names the keys and the fix."""
from __future__ import annotations

import pytest

from lightning_mhc import ConfigError, RecomputePolicy
from model_utils import tiny_config


@pytest.mark.parametrize("policy", ["none", "selective", "mhc_block", "full"])
def test_policies_round_trip(policy):
    cfg = RecomputePolicy(policy).apply(tiny_config())
    assert RecomputePolicy.of_config(cfg).name == policy
    assert RecomputePolicy.of(RecomputePolicy(policy).to_plain()) == RecomputePolicy(policy)


def test_of_takes_what_users_pass_and_the_policy_says_what_it_recomputes():
    block = RecomputePolicy("mhc_block", layer_num=2)
    assert RecomputePolicy.of(block) is block
    assert RecomputePolicy.of(None) == RecomputePolicy.of("none") == RecomputePolicy()
    assert RecomputePolicy.of(dict(name="selective", modules=["core_attn"])) == RecomputePolicy("selective", ["core_attn"])
    asked = {name: (p.full, p.selective, p.block) for name in ("none", "selective", "mhc_block", "full")
             for p in [RecomputePolicy.of(name)]}
    assert asked == {"none": (False, False, False), "selective": (False, True, False),
                     "mhc_block": (False, False, True), "full": (True, False, False)}
    assert block.block_ranges(4, 5) == [(0, 2), (2, 4), (4, 5)]
    with pytest.raises(ConfigError, match="policy='blocks' is not a recompute policy"):
        RecomputePolicy.of("blocks")


def test_mhc_block_fields():
    cfg = RecomputePolicy("mhc_block", layer_num=3).apply(tiny_config())
    assert cfg.recompute_hyper_connections and cfg.recompute_granularity == "selective"
    assert cfg.recompute_modules == ["layernorm"] and cfg.mhc_recompute_layer_num == 3
    with_options = RecomputePolicy("selective", ["core_attn"], 2)
    assert with_options.modules == ("core_attn",) and RecomputePolicy.of(with_options.to_plain()) == with_options


@pytest.mark.parametrize(
    "policy, kwargs, match",
    [
        ("mhc_block", dict(modules=["layernorm", "mlp"]), "Remove 'mlp'"),
        ("mhc_block", dict(modules=["moe_act"]), "choose from core_attn, layernorm, mlp"),
        ("full", dict(modules=["layernorm"]), "only used by the 'selective' and 'mhc_block'"),
        ("checkpoint_everything", {}, "policy='checkpoint_everything' is not a recompute policy"),
        ("mhc_block", dict(layer_num=0), "mhc_recompute_layer_num=0"),
    ],
)
def test_invalid_policies_are_refused_when_made(policy, kwargs, match):
    with pytest.raises(ConfigError, match=match):
        RecomputePolicy(policy, **kwargs)


def test_mhc_block_needs_hyper_connections():
    config = tiny_config(enable_hyper_connections=False, num_residual_streams=1)
    with pytest.raises(ConfigError, match="needs enable_hyper_connections=True"):
        RecomputePolicy("mhc_block").check_model(config.enable_hyper_connections)
    with pytest.raises(ConfigError, match="needs enable_hyper_connections=True"):
        RecomputePolicy("mhc_block").apply(config)


def test_fields_direct_on_config_are_validated_too():
    """Setting megatron's fields by hand hits the same checks (config __post_init__)."""
    fields = RecomputePolicy("mhc_block").transformer_fields()
    fields["recompute_modules"] = ["mlp"]
    with pytest.raises(ConfigError, match="'mlp' in recompute_modules"):
        tiny_config(**fields)
    fields = RecomputePolicy("mhc_block").transformer_fields()
    fields["recompute_granularity"] = "full"
    fields["recompute_method"], fields["recompute_num_layers"] = "uniform", 1
    with pytest.raises(ConfigError, match="recompute_granularity='selective'"):
        tiny_config(**fields)
