"""flashtile.engine's model, loader, config and tokenizer against transformers.

Checkpoints are random-initialised transformers models of each supported architecture
saved with save_pretrained (one sharded); logits must agree in fp32 on CPU to 1e-4 for a
packed prefill of prompts of different lengths, a chunked prefill mixed with decodes, and
decode steps over the paged pool.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from flashtile.engine.block_manager import BlockManager
from flashtile.engine.config import EngineConfig, ModelConfig
from flashtile.engine.model import rope_inv_freq
from flashtile.engine.runner import ModelRunner
from flashtile.engine.sampling_params import SamplingParams
from flashtile.engine.sequence import Sequence
from flashtile.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from tests.engine_utils import CASES, VOCAB, engine_cpu, hf_config, make_checkpoint, \
    make_tokenizer
from tests.fp8_utils import fp8_interpreter

__all__ = ["engine_cpu", "fp8_interpreter"]  # fixtures, imported to apply here
TOL = dict(atol=1e-4, rtol=1e-4)


def _runner(path, **kw):
    kw = {**dict(dtype="float32", device="cpu", max_model_len=64, page_size=16,
                 kv_cache_memory=2**20), **kw}
    return ModelRunner(EngineConfig(model=str(path), **kw))


def _logits(runner, scheduled, all_rows=False):
    inputs = runner.prepare(scheduled)
    hidden = runner.forward(inputs)  # every row
    return runner.model.compute_logits(hidden if all_rows else runner._sampled(hidden, inputs))


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers(tmp_path, case):
    _check_logits(tmp_path, case)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="Triton kernels on CPU tensors need TRITON_INTERPRET=1")
@pytest.mark.parametrize("case,elementwise", [
    ("mistral-window", "reference"), ("mistral-window", "kernels"),
    ("qwen3-sharded", "reference"), ("qwen3-sharded", "kernels"),
    ("qwen3-sharded", "gemv-fused"), ("qwen2-bias", "gemv-fused")])
def test_logits_match_transformers_triton_kernels(tmp_path, case, elementwise,
                                                  monkeypatch):
    """The same steps through flashtile's Triton kernels (interpreted): paged decode over
    the pool with its scratch block, varlen prefill, windows, head_dim 24; "kernels":
    the CUDA path's RMSNorm (Qwen3's per-head q/k norm over the fused projection's
    views too), SiLU-and-multiply and rotary + cache-write kernels as well; "gemv-fused":
    and the linears of the decode steps (up to 16 tokens here; 2 in the engine) as the
    GEMV with the norms and SiLU-and-multiply inside it (engine/gemv.py; Qwen3's tied LM
    head, Qwen2's q/k/v bias)."""
    import flashtile.engine.gemv as gemv_module
    import flashtile.engine.model as model
    from tests.test_engine_gemv import gemv_steps
    monkeypatch.setenv("FLASHTILE_BACKEND", "triton")
    if elementwise != "reference":
        monkeypatch.setattr(model, "use_kernels", lambda x: True)
    if elementwise == "gemv-fused":
        prologues = gemv_steps(monkeypatch, fuse=True, on_cpu=True)
        monkeypatch.setattr(gemv_module, "MAX_M", 16)
        monkeypatch.setattr(gemv_module, "_max_tokens", 16)
    _check_logits(tmp_path, case)
    if elementwise == "gemv-fused":
        assert {gemv_module.NORM, gemv_module.ADD_NORM, gemv_module.SILU} <= set(prologues)


@torch.no_grad()
def _check_logits(tmp_path, case):
    hf = make_checkpoint(tmp_path, case)
    if case == "qwen3-sharded":
        assert (tmp_path / "model.safetensors.index.json").is_file()
    runner = _runner(tmp_path)
    bm = BlockManager(runner.num_blocks, runner.page_size, enable_prefix_caching=False)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (13, 1, 21, 21)]
    seqs = [Sequence(p, SamplingParams(temperature=0)) for p in prompts]
    for s in seqs:
        assert bm.allocate(s)

    def ref(tokens):
        return hf(torch.tensor([tokens])).logits[0]

    # Packed prefill; the last prompt only gets its first 10 tokens (a chunk).
    chunks = [13, 1, 21, 10]
    got = _logits(runner, list(zip(seqs, chunks)), all_rows=True)
    want = torch.cat([ref(p)[:n] for p, n in zip(prompts, chunks)])
    torch.testing.assert_close(got, want, **TOL)
    for s, n in zip(seqs, chunks):
        s.num_computed_tokens += n

    # Three steps: decodes of the first three, mixed with the rest of the chunked prompt.
    for step in range(3):
        for s in seqs[:3]:
            s.append_token(int(ref(s.token_ids)[-1].argmax()))
        scheduled = [(s, 1) for s in seqs[:3]]
        if step == 0:
            scheduled.append((seqs[3], 11))
        for s, n in scheduled:
            assert bm.ensure_slots(s, n)
        got = _logits(runner, scheduled, all_rows=True)
        want = torch.cat([ref(s.token_ids)[-n:] for s, n in scheduled])
        torch.testing.assert_close(got, want, **TOL)
        for s, n in scheduled:
            s.num_computed_tokens += n
    # A pure decode step goes through flash_attn_with_kvcache and logits of sampled rows.
    for s in seqs:
        s.append_token(7)
        assert bm.ensure_slots(s, 1)
    got = _logits(runner, [(s, 1) for s in seqs])
    want = torch.stack([ref(s.token_ids)[-1] for s in seqs])
    torch.testing.assert_close(got, want, **TOL)
    # execute: the same step, sampled greedily, read back synchronously.
    sampled, tokens, _ = runner.execute([(s, 1) for s in seqs])
    assert sampled == seqs and tokens == want.argmax(-1).tolist()


