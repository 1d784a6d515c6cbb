"""Recompute policy selection: every invalid combination names the keys and the fix."""
from __future__ import annotations

import pytest

from lightning_mhc import ConfigError
from lightning_mhc.recompute import configure_recompute, policy_of, recompute_fields
from model_utils import tiny_config


@pytest.mark.parametrize("policy", ["none", "selective", "mhc_block", "full"])
def test_policies_round_trip(policy):
    cfg = configure_recompute(tiny_config(), policy)
    assert policy_of(cfg) == policy


def test_mhc_block_fields():
    cfg = configure_recompute(tiny_config(), "mhc_block", mhc_recompute_layer_num=3)
    assert cfg.recompute_hyper_connections and cfg.recompute_granularity == "selective"
    assert cfg.recompute_modules == ["layernorm"] and cfg.mhc_recompute_layer_num == 3


@pytest.mark.parametrize(
    "config_overrides, policy, kwargs, match",
    [
        (dict(enable_hyper_connections=False, num_residual_streams=1), "mhc_block", {},
         "needs enable_hyper_connections=True"),
        ({}, "mhc_block", dict(recompute_modules=["layernorm", "mlp"]), "Remove 'mlp'"),
        ({}, "mhc_block", dict(recompute_modules=["moe_act"]), "choose from core_attn, layernorm, mlp"),
        ({}, "full", dict(recompute_modules=["layernorm"]), "only used by the 'selective' and 'mhc_block'"),
        ({}, "checkpoint_everything", {}, "unknown recompute policy 'checkpoint_everything'"),
        ({}, "mhc_block", dict(mhc_recompute_layer_num=0), "mhc_recompute_layer_num=0"),
    ],
)
def test_invalid_policy_combinations(config_overrides, policy, kwargs, match):
    with pytest.raises(ConfigError, match=match):
        configure_recompute(tiny_config(**config_overrides), policy, **kwargs)


def test_fields_direct_on_config_are_validated_too():
    """Setting megatron's fields by hand hits the same checks (config __post_init__)."""
    fields = recompute_fields("mhc_block")
    fields["recompute_modules"] = ["mlp"]
    with pytest.raises(ConfigError, match="'mlp' in recompute_modules"):
        tiny_config(**fields)
    fields = recompute_fields("mhc_block")
    fields["recompute_granularity"] = "full"
    fields["recompute_method"], fields["recompute_num_layers"] = "uniform", 1
    with pytest.raises(ConfigError, match="recompute_granularity='selective'"):
        tiny_config(**fields)
