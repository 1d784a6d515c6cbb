"""Real training data (issue 27): a BPE trained here, preprocessing to megatron-core's indexed
format and back, blends, the consumed-samples sampler, the padded vocabulary, MFU's FLOPs, and
every bad input refused before launch."""
from __future__ import annotations

import collections
import json
import pathlib
import random
import subprocess
import sys

import numpy
import pytest
import torch
from hydra.core.global_hydra import GlobalHydra

from lightning_mhc import ConfigError
from lightning_mhc.cli import preflight
from lightning_mhc.cli.preprocess import main as preprocess_main
from lightning_mhc.data.megatron import MegatronDataModule, parse_blend
from lightning_mhc.data.preprocess import preprocess
from lightning_mhc.data.sample import train_bpe
from lightning_mhc.data.samplers import ConsumedSamplesSampler
from lightning_mhc.data.tokenizers import load_tokenizer
from script_runs import run_on_ranks
from subprocess_env import child_env
from train_cli import check_before_launch

WORDS_A = ["alpha", "amber", "anchor", "apple", "arrow", "atlas"]
WORDS_B = ["bravo", "bronze", "bridge", "butter", "basket", "beacon"]


def documents(words: list[str], count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(words) for _ in range(rng.randint(5, 60))) + "." for _ in range(count)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict:
    """A BPE trained here on generated text (vocabulary 300: padded to 384 by the model), and two
    corpora preprocessed with it: A (JSONL with two keys, 2 workers) and B (a folder of text files)."""
    root = tmp_path_factory.mktemp("corpus")
    docs_a, docs_b = documents(WORDS_A, 300, 1), documents(WORDS_B, 120, 2)
    tokenizer = train_bpe(docs_a + docs_b, 300, root / "bpe" / "tokenizer.json")
    with open(root / "a.jsonl", "w") as handle:
        for k, text in enumerate(docs_a):
            handle.write(json.dumps({"text": text, "title": f"doc {k}"}) + "\n")
    (root / "b").mkdir()
    for k, text in enumerate(docs_b):
        (root / "b" / f"{k:04d}.txt").write_text(text)
    a = preprocess(root / "a.jsonl", root / "out" / "a", tokenizer=str(tokenizer), json_keys=["text", "title"],
                   workers=2, append_eod=True, progress=False)
    b = preprocess(root / "b", root / "out" / "b", tokenizer=str(tokenizer), workers=1, append_eod=True,
                   progress=False)
    return dict(root=root, tokenizer=str(tokenizer), docs_a=docs_a, docs_b=docs_b, a=a.prefixes["text"],
                a_title=a.prefixes["title"], b=b.prefixes["text"], a_result=a)


# ------------------------------------------------------------------ tokenizers
def test_a_tokenizer_trained_here_gives_the_model_its_padded_vocabulary(corpus):
    tok = load_tokenizer(corpus["tokenizer"])
    assert tok.vocab_size == 300 and tok.detokenize(tok.tokenize("alpha bravo.")) == "alpha bravo."
    assert tok.eod == tok._tokenizer.token_to_id("<|endoftext|>")
    assert load_tokenizer(pathlib.Path(corpus["tokenizer"]).parent) is tok  # the directory names the same file
    cfg = _compose("data=megatron", f"data.blend=[{corpus['a']}]", f"data.tokenizer={corpus['tokenizer']}")
    config = cfg.transformer_config()
    assert (cfg.vocab_size, config.vocab_size, config.padded_vocab_size) == (300, 300, 384)
    assert _compose().transformer_config().vocab_size == 256  # byte-level data


