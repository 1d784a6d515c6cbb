"""MHCTransformerConfig validation: each error names the keys, values and the fix."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from lightning_mhc import ConfigError, GPTModel
from lightning_mhc.model.config import MEGATRON_NAMES, _same
from lightning_mhc.model.config_dict import model_config_from_dict, model_config_to_dict
from lightning_mhc.recompute import RecomputePolicy, attach_recompute
from model_utils import tiny_config, train_steps


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
        (dict(exact_hidden_dropout=True, attention_dropout=0.1, context_parallel_size=2),
         "exact_hidden_dropout=True with attention_dropout=0.1 under tensor_model_parallel_size=1, "
         "context_parallel_size=2: the attention's dropout"),
        (dict(exact_hidden_dropout=True, attention_dropout=0.1, tensor_model_parallel_size=2),
         "Set attention_dropout=0 or exact_hidden_dropout=False"),
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
    from lightning_mhc import ParallelLayout

    cfg = tiny_config(num_attention_heads=4, num_query_groups=2)
    ParallelLayout(2).check_model(cfg.split_sizes())
    with pytest.raises(ConfigError, match="num_query_groups=2 is not divisible by tensor_model_parallel_size=4"):
        ParallelLayout(4).check_model(cfg.split_sizes())


@pytest.mark.parametrize("n, layers, expected", [(4, 12, 2), (4, 4, 1), (4, 48, 5), (1, 9, 1)])
def test_recompute_layer_num_default(n, layers, expected):
    """Paper eq. 20: L_r = max(1, int(sqrt(n L / (n + 2)))); the last group takes what is left."""
    ranges = RecomputePolicy("mhc_block").block_ranges(n, layers)
    assert ranges == [(start, min(start + expected, layers)) for start in range(0, layers, expected)]
    assert RecomputePolicy("mhc_block", layer_num=layers + 1).block_ranges(n, layers) == [(0, layers)]


def test_vocab_padding():
    assert tiny_config(vocab_size=50257, make_vocab_size_divisible_by=128).padded_vocab_size == 50304


# ------------------------------------------------ Megatron-LM main's names (d98e8a64)
MEGATRON = dict(enable_mhc_connections=True, mhc_num_residual_streams=2, recompute_granularity="selective",
                recompute_modules=["core_attn", "mhc"], mhc_recompute_layer_num=2)
OURS = dict(enable_hyper_connections=True, num_residual_streams=2, recompute_granularity="selective",
            recompute_modules=["core_attn"], recompute_hyper_connections=True, mhc_recompute_layer_num=2)


def assert_same_config(a, b):
    differ = [f.name for f in dataclasses.fields(a) if not _same(getattr(a, f.name), getattr(b, f.name))]
    assert not differ, f"fields differ: {differ}"


@pytest.mark.parametrize("megatron, ours", [
    (MEGATRON, OURS),
    (dict(enable_mhc_connections=False), dict(enable_hyper_connections=False, num_residual_streams=1)),
    (dict(enable_mhc_connections=False, mhc_num_residual_streams=4),  # Megatron ignores n with mHC off
     dict(enable_hyper_connections=False, num_residual_streams=1)),
    (dict(mhc_num_residual_streams=3), dict(num_residual_streams=3)),
    (dict(recompute_granularity="selective", recompute_modules=["mhc"]),
     dict(recompute_granularity="selective", recompute_modules=[], recompute_hyper_connections=True)),
    (dict(enable_mhc_connections=True, enable_hyper_connections=True, mhc_num_residual_streams=2,
          num_residual_streams=2), dict(num_residual_streams=2)),  # both names, same value
])
def test_megatron_names_build_our_config(megatron, ours):
    cfg, expected = tiny_config(**megatron), tiny_config(**ours)
    assert_same_config(cfg, expected)
    assert cfg.enable_mhc_connections is None and cfg.mhc_num_residual_streams is None  # taken over
    assert "mhc" not in cfg.recompute_modules
    assert dataclasses.replace(cfg, hidden_size=128).num_residual_streams == expected.num_residual_streams


def test_megatron_names_round_trip_through_the_dict():
    cfg = tiny_config(enable_mhc_connections=True, mhc_num_residual_streams=2)
    values = model_config_to_dict(cfg)
    assert values["num_residual_streams"] == 2
    assert not set(MEGATRON_NAMES) & set(values), values
    assert_same_config(model_config_from_dict(values), cfg)
    megatron_dict = {**values, "mhc_num_residual_streams": values.pop("num_residual_streams"),
                     "enable_mhc_connections": True}
    assert_same_config(model_config_from_dict(megatron_dict), cfg)


@pytest.mark.parametrize("overrides, match", [
    (dict(enable_mhc_connections=True, enable_hyper_connections=False, num_residual_streams=1),
     r"enable_mhc_connections=True and enable_hyper_connections=False"),
    (dict(mhc_num_residual_streams=2, num_residual_streams=3),
     r"mhc_num_residual_streams=2 and num_residual_streams=3"),
    (dict(mhc_num_residual_streams=0), r"mhc_num_residual_streams=0 \(Megatron-LM's name for num_residual_streams\)"),
    (dict(enable_hyper_connections=False, mhc_num_residual_streams=4),
     r"Set mhc_num_residual_streams=1 or enable_hyper_connections=True"),
    # Megatron-LM transformer_config.py: 'mhc' requires mHC on, refuses 'mlp'; ours also needs 'selective'
    (dict(enable_mhc_connections=False, recompute_granularity="selective", recompute_modules=["mhc"]),
     r"'mhc' in recompute_modules .* needs enable_mhc_connections=True "
     r"\(Megatron-LM's name for enable_hyper_connections\)"),
    (dict(recompute_granularity="selective", recompute_modules=["mhc", "mlp"]),
     r"'mhc' in recompute_modules .* cannot be combined with 'mlp' in recompute_modules=\['mhc', 'mlp'\]"),
    (dict(recompute_modules=["core_attn", "mhc"]),
     r"'mhc' in recompute_modules .* needs recompute_granularity='selective' \(got None\)"),
    (dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1,
          recompute_modules=["mhc"]), r"needs recompute_granularity='selective' \(got 'full'\)"),
    (dict(recompute_granularity="selective", recompute_modules=["mhc"], mhc_recompute_layer_num=0),
     r"mhc_recompute_layer_num=0"),
    (dict(recompute_granularity="selective", recompute_modules=["mhc"], fine_grained_activation_offloading=True,
          offload_modules=["core_attn"]), r"fine_grained_activation_offloading=False"),
    (dict(enable_mhc_connections=True, mtp_num_layers=1), r"enable_mhc_connections=True .* mtp_num_layers=1"),
    (dict(inference_fuse_tp_communication=True, transformer_impl="inference_optimized", add_bias_linear=False),
     r"Set inference_fuse_tp_communication=False"),  # megatron's own checks want the last two
    (dict(recompute_granularity="selective", recompute_modules=["mhc", "moe"]),
     r"recompute_modules=\['mhc', 'moe'\]: \['moe'\] not supported"),
])
def test_megatron_names_refused(overrides, match):
    with pytest.raises(ConfigError, match=match):
        tiny_config(**overrides)


def test_megatron_named_config_trains_like_ours(model_parallel):
    """A tiny model from the Megatron-named config: the same weights, losses and gradients as from ours,
    with the mHC block recompute that 'mhc' in recompute_modules asks for."""
    histories = []
    for names in (MEGATRON, OURS):
        model = GPTModel(tiny_config(**names))
        managers = attach_recompute(model, keep_managers=True)
        histories.append(train_steps(model, steps=2))
        assert len(managers) == 2 * 2  # 2 steps x 2 blocks of mhc_recompute_layer_num=2 layers
    for (loss, grads), (ref_loss, ref_grads) in zip(*histories):
        assert torch.isfinite(loss) and torch.equal(loss, ref_loss)
        assert grads.keys() == ref_grads.keys()
        assert all(torch.equal(grads[k], ref_grads[k]) for k in grads)
