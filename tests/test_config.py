"""MHCTransformerConfig validation: each error names the keys, values and the fix."""
from __future__ import annotations

import pytest

from lightning_mhc import ConfigError
from model_utils import tiny_config


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(recompute_hyper_connections=True, enable_hyper_connections=False, num_residual_streams=1),
         "needs enable_hyper_connections=True"),
        (dict(recompute_hyper_connections=True), "recompute_granularity='selective'"),
        (dict(recompute_hyper_connections=True, recompute_granularity="selective",
              recompute_modules=["layernorm", "mlp"]), "'mlp' in recompute_modules"),
        (dict(num_residual_streams=0), "num_residual_streams=0"),
        (dict(mhc_sinkhorn_iterations=0), "mhc_sinkhorn_iterations=0"),
        (dict(enable_hyper_connections=False), "num_residual_streams=1"),
        (dict(normalization="LayerNorm"), "RMSNorm"),
        (dict(position_embedding_type="alibi"), "position_embedding_type='alibi'"),
        (dict(mhc_recompute_layer_num=0), "mhc_recompute_layer_num=0"),
    ],
)
def test_invalid_configs(overrides, match):
    with pytest.raises(ConfigError, match=match):
        tiny_config(**overrides)


def test_valid_mhc_recompute_config():
    cfg = tiny_config(recompute_hyper_connections=True, recompute_granularity="selective",
                      recompute_modules=["layernorm"])
    assert cfg.recompute_hyper_connections


def test_tensor_parallel_divisibility():
    cfg = tiny_config(num_attention_heads=4, num_query_groups=2)
    cfg.validate_tensor_parallel(2)
    with pytest.raises(ConfigError, match="num_query_groups=2 is not divisible by tensor_model_parallel_size=4"):
        cfg.validate_tensor_parallel(4)


@pytest.mark.parametrize("n, layers, expected", [(4, 12, 2), (4, 4, 1), (4, 48, 5), (1, 9, 1)])
def test_recompute_layer_num_default(n, layers, expected):
    """Paper eq. 20: L_r = max(1, int(sqrt(n L / (n + 2))))."""
    cfg = tiny_config(num_residual_streams=n, enable_hyper_connections=True)
    assert cfg.recompute_layer_num(layers) == expected


def test_vocab_padding():
    assert tiny_config(vocab_size=50257, make_vocab_size_divisible_by=128).padded_vocab_size == 50304
