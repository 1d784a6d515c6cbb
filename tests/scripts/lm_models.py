"""The models of the bring-your-own-model tests: Hugging Face GPT-2 and Llama from small configs
(no download), and a plain PyTorch transformer written the way a user writes one, with its plan."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from lightning_mhc.any_model import Column, TPPlan

VOCAB, SEQ, WIDTH, LAYERS, HEADS = 128, 16, 64, 4, 4


def gpt2(dropout: float = 0.0) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(
        n_layer=LAYERS, n_embd=WIDTH, n_head=HEADS, vocab_size=VOCAB, n_positions=SEQ, bos_token_id=0, eos_token_id=0,
        resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout, attn_implementation="eager"))


def llama(dropout: float = 0.0) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(
        num_hidden_layers=LAYERS, hidden_size=WIDTH, intermediate_size=2 * WIDTH, num_attention_heads=HEADS,
        num_key_value_heads=HEADS // 2, vocab_size=VOCAB, max_position_embeddings=SEQ, bos_token_id=0,
        eos_token_id=0, attention_dropout=dropout, attn_implementation="eager"))


class Attention(nn.Module):
    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, width // heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.attn_drop = nn.Dropout(dropout)
        self.resid_drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.head_dim)
        causal = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        probs = self.attn_drop(scores.masked_fill(~causal, float("-inf")).softmax(-1))
        out = (probs @ v).transpose(1, 2).reshape(b, s, self.heads * self.head_dim)
        return self.resid_drop(self.proj(out))


class Block(nn.Module):
    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = Attention(width, heads, dropout)
        self.fc1, self.fc2 = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
        self.mlp_drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp_drop(self.fc2(F.gelu(self.fc1(self.ln2(x)))))


class PlainTransformer(nn.Module):
    """A user's own GPT: token and position embeddings, pre-norm blocks, a final norm and a head."""

    def __init__(self, vocab: int = VOCAB, width: int = WIDTH, heads: int = HEADS, layers: int = LAYERS,
                 seq: int = SEQ, dropout: float = 0.0) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, width), nn.Embedding(seq, width)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(width, heads, dropout) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.drop(self.tok(input_ids) + self.pos(positions))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


PLAIN_PLAN = TPPlan(
    layers={"tok": "vocab", "blocks.*.attn.qkv": Column(stride=3), "blocks.*.attn.proj": "row",
            "blocks.*.fc1": "column", "blocks.*.fc2": "row", "head": "column"},
    divide={"blocks.*.attn": ("heads",)},
    random={"blocks.*.attn": "parallel", "blocks.*.attn.resid_drop": "replicated"},
    selective=("blocks.*.attn",),
)

def tied_llama(dropout: float = 0.0, **config) -> nn.Module:
    """Llama with its head tied to the embedding (as Llama 3.2 1B/3B, Qwen2, Gemma); ``config``
    overrides the LlamaConfig's fields."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(**{**dict(
        num_hidden_layers=LAYERS, hidden_size=WIDTH, intermediate_size=2 * WIDTH, num_attention_heads=HEADS,
        num_key_value_heads=HEADS // 2, vocab_size=VOCAB, max_position_embeddings=SEQ, bos_token_id=0,
        eos_token_id=0, attention_dropout=dropout, attn_implementation="eager", tie_word_embeddings=True), **config}))


DICT_PLAN = {  # the README's dict form, as a user writes it: no output layer named
    "model.embed_tokens": "vocab",
    "model.layers.*.self_attn.q_proj": "column", "model.layers.*.self_attn.k_proj": "column",
    "model.layers.*.self_attn.v_proj": "column", "model.layers.*.self_attn.o_proj": "row",
    "model.layers.*.mlp.gate_proj": "column", "model.layers.*.mlp.up_proj": "column",
    "model.layers.*.mlp.down_proj": "row",
    "lm_head": "column",
}

# ------------------------------------------------------------------ the families users bring
WINDOW = 4
"""Sliding windows shorter than the sequence: a stage that lost the model's masks would differ."""


def hf_model(config_class: str, model_class: str, attention_dropout: float = 0.0, **config) -> nn.Module:
    """A small Hugging Face model of ``transformers.<model_class>`` from ``<config_class>``."""
    import transformers

    base = dict(num_hidden_layers=LAYERS, hidden_size=WIDTH, intermediate_size=2 * WIDTH, num_attention_heads=HEADS,
                num_key_value_heads=HEADS // 2, vocab_size=VOCAB, max_position_embeddings=SEQ, bos_token_id=0,
                eos_token_id=0, pad_token_id=0, attention_dropout=attention_dropout, attn_implementation="eager")
    return getattr(transformers, model_class)(getattr(transformers, config_class)(**{**base, **config}))