def test_padding_rows_get_no_probability_and_no_gradient(model_parallel):
    """vocab 300 padded to 384: logits of ids >= 300 are -inf, the loss matches a softmax over the
    300 real ids, and the output layer's padding rows get no gradient."""
    from lightning_mhc.model.config import MHCTransformerConfig
    from lightning_mhc.model.gpt import GPTModel

    config = MHCTransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=300,
                                  max_sequence_length=16, hidden_dropout=0.0, attention_dropout=0.0,
                                  share_embeddings_and_output_weights=False)
    model = GPTModel(config)
    tokens = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    logits = model(tokens)
    assert logits.shape[-1] == 384 and torch.isinf(logits[..., 300:]).all() and torch.isfinite(logits[..., :300]).all()
    loss = model(tokens, labels=tokens)
    expected = torch.nn.functional.cross_entropy(logits[..., :300].reshape(-1, 300), tokens.reshape(-1), reduction="none")
    torch.testing.assert_close(loss.reshape(-1), expected, rtol=1e-5, atol=1e-6)
    loss.mean().backward()
    grad = model.output_layer.weight.grad
    assert grad[300:].abs().max() == 0 and grad[:300].abs().max() > 0


# ------------------------------------------------------------------ preprocessing
def test_preprocessed_data_reads_back_with_megatrons_own_class(corpus):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    tok = load_tokenizer(corpus["tokenizer"])
    for prefix, texts in ((corpus["a"], corpus["docs_a"]), (corpus["b"], corpus["docs_b"]),
                          (corpus["a_title"], [f"doc {k}" for k in range(300)])):
        data = IndexedDataset(prefix)
        assert len(data.document_indices) - 1 == len(texts)
        for k in (0, 1, len(texts) // 2, len(texts) - 1):  # in input order, each followed by the EOD token
            assert data[k].tolist() == tok.tokenize(texts[k]) + [tok.eod], (prefix, k)
        assert data[0].dtype == numpy.uint16  # megatron's choice for a vocabulary < 65500
    result = corpus["a_result"]
    assert result.documents == 300 and result.tokens > 0 and result.tokens_per_sec > 0


def test_data_written_by_megatrons_builder_trains_here(corpus, tmp_path, single_rank_group):
    """A .bin/.idx written with megatron-core's IndexedDatasetBuilder as Megatron-LM's
    preprocess_data.py writes it (document by document, int32) is read by our data module:
    the samples are consecutive windows of the documents' token stream."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    stream = numpy.arange(1, 2001, dtype=numpy.int32) % 299 + 1
    builder = IndexedDatasetBuilder(str(tmp_path / "m.bin"), dtype=numpy.int32)
    for doc in numpy.split(stream, [300, 900, 1400]):
        builder.add_document(torch.from_numpy(doc), [len(doc)])
    builder.finalize(str(tmp_path / "m.idx"))
    data = MegatronDataModule(str(tmp_path / "m"), corpus["tokenizer"], seq_length=16, global_batch_size=4,
                              split="100,0,0", cache_dir=str(tmp_path / "cache"), num_samples=[40, None, None])
    data.setup()
    windows = {tuple(data.datasets["train"][k]["tokens"].tolist() + data.datasets["train"][k]["labels"][-1:].tolist())
               for k in range(len(data.datasets["train"]))}
    starts = {int(numpy.flatnonzero(stream == w[0])[0]) for w in windows}
    assert all(tuple(stream[s:s + 17].tolist()) in windows for s in starts) and len(windows) >= 40


def test_preprocess_command_and_its_refusals(corpus, tmp_path, capsys):
    """The command as a user runs it (a subprocess: progress bar, tokens/s, exit 0), then each bad
    input: exit 2 and one line naming the problem, and no output files left behind."""
    proc = subprocess.run([sys.executable, "-m", "lightning_mhc.cli.preprocess", "--input", str(corpus["root"] / "b"),
                           "--tokenizer", corpus["tokenizer"], "--output-prefix", str(tmp_path / "ok"),
                           "--workers", "2", "--append-eod"], capture_output=True, text=True, timeout=300,
                          env=child_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "120 documents" in proc.stdout and "tokens/s, 2 workers" in proc.stdout and "preprocessing" in proc.stderr
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"text": broken\n')
    (tmp_path / "nokey.jsonl").write_text('{"body": "no text key"}\n')
    (tmp_path / "binary.txt").write_bytes(b"\x00\x01\x02")
    (tmp_path / "empty.jsonl").write_text("\n\n")
    (tmp_path / "not_a_tokenizer.json").write_text('{"hello": 1}')
    cases = [
        (["--input", str(tmp_path / "missing")], "no such file or directory"),
        (["--input", str(tmp_path / "bad.jsonl")], "bad.jsonl:2: not a JSON object"),
        (["--input", str(tmp_path / "nokey.jsonl")], "nokey.jsonl:1: has no text under 'text'"),
        (["--input", str(tmp_path / "binary.txt")], "holds a NUL byte"),
        (["--input", str(tmp_path / "empty.jsonl")], "no documents"),
        (["--input", str(tmp_path / "bad.jsonl"), "--tokenizer", str(tmp_path / "not_a_tokenizer.json")],
         "is not a Hugging Face tokenizer file"),
        (["--input", str(tmp_path / "bad.jsonl"), "--tokenizer", str(tmp_path / "nowhere.json")],
         "no such file or directory"),
    ]
    for args, message in cases:
        capsys.readouterr()
        with pytest.raises(SystemExit) as exit:
            preprocess_main([*args, "--output-prefix", str(tmp_path / "out" / "x"), "--no-progress"])
        err = capsys.readouterr().err.strip().splitlines()
        assert exit.value.code == 2 and len(err) == 1 and message in err[0], (args, err)
        assert err[0].startswith("lightning-mhc-preprocess: ")
    assert not list((tmp_path / "out").glob("*")) if (tmp_path / "out").exists() else True  # nothing half-written


# ------------------------------------------------------------------ blends and the sampler
def test_a_blend_draws_in_its_ratio_over_an_epoch(corpus, tmp_path, single_rank_group):
    """[0.7, A, 0.3, B]: the share of samples from A, told apart by their words, read through the
    training loader over one epoch, is 0.7 within 1%."""
    tok = load_tokenizer(corpus["tokenizer"])
    data = MegatronDataModule([0.7, corpus["a"], 0.3, corpus["b"]], corpus["tokenizer"], seq_length=32,
                              global_batch_size=16, split="100,0,0", cache_dir=str(tmp_path),
                              num_samples=[2000, None, None])
    data.setup()
    counts = collections.Counter()
    for batch in data.train_dataloader():
        for row in batch["tokens"]:
            text = tok.detokenize(row.tolist())
            counts["b" if any(word in text for word in WORDS_B) else "a"] += 1
    share = counts["a"] / sum(counts.values())
    print(f"blend [0.7, A, 0.3, B]: {counts['a']} of {sum(counts.values())} samples from A = {share:.4f}")
    assert sum(counts.values()) >= 2000 and abs(share - 0.7) < 0.01


def test_consumed_samples_sampler_splits_global_batches_and_starts_where_told():
    dataset = list(range(40))
    epochs = {}
    for dp in (1, 2, 4):
        ranks = [ConsumedSamplesSampler(dataset, 8, dp, r, shuffle=True, seed=3) for r in range(dp)]
        for sampler in ranks:
            sampler.set_epoch(1)
        per_rank = [list(s) for s in ranks]
        assert all(len(p) == len(s) == 5 * 8 // dp for p, s in zip(per_rank, ranks))
        # global batch k: the ranks' k-th slices, in rank order
        epochs[dp] = [sum((p[k * 8 // dp:(k + 1) * 8 // dp] for p in per_rank), []) for k in range(5)]
    assert epochs[1] == epochs[2] == epochs[4] and sorted(sum(epochs[1], [])) == dataset
    sampler = ConsumedSamplesSampler(dataset, 8, 2, 1)
    sampler.start_at(24)
    assert list(sampler) == [28, 29, 30, 31, 36, 37, 38, 39] and list(sampler)[:4] == [4, 5, 6, 7]  # once only
    with pytest.raises(ConfigError, match="not a whole number of global batches"):
        sampler.start_at(20)


def test_blends_parse_as_megatrons_data_path():
    assert parse_blend("p") == (["p"], None)
    assert parse_blend(["a", "b"]) == (["a", "b"], None)
    assert parse_blend([0.7, "a", "0.3", "b"]) == (["a", "b"], [0.7, 0.3])
    for bad in ([0.7, "a", "b"], [0.7, "a", 0.3], ["a", 0.3, "b", 0.7], [-1, "a"], []):
        with pytest.raises(ConfigError, match="data.blend"):
            parse_blend(bad)


# ------------------------------------------------------------------ before launch
def test_bad_data_is_refused_before_launch(corpus, tmp_path, monkeypatch, capsys):
    a, tokenizer = corpus["a"], corpus["tokenizer"]
    (tmp_path / "half.bin").write_bytes(b"\0" * 64)
    (tmp_path / "bad.idx").write_bytes(b"not an index")
    (tmp_path / "bad.bin").write_bytes(b"\0" * 64)
    (tmp_path / "words.txt").write_text("not a tokenizer")
    megatron = ["data=megatron", f"data.tokenizer={tokenizer}"]
    cases = [
        (megatron + ["data.blend=[missing]"], f"no indexed dataset at prefix '{tmp_path / 'missing'}'"),
        (megatron + ["data.blend=[half]"], f"'{tmp_path / 'half.bin'}' has no .idx beside it"),
        (megatron + ["data.blend=[bad]"], "is not a Megatron index"),
        (megatron + [f"data.blend=[{a}]", "model.vocab_size=256"],
         "model.vocab_size=256 is smaller than the data's vocabulary (data.source=megatron: its tokenizer"),
        (megatron + [f"data.blend=[0.7,{a},{a}]"], "data.blend=[0.7,"),
        (megatron + [f"data.blend=[{a}]", "data.split=[0,0,0]"], "data.split='0,0,0': give up to three"),
        (megatron + [f"data.blend=[{a}]", "data.split=[100,0,0]"], "leaves the validation split"),
        (["data=megatron", f"data.blend=[{a}]", "data.tokenizer=words.txt"], "is not a Hugging Face tokenizer file"),
        (["data=megatron", f"data.blend=[{a}]"], "data=megatron reads indexed datasets: give data.blend"),
    ]
    for overrides, message in cases:
        status, err = check_before_launch(["trainer=debug", *overrides], tmp_path, monkeypatch, capsys)
        lines = err.strip().splitlines()
        assert status == 2 and len(lines) == 1 and message in lines[0], (overrides, err)
    status, err = check_before_launch(["trainer=debug", *megatron, f"data.blend=[{a}]", "data.split=[90,10,0]"], tmp_path,
                                      monkeypatch, capsys)
    assert status == 0, err


def test_flops_per_token_match_torchs_count_of_the_matrix_products(model_parallel):
    """The MFU formula, term by term, against torch's FlopCounterMode on a forward pass, module by
    module: the projections, the MLP, the hyper-connection mappings, the residual mix (``H_res x``,
    a batched product the layer's bias-dropout-add computes, so counted in the layer outside its
    sub-modules), the logits. Not comparable: attention scores (torch's counter has no rule
    for CPU's scaled-dot-product kernel; the formula counts the causal half), and the element-wise
    terms torch does not count (Sinkhorn; ``H_pre x`` and ``H_post^T F``, broadcast products in
    the reference implementation)."""
    from torch.utils.flop_counter import FlopCounterMode

    from lightning_mhc.model.config import MHCTransformerConfig
    from lightning_mhc.model.flops import forward_flops_terms
    from lightning_mhc.model.gpt import GPTModel

    seq, batch = 32, 2
    for extra in (dict(), dict(activation_func=torch.nn.functional.silu, gated_linear_unit=True, num_query_groups=2),
                  dict(enable_hyper_connections=False, num_residual_streams=1)):
        config = MHCTransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
                                      vocab_size=256, max_sequence_length=seq, hidden_dropout=0.0,
                                      attention_dropout=0.0, mhc_implementation="reference", **extra)
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            GPTModel(config)(torch.zeros(batch, seq, dtype=torch.long))
        counts = counter.get_flop_counts()

        def of(name: str, op: str) -> float:
            return sum(v for o, v in counts[name].items() if str(o) == op)

        def torch_count(suffix: str, op: str = "aten.mm") -> float:
            return sum(of(name, op) for name in counts if name.endswith(suffix) and name.count(".") == 4) / (batch * seq)

        def in_layers_outside_submodules(op: str) -> float:
            layers = [name for name in counts if name.count(".") == 3 and ".layers." in name]
            return sum(of(layer, op) - sum(of(child, op) for child in counts
                                           if child.startswith(layer + ".") and child.count(".") == 4)
                       for layer in layers) / (batch * seq)

        terms = forward_flops_terms(config, seq)
        measured = dict(attention_projections=torch_count(".self_attention"), mlp=torch_count(".mlp"),
                        mhc_mappings=torch_count("_hyper_connection"),
                        mhc_residual_mix=in_layers_outside_submodules("aten.bmm"),
                        logits=sum(counts["GPTModel.output_layer"].values()) / (batch * seq))
        print(f"{extra or 'gelu'}: formula {[terms[k] for k in measured]}, torch {list(measured.values())}")
        assert {k: terms[k] for k in measured} == measured, extra
        assert (terms["mhc_mappings"] > 0) == config.enable_hyper_connections


def _compose(*overrides: str):
    from hydra import compose, initialize_config_dir

    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=preflight.CONF_DIR, version_base="1.3"):
            return preflight.to_train_config(compose(config_name="config", overrides=list(overrides)))
    finally:
        GlobalHydra.instance().clear()


# ------------------------------------------------------------------ resume through Trainer.fit
@pytest.mark.slow
def test_resume_on_indexed_data_reads_no_earlier_sample_on_the_same_and_another_layout(corpus, tmp_path):
    """``Trainer.fit`` on a MegatronDataModule (a BPE of 300 tokens: the model pads to 384, so TP
    rank 1 holds padding columns): DP 2 for 6 steps with a checkpoint at step 3 (mid-epoch), then
    resumed from it on DP 2 and on TP 2. The resumed losses match the uninterrupted run within
    1e-6 (bit-exact on the same layout; TP 2's reductions add in another order) and no rank reads a
    sample of the first 3 global batches: the sampler starts at consumed_samples = 24."""
    out = tmp_path / "result.json"
    run_on_ranks("fit_megatron.py", 2, "--prefix", str(corpus["a"]), "--tokenizer", str(corpus["tokenizer"]),
                 "--vocab", "300", "--work", str(tmp_path), "--out", str(out), timeout=600)  # its Trainer's 2 devices
    result = json.loads(out.read_text())
    full = {int(k): v for k, v in result["full"]["losses"].items()}
    assert sorted(full) == [1, 2, 3, 4, 5, 6] and result["full"]["dataset_length"] > 6 * 8  # step 3 is mid-epoch
    # uninterrupted: each DP rank read its 4 samples of every global batch, from the first
    assert sorted(sum(result["full"]["reads"], [])) == list(range(48))
    for case, tolerance in (("dp2", 1e-6), ("tp2", 1e-6)):
        resumed = {int(k): v for k, v in result[case]["losses"].items()}
        assert sorted(resumed) == [4, 5, 6], case
        diff = max(abs(resumed[s] - full[s]) for s in resumed)
        print(f"resumed on {case}: max |loss - uninterrupted| = {diff:.3g}; reads {sorted(set(sum(result[case]['reads'], [])))}")
        assert diff <= tolerance, (case, resumed, full)
        reads = sum(result[case]["reads"], [])
        assert min(reads) >= 24 and sorted(set(reads)) == list(range(24, 48)), (case, reads)