@torch.no_grad()
def _fp8_pool_steps(path, calculate):
    """Logits of every row of three steps over an FP8 pool (kv_cache_dtype="fp8", fp16
    model): a packed prefill with a chunk, the chunk's rest beside decodes, a decode;
    calculate: calculate_kv_scales (set by the first step)."""
    runner = _runner(path, dtype="float16", kv_cache_dtype="fp8",
                     calculate_kv_scales=calculate)
    bm = BlockManager(runner.num_blocks, runner.page_size, enable_prefix_caching=False)
    g = torch.Generator().manual_seed(2)
    seqs = [Sequence(torch.randint(0, VOCAB, (n,), generator=g).tolist(),
                     SamplingParams(temperature=0)) for n in (13, 1, 21)]
    steps = [[(seqs[0], 13), (seqs[1], 1), (seqs[2], 9)],
             [(seqs[0], 1), (seqs[1], 1), (seqs[2], 12)],
             [(s, 1) for s in seqs]]
    out = []
    for step in steps:
        for s, n in step:
            if s.num_computed_tokens + n > len(s.token_ids):
                s.append_token(5)
            assert bm.ensure_slots(s, n) if s.block_table else bm.allocate(s)
        out.append(_logits(runner, step, all_rows=True))
        for s, n in step:
            s.num_computed_tokens += n
    return torch.cat(out).float()


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="Triton kernels on CPU tensors need TRITON_INTERPRET=1")
@pytest.mark.parametrize("calculate", [False, True], ids=["scale1", "calculated"])
def test_fp8_pool_through_the_kernels_equals_the_pytorch_path(tmp_path, monkeypatch,
                                                              fp8_interpreter, calculate):
    """kv_cache_dtype="fp8" through flashtile's Triton kernels (interpreted, with correct
    FP8 conversions): the rotary + cache-write kernel quantising into the pool, the
    varlen forward over the FP8 pool under fp16 queries, the paged decode over it, with
    the pool's scales of 1.0 or calculated from the first step. Their logits equal the
    PyTorch path's (attention.to_pool, dequantised pools in fp32) to
    fp16's rounding."""
    import flashtile.engine.model as model
    make_checkpoint(tmp_path, "llama")
    want = _fp8_pool_steps(tmp_path, calculate)
    monkeypatch.setenv("FLASHTILE_BACKEND", "triton")
    monkeypatch.setattr(model, "use_kernels", lambda x: True)
    got = _fp8_pool_steps(tmp_path, calculate)
    # The paths' fp16 k differ by an ulp here and there (0.003 of logits apart over an
    # fp16 pool, measured), and where such a k sits at an FP8 rounding boundary the pool
    # holds values an FP8 step apart: 0.017 here, logits up to 2.6. A misread pool is off
    # by the logits' size.
    torch.testing.assert_close(got, want, atol=4e-2, rtol=0)


