"""Generation on a whole GPTModel: the KV cache gives what repeated full forwards give."""
from __future__ import annotations

import pytest
import torch

from lightning_mhc.model.generation import kv_cache, sample_next
from lightning_mhc.model.gpt import GPTModel
from model_utils import tiny_config


def _argmax_of_full_forwards(model: GPTModel, prompt: torch.Tensor, n: int) -> torch.Tensor:
    tokens = prompt
    with torch.no_grad():
        for _ in range(n):
            logits = model(tokens)[:, -1, :model.config.vocab_size]
            tokens = torch.cat([tokens, logits.argmax(-1, keepdim=True)], dim=1)
    return tokens


@pytest.mark.parametrize("overrides", [
    dict(),                                                   # RoPE, 4 streams
    dict(position_embedding_type="learned_absolute"),         # learned positions continue the cache
    dict(num_query_groups=2, gated_linear_unit=True, activation_func=torch.nn.functional.silu),  # GQA, SwiGLU
    dict(num_residual_streams=1, enable_hyper_connections=False),
], ids=["rope", "learned", "gqa_swiglu", "no_hc"])
def test_greedy_with_kv_cache_equals_argmax_of_full_forwards(model_parallel, overrides):
    torch.manual_seed(0)
    model = GPTModel(tiny_config(**overrides)).eval()
    prompt = torch.randint(0, model.config.vocab_size, (2, 5))
    expected = _argmax_of_full_forwards(model, prompt, 8)
    cached = model.generate(prompt, max_new_tokens=8)
    assert torch.equal(cached, expected)
    assert torch.equal(model.generate(prompt, max_new_tokens=8, use_cache=False), expected)
    # the cached step's logits themselves, not only their argmax
    with torch.no_grad(), kv_cache(model) as cache:
        model(expected[:, :7])
        step = model(expected[:, 7:8], start_position=cache.length)
    with torch.no_grad():
        full = model(expected[:, :8])
    torch.testing.assert_close(step[:, -1], full[:, -1], rtol=0, atol=1e-5)


def test_stop_token_and_sampling(model_parallel):
    torch.manual_seed(0)
    model = GPTModel(tiny_config()).eval()
    prompt = torch.randint(0, model.config.vocab_size, (3, 4))
    greedy = model.generate(prompt, max_new_tokens=6)
    stop = int(greedy[0, 5])  # the second generated token of sequence 0
    stopped = model.generate(prompt, max_new_tokens=6, stop_token=stop)
    assert torch.equal(stopped[0, :6], greedy[0, :6]) and (stopped[0, 6:] == stop).all()
    g = torch.Generator().manual_seed(1)
    sampled = model.generate(prompt, max_new_tokens=6, temperature=0.8, top_k=5, top_p=0.9, generator=g)
    assert sampled.shape == (3, 10) and torch.equal(sampled[:, :4], prompt)
    assert int(sampled.max()) < model.config.vocab_size  # never the padded vocabulary


def test_sample_next_filters():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    assert sample_next(logits).item() == 3
    g = torch.Generator().manual_seed(0)
    assert {sample_next(logits, 1.0, top_k=1, generator=g).item() for _ in range(20)} == {3}
    # top_p: p = softmax = [0.032, 0.087, 0.237, 0.644]; 0.5 keeps only the top token, 0.8 the top two
    assert {sample_next(logits, 1.0, top_p=0.5, generator=g).item() for _ in range(50)} == {3}
    assert {sample_next(logits, 1.0, top_p=0.8, generator=g).item() for _ in range(200)} == {2, 3}
    with pytest.raises(ValueError, match="temperature"):
        sample_next(logits, -1.0)


def test_trainer_predict_generates(single_rank_group):
    """Trainer.predict under MHCParallelStrategy: predict_step continues each batch's tokens."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    from lightning_mhc import MHCGPTModule, MHCParallelStrategy

    module = MHCGPTModule(dict(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
                               vocab_size=256, max_sequence_length=32))
    module.generation_kwargs = dict(max_new_tokens=4)
    prompts = [{"tokens": torch.arange(5)}, {"tokens": torch.arange(5, 10)}]
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=MHCParallelStrategy(), logger=False,
                         enable_progress_bar=False, enable_model_summary=False)
    (out,) = trainer.predict(module, DataLoader(prompts, batch_size=2))
    assert out.shape == (2, 9) and torch.equal(out[:, :5], torch.stack([p["tokens"] for p in prompts]))
    from lightning_mhc.distributed.layout import destroy_parallel, single_process_layout

    single_process_layout()  # the strategy's groups went with the Trainer
    try:
        assert torch.equal(module.model.generate(out[:, :5], max_new_tokens=4), out)
    finally:
        destroy_parallel()