def mistral(dropout: float = 0.0) -> nn.Module:
    return hf_model("MistralConfig", "MistralForCausalLM", dropout, sliding_window=WINDOW)


def qwen2(dropout: float = 0.0) -> nn.Module:  # biased q/k/v; a tied head; sliding windows from layer 2 on
    return hf_model("Qwen2Config", "Qwen2ForCausalLM", dropout, tie_word_embeddings=True, use_sliding_window=True,
               sliding_window=WINDOW, max_window_layers=2)


def qwen3(dropout: float = 0.0) -> nn.Module:  # q/k norms per head
    return hf_model("Qwen3Config", "Qwen3ForCausalLM", dropout, head_dim=WIDTH // HEADS)


def gemma2(dropout: float = 0.0) -> nn.Module:  # scaled embedding, soft-capped logits, local/global layers
    return hf_model("Gemma2Config", "Gemma2ForCausalLM", dropout, head_dim=WIDTH // HEADS, sliding_window=WINDOW,
               query_pre_attn_scalar=WIDTH // HEADS)


def gemma3(dropout: float = 0.0) -> nn.Module:  # its scaled embedding is a module of its own
    return hf_model("Gemma3TextConfig", "Gemma3ForCausalLM", dropout, head_dim=WIDTH // HEADS, sliding_window=WINDOW,
               query_pre_attn_scalar=WIDTH // HEADS, layer_types=["sliding_attention", "full_attention"] * (LAYERS // 2))


def phi3(dropout: float = 0.0) -> nn.Module:  # fused [q; k; v] and [gate; up]
    return hf_model("Phi3Config", "Phi3ForCausalLM", dropout, num_key_value_heads=HEADS, sliding_window=WINDOW,
               original_max_position_embeddings=SEQ)


def gpt_neox(dropout: float = 0.0) -> nn.Module:  # fused per-head [q, k, v]; partial rotary
    return hf_model("GPTNeoXConfig", "GPTNeoXForCausalLM", dropout, rotary_pct=0.5, hidden_dropout=dropout)


def opt(dropout: float = 0.0) -> nn.Module:  # learned positions (offset 2), tied head
    return hf_model("OPTConfig", "OPTForCausalLM", dropout, ffn_dim=2 * WIDTH, word_embed_proj_dim=WIDTH,
               dropout=dropout, pad_token_id=1)


def mixtral(dropout: float = 0.0) -> nn.Module:  # 4 routed experts, top 2: split over EP (any_model/experts.py)
    return hf_model("MixtralConfig", "MixtralForCausalLM", dropout, num_local_experts=4, num_experts_per_tok=2)


FAMILIES = {"mistral": (mistral, "mistral"), "qwen2": (qwen2, "qwen2"), "qwen3": (qwen3, "qwen3"),
            "gemma2": (gemma2, "gemma2"), "gemma3": (gemma3, "auto"), "phi3": (phi3, "phi3"),
            "gpt_neox": (gpt_neox, "gpt_neox"), "opt": (opt, "opt")}
"""Each family from a small config, with its built-in plan (Gemma 3's found by ``plan="auto"``)."""

MODELS = {"gpt2": (gpt2, "gpt2"), "llama": (llama, "llama"), "plain": (PlainTransformer, PLAIN_PLAN),
          "tiedllama": (tied_llama, DICT_PLAN), "mixtral": (mixtral, "auto"), **FAMILIES}


def save_sample_llama(directory, **config):
    """A small Llama as ``save_pretrained`` writes it (sharded), with the tokenizer of the shipped
    sample corpus (``tokenizer.json``): what ``lightning-mhc-train model=hf model.pretrained=DIR``
    continues (its documents' ``$HOME/llama``)."""
    import shutil
    from pathlib import Path

    from lightning_mhc.data.sample import SAMPLE_DIR, SAMPLE_VOCAB

    directory = Path(directory)
    torch.manual_seed(3)
    model = tied_llama(**{**dict(vocab_size=SAMPLE_VOCAB, max_position_embeddings=128, tie_word_embeddings=False),
                          **config})
    model.save_pretrained(directory, max_shard_size="200KB")
    shutil.copy(SAMPLE_DIR / "tokenizer.json", directory / "tokenizer.json")
    return directory