@torch.no_grad()
def test_dummy_weights_from_config_alone(tmp_path):
    hf_config("qwen2-bias").save_pretrained(tmp_path)  # config.json, no weights
    a = _runner(tmp_path, load_format="dummy", seed=3).model
    b = _runner(tmp_path, load_format="dummy", seed=3).model
    c = _runner(tmp_path, load_format="dummy", seed=4).model
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), name
        if name.endswith("norm.weight"):
            assert torch.equal(pa, torch.ones_like(pa)), name
        elif name.endswith(".bias"):
            assert not pa.any(), name
        else:
            assert not torch.equal(pa, pc), name
            assert 0.01 < pa.std() < 0.03, name  # initializer_range 0.02


def test_rope_spellings_agree_with_transformers():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    base = dict(architectures=["LlamaForCausalLM"], vocab_size=10, hidden_size=64,
                intermediate_size=8, num_hidden_layers=1, num_attention_heads=4)
    llama3 = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                  original_max_position_embeddings=64)
    for kind, params in (("llama3", llama3), ("linear", dict(factor=4.0))):
        new = ModelConfig.from_dict(dict(base, rope_parameters=dict(
            params, rope_type=kind, rope_theta=5e5)))
        old = ModelConfig.from_dict(dict(base, rope_theta=5e5,
                                         rope_scaling=dict(params, type=kind)))
        assert new == old
        cfg = hf_config("llama", rope_scaling=dict(params, rope_type=kind), rope_theta=5e5,
                        hidden_size=64, num_attention_heads=4)
        want, _ = ROPE_INIT_FUNCTIONS[kind](cfg, "cpu")
        torch.testing.assert_close(rope_inv_freq(new), want, atol=0, rtol=0)
    with pytest.raises(ValueError, match="rope type.*'yarn'"):
        ModelConfig.from_dict(dict(base, rope_scaling=dict(type="yarn", factor=2.0)))


def test_eos_ids_from_generation_config(tmp_path):
    hf_config("llama").save_pretrained(tmp_path)
    assert ModelConfig.from_pretrained(str(tmp_path)).eos_token_ids == (2,)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 5]}))
    assert ModelConfig.from_pretrained(str(tmp_path)).eos_token_ids == (2, 5)


# ---- tokenizer -----------------------------------------------------------------------

CONVERSATIONS = [
    [{"role": "user", "content": "Hello world, how are you?"}],
    [{"role": "system", "content": "Be brief. "}, {"role": "user", "content": "héllo 🙂"},
     {"role": "assistant", "content": "Paris.", "tool_calls": None},
     {"role": "user", "content": "The capital of France?"}],
]


@pytest.fixture
def tokenizers_pair(tmp_path):
    from transformers import AutoTokenizer
    make_tokenizer(tmp_path)
    return Tokenizer(str(tmp_path)), AutoTokenizer.from_pretrained(str(tmp_path))


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(tokenizers_pair, add_generation_prompt):
    ours, hf = tokenizers_pair
    for conv in CONVERSATIONS:
        kw = dict(add_generation_prompt=add_generation_prompt)
        assert ours.apply_chat_template(conv, tokenize=False, **kw) == \
            hf.apply_chat_template(conv, tokenize=False, **kw)
        assert ours.apply_chat_template(conv, **kw) == \
            hf.apply_chat_template(conv, tokenize=True, **kw)["input_ids"]


def test_continue_final_message_matches_transformers(tokenizers_pair):
    """continue_final_message: the text ends inside the last message, as transformers
    cuts it (the test template trims content, so the cut also drops the space before
    its tag); with add_generation_prompt, or a last message without text, a ValueError
    naming it."""
    ours, hf = tokenizers_pair
    for tail in ("The capital is ", "Paris", " spaced  "):
        conv = [*CONVERSATIONS[1], {"role": "assistant", "content": tail}]
        kw = dict(add_generation_prompt=False, continue_final_message=True)
        assert ours.apply_chat_template(conv, tokenize=False, **kw) == \
            hf.apply_chat_template(conv, tokenize=False, **kw)
        assert ours.apply_chat_template(conv, **kw) == \
            hf.apply_chat_template(conv, tokenize=True, **kw)["input_ids"]
    conv = [{"role": "user", "content": "Hi"}]
    with pytest.raises(ValueError, match="continue_final_message: expected "
                       "add_generation_prompt=False beside it"):
        ours.apply_chat_template(conv, continue_final_message=True)
    with pytest.raises(ValueError, match="continue_final_message: expected a last message "
                       "with text content, got None"):
        ours.apply_chat_template([{"role": "assistant", "content": None}],
                                 add_generation_prompt=False, continue_final_message=True)


def test_chat_template_raise_exception_and_jinja_file(tokenizers_pair, tmp_path):
    import jinja2
    ours, hf = tokenizers_pair
    bad = [{"role": "tool", "content": "x"}]
    for tok in (ours, hf):
        with pytest.raises(jinja2.TemplateError, match="unknown role tool"):
            tok.apply_chat_template(bad, tokenize=False)
    # transformers 5 saves the template as chat_template.jinja beside the config.
    saved = tmp_path / "saved"
    hf.save_pretrained(str(saved))
    assert (saved / "chat_template.jinja").is_file()
    assert Tokenizer(str(saved)).apply_chat_template(CONVERSATIONS[1]) == \
        hf.apply_chat_template(CONVERSATIONS[1], tokenize=True,
                               add_generation_prompt=True)["input_ids"]


def test_encode_decode_match_transformers(tokenizers_pair):
    ours, hf = tokenizers_pair
    text = "The capital of France is Paris. 日本語 🙂"
    ids = ours.encode(text)
    assert ids == hf(text)["input_ids"] and ids[0] == 1  # bos added by the post-processor
    assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    assert ours.decode(ids, skip_special_tokens=False).startswith("<s>")
    assert ours.eos_token_id == hf.eos_token_id == 2


def test_incremental_detokenizer_streams_whole_characters(tokenizers_pair):
    ours, hf = tokenizers_pair
    prompt = ours.encode("Hello")
    ids = ours.encode("héllo wörld 日本語 🙂🙂 The capital of France</s>",
                      add_special_tokens=False)
    detok = IncrementalDetokenizer(ours, prompt)
    pieces = [detok.add([t]) for t in ids]
    assert not any("\ufffd" in p for p in pieces)
    assert "".join(pieces) == detok.text == hf.decode(ids, skip_special_tokens=True)
    assert sum(p == "" for p in pieces) >= 3  # multi-byte characters waited for


def test_incremental_detokenizer_final_emits_an_incomplete_character(tokenizers_pair):
    """Regression: a completion that ends inside a multi-byte character (max_tokens cut
    it) lost those bytes from its text; the last add (final=True) emits them as decode
    does (U+FFFD), so the text is transformers' decode of the tokens."""
    ours, hf = tokenizers_pair
    ids = ours.encode("héllo €", add_special_tokens=False)[:-1]  # € is 3 byte tokens
    assert ours.decode(ids).endswith("\ufffd")
    detok = IncrementalDetokenizer(ours, ours.encode("Hello"))
    pieces = [detok.add([t], final=i == len(ids) - 1) for i, t in enumerate(ids)]
    assert "".join(pieces) == detok.text == hf.decode(ids, skip_special_tokens=True)
