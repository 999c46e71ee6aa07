"""flashtile.integrations.transformers: attn_implementation="flashtile" in Hugging Face
transformers models gives what "sdpa" gives ("eager" for Gemma 2, whose softcap SDPA
refuses): logits, gradients, greedy generate tokens, training losses.

Tiny random-initialised models from transformers' own classes, float32, tolerances at a
few float32 roundings (the attention is exact on both sides; the rest of the model is
the same code). On CPU the cases run flashtile's torch backend; the ``triton`` fixture's
cases run the Triton kernels (interpreted under TRITON_INTERPRET=1, as make test does).
Each case also checks which flashtile function served it (``calls``), so a path that
silently fell back elsewhere fails.
"""

import collections
import copy
import inspect
import json
import os
import sys
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

import flashtile  # noqa: E402
import flashtile.integrations.transformers as hf  # noqa: E402
import flashtile.integrations.transformers.attention as hf_attention  # noqa: E402
from packaging import version  # noqa: E402

TF = version.parse(transformers.__version__)
# From 4.53 transformers builds masks through AttentionMaskInterface; before, its models
# hand every implementation but their own a 4-D mask, which flashtile reads as given.
MASK_INTERFACE = TF >= version.parse("4.53")
VOCAB, LENGTH = 101, 11  # a prime length: every tile boundary falls mid-sequence
NEW = 7  # generated tokens: prompt and new tokens pass the sliding windows (5)
COMMON = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, max_position_embeddings=64)


def _llama():
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **COMMON, num_key_value_heads=2, head_dim=12))


def _mistral():  # every layer slides over 5 keys
    return transformers.MistralForCausalLM(transformers.MistralConfig(
        **COMMON, num_key_value_heads=2, head_dim=12, sliding_window=5))


def _gemma2():  # alternating sliding and full layers, softcap 5 (it bites at these scales)
    return transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
        **COMMON, num_key_value_heads=2, head_dim=12, sliding_window=5,
        attn_logit_softcapping=5.0, query_pre_attn_scalar=10))


def _gemma3():  # its own sliding/full layer pattern, no softcap
    return transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
        **COMMON, num_key_value_heads=2, head_dim=12, sliding_window=5,
        layer_types=["sliding_attention", "full_attention"]))


def _qwen2():  # MQA; layer 1 slides (use_sliding_window from max_window_layers on)
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        **COMMON, num_key_value_heads=1, use_sliding_window=True, sliding_window=5,
        max_window_layers=1))


def _bert():  # bidirectional encoder; dropout off (another RNG stream than sdpa's)
    return transformers.BertForMaskedLM(transformers.BertConfig(
        **COMMON, attention_probs_dropout_prob=0.0, hidden_dropout_prob=0.0))


# family: (model factory, reference attn_implementation). BERT's layers call the
# attention interface from transformers 5.0 on (before, they ignore the name).
FAMILIES = {"llama": (_llama, "sdpa"), "mistral": (_mistral, "sdpa"),
            "gemma2": (_gemma2, "eager"), "gemma3": (_gemma3, "sdpa"),
            "qwen2": (_qwen2, "sdpa"), "bert": (_bert, "sdpa")}
ENCODERS = [pytest.param("bert", marks=pytest.mark.skipif(
    TF < version.parse("5.0"), reason="BERT uses the attention interface from 5.0"))]
DECODERS = ["llama", "mistral", "gemma2", "gemma3", "qwen2"]


def _use(model, impl):
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(impl)
    else:  # transformers < 4.54
        model.config._attn_implementation = impl
    return model


def _model(family, device):
    torch.manual_seed(0)
    make, ref = FAMILIES[family]
    return make().to(device), ref


def _batch(pad, device, batch=3, length=LENGTH):
    ids = torch.randint(0, VOCAB, (batch, length))
    mask = torch.ones(batch, length, dtype=torch.long)
    if pad == "left":
        mask[0, :4] = 0
        mask[1, :1] = 0
    elif pad == "right":
        mask[0, 7:] = 0
        mask[2, length - 1:] = 0
    return ids.to(device), mask.to(device)


def _assert_served(calls, want):
    """The flashtile functions that served the attention calls: ``want``, or with
    transformers < 4.53 the 4-D-mask path for every one of them."""
    if not MASK_INTERFACE:
        want = {"masked": sum(want.values())}
    assert calls == want, dict(calls)


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()
            if p.grad is not None}


def _assert_grads_close(got, want):
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=2e-5, atol=2e-6,
                                   msg=lambda m: f"{name}: {m}")


@pytest.fixture(autouse=True)
def _torch_backend_on_cpu(monkeypatch, on_gpu):
    if not on_gpu:
        monkeypatch.setenv("FLASHTILE_BACKEND", "torch")


@pytest.fixture
def triton(monkeypatch, on_gpu):
    """The Triton kernels: on the GPU, or on CPU through the interpreter."""
    if not on_gpu and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton on CPU needs TRITON_INTERPRET=1 (set by make test)")
    monkeypatch.setenv("FLASHTILE_BACKEND", "triton")


def _counting(seen, name, fn):
    """fn, counting its calls in seen[name]."""
    def wrapper(*args, **kwargs):
        seen[name] += 1
        return fn(*args, **kwargs)
    return wrapper


@pytest.fixture
def calls(monkeypatch):
    """Counts of the flashtile functions the integration called."""
    seen = collections.Counter()

    def counted(name, fn):
        return _counting(seen, name, fn)

    for name in ("flash_attn_func", "flash_attn_varlen_func"):
        monkeypatch.setattr(flashtile, name, counted(name, getattr(flashtile, name)))
    monkeypatch.setattr(hf_attention, "_masked", counted("masked", hf_attention._masked))
    # The decode kernel: flash_attn_with_kvcache, or for a decode step's later layers the
    # same launch without its validation (_decode's fast path).
    monkeypatch.setattr(hf_attention, "_decode", counted("decode", hf_attention._decode))
    return seen


def _forward_backward(model, impl, ids, mask, **kwargs):
    """Logits and parameter gradients of a cross-entropy over the real tokens."""
    _use(model, impl)
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids, attention_mask=mask, **kwargs).logits
    real = mask.bool() if mask is not None else torch.ones_like(ids, dtype=torch.bool)
    labels = torch.roll(ids, -1, dims=1)
    torch.nn.functional.cross_entropy(logits[real], labels[real]).backward()
    return logits.detach(), _grads(model)


def _check_forward_backward(family, pad, device, calls, mask=None):
    """flashtile's logits and gradients against the reference's, over _batch(pad) or
    the given mask (then the caller checks what served the calls)."""
    model, ref = _model(family, device)
    ids, batch_mask = _batch(pad, device)
    given, mask = mask, batch_mask if mask is None else mask
    want_logits, want_grads = _forward_backward(model, ref, ids, mask)
    calls.clear()
    logits, grads = _forward_backward(model, "flashtile", ids, mask)
    real = mask.bool()
    torch.testing.assert_close(logits[real], want_logits[real], rtol=1e-5, atol=1e-5)
    _assert_grads_close(grads, want_grads)
    if given is not None:
        return
    # No padding: the dense kernel; padding: unpadded to varlen, never a mask tensor.
    served = "flash_attn_func" if pad == "none" else "flash_attn_varlen_func"
    _assert_served(calls, {served: COMMON["num_hidden_layers"]})


@pytest.mark.parametrize("pad", ["none", "left", "right"])
@pytest.mark.parametrize("family", DECODERS + ENCODERS)
def test_logits_and_grads_equal_reference(family, pad, device, calls):
    _check_forward_backward(family, pad, device, calls)


@pytest.mark.parametrize("family", ["mistral", "gemma2", "qwen2"])
def test_mask_with_a_hole_under_sliding_windows(family, device, calls):
    """A row with padding between its tokens: unpadding would close the gap and bring
    keys into a sliding window that the reference's positions keep out, so the layers
    that slide take the masked kernel (one host read per forward decides); logits and
    gradients equal the reference's."""
    mask = torch.ones(3, LENGTH, dtype=torch.long, device=device)
    mask[1, 4:6] = 0  # within 5 keys of the row's later queries
    _check_forward_backward(family, "none", device, calls, mask)
    assert calls["masked"] >= 1, dict(calls)
    assert calls["masked"] + calls["flash_attn_varlen_func"] == \
        COMMON["num_hidden_layers"], dict(calls)


@pytest.mark.parametrize("family", ["llama", "gemma2"] + ENCODERS)
def test_logits_and_grads_triton(family, device, calls, triton):
    _check_forward_backward(family, "right" if family == "bert" else "left", device, calls)


@pytest.mark.skipif(not MASK_INTERFACE, reason="transformers < 4.53 detects packed "
                    "sequences for flash_attention_2 only")
@pytest.mark.parametrize("family", DECODERS)
def test_packed_position_ids(family, device, calls):
    """Sequences packed in one row, position_ids restarting at 0: varlen over cu_seqlens,
    each sequence attending only to itself (as if run alone)."""
    model, ref = _model(family, device)
    ids = torch.randint(0, VOCAB, (1, 12), device=device)
    lengths = [5, 6, 1]
    pos = torch.cat([torch.arange(n) for n in lengths])[None].to(device)
    kw = dict(position_ids=pos, use_cache=False)
    want_logits, want_grads = _forward_backward(model, ref, ids, None, **kw)
    calls.clear()
    logits, grads = _forward_backward(model, "flashtile", ids, None, **kw)
    torch.testing.assert_close(logits, want_logits, rtol=1e-5, atol=1e-5)
    _assert_grads_close(grads, want_grads)
    _assert_served(calls, {"flash_attn_varlen_func": COMMON["num_hidden_layers"]})
    with torch.no_grad():
        alone = [model(input_ids=part, use_cache=False).logits
                 for part in ids.split(lengths, dim=1)]
    torch.testing.assert_close(logits, torch.cat(alone, 1), rtol=1e-5, atol=1e-5)


def _generate(model, impl, ids, mask, **kwargs):
    _use(model, impl)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW,
                             do_sample=False, pad_token_id=0, **kwargs)
    return out[:, ids.shape[1]:]


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("family", DECODERS)
def test_generate_left_padded(family, cache, device, calls):
    """Greedy tokens past the sliding windows: prefill unpadded to varlen, decode
    steps in the decode kernel with the left padding as cache_leftpad; a static
    cache's full layers (their mask narrower than the buffer, so build_mask reads
    nothing about it) keep reading the padding mask in the masked kernel."""
    if family.startswith("gemma") and cache == "static" and TF < version.parse("4.53"):
        pytest.skip("transformers < 4.53: its own Gemma 2/3 reference fails this case")
    model, ref = _model(family, device)
    model.eval()
    ids, mask = _batch("left", device)
    kw = {} if cache == "dynamic" else dict(cache_implementation="static")
    want = _generate(model, ref, ids, mask, **kw)
    calls.clear()
    got = _generate(model, "flashtile", ids, mask, **kw)
    assert torch.equal(got, want), (got, want)
    layers = COMMON["num_hidden_layers"]
    if not MASK_INTERFACE:
        assert calls == {"masked": NEW * layers}, dict(calls)
        return
    assert calls["flash_attn_varlen_func"] == layers, dict(calls)
    if cache == "dynamic":  # pure left padding: the decode kernel, cache_leftpad
        assert calls == {"flash_attn_varlen_func": layers, "decode": (NEW - 1) * layers}
        return
    assert calls["flash_attn_varlen_func"] == layers, dict(calls)
    assert calls["masked"] + calls["decode"] == (NEW - 1) * layers, dict(calls)


@pytest.mark.skipif(not MASK_INTERFACE, reason="transformers < 4.53 hands flashtile 4-D "
                    "masks")
@pytest.mark.parametrize("kernels", ["default", "triton"])
@pytest.mark.parametrize("pad", ["left", "right", "hole"])
@pytest.mark.parametrize("family", ["llama", "mistral", "gemma2"])
def test_padded_decode_step(family, pad, kernels, device, calls, request):
    """One decode step of a padded batch (after its prefill): padding only at the left
    takes the split-KV decode kernel with cache_leftpad in every layer; right padding
    or a hole (inside the sliding windows' last 5 keys too) keeps the masked kernel.
    The logits equal the reference's."""
    if kernels == "triton":
        request.getfixturevalue("triton")
    model, ref = _model(family, device)
    model.eval()
    ids, mask = _batch("none" if pad == "hole" else pad, device)
    if pad == "hole":
        mask[1, 8:10] = 0
    step = torch.randint(0, VOCAB, (3, 1), device=device)
    step_mask = torch.cat([mask, mask.new_ones(3, 1)], 1)
    with torch.no_grad():  # both steps over the reference's prefill: the step alone
        prefill = _use(model, ref)(input_ids=ids, attention_mask=mask,
                                   use_cache=True).past_key_values
    out = {}
    for impl in (ref, "flashtile"):
        calls.clear()
        with torch.no_grad():
            out[impl] = _use(model, impl)(input_ids=step, attention_mask=step_mask,
                                          past_key_values=copy.deepcopy(prefill),
                                          use_cache=True).logits
    torch.testing.assert_close(out["flashtile"], out[ref], rtol=1e-5, atol=1e-5)
    served = "decode" if pad == "left" else "masked"
    assert calls == {served: COMMON["num_hidden_layers"]}, dict(calls)


def test_generate_unpadded_decodes_with_kvcache(device, calls):
    """No padding: the prefill is flash_attn_func and each decode step the split-KV
    decode kernel (flash_attn_with_kvcache) over the cache, its sliding window too."""
    model, ref = _model("mistral", device)
    model.eval()
    ids, mask = _batch("none", device)
    want = _generate(model, ref, ids, mask)
    calls.clear()
    got = _generate(model, "flashtile", ids, mask)
    assert torch.equal(got, want), (got, want)
    layers = COMMON["num_hidden_layers"]
    _assert_served(calls, {"flash_attn_func": layers, "decode": (NEW - 1) * layers})


@pytest.mark.parametrize("family,pad", [("mistral", "none"), ("mistral", "left"),
                                        ("gemma2", "none"), ("gemma2", "left")])
def test_generate_triton(family, pad, device, calls, triton):
    """The decode kernel with a window (Mistral) and softcap (Gemma 2), with the left
    padding as cache_leftpad (Gemma 2's full layers), the prefill kernel under a
    padding mask."""
    model, ref = _model(family, device)
    model.eval()
    ids, mask = _batch(pad, device)
    want = _generate(model, ref, ids, mask)
    got = _generate(model, "flashtile", ids, mask)
    assert torch.equal(got, want), (got, want)


def test_decode_fast_path_equals_kvcache(monkeypatch, device, triton):
    """A decode step's later layers (same signature as the first) launch the decode
    kernel without flash_attn_with_kvcache's validation, on the first call's
    cache_seqlens: the same output, bit for bit; a new signature (another scaling, or
    without plans the next step's longer cache) goes through flash_attn_with_kvcache
    again."""
    validated = collections.Counter()
    original = flashtile.flash_attn_with_kvcache
    monkeypatch.setattr(flashtile, "flash_attn_with_kvcache",
                        _counting(validated, "calls", original))
    monkeypatch.setattr(hf_attention, "_last_decode", [None])
    torch.manual_seed(0)
    q = torch.randn(3, 4, 1, 16, device=device)
    for keys, scale in ((9, None), (9, None), (9, 0.3), (10, 0.3), (10, 0.3)):
        k, v = (torch.randn(3, 2, keys, 16, device=device) for _ in range(2))
        with torch.no_grad():
            out, _ = hf.attention_forward(_module(), q, k, v, None, scaling=scale)
        want = original(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                        cache_seqlens=keys, causal=True, softmax_scale=scale)
        assert torch.equal(out, want)
        torch.testing.assert_close(out, _sdpa_ref(q, k, v, True, scale), rtol=1e-5,
                                   atol=1e-6)
    # (9, None), (9, 0.3), (10, 0.3); where launch plans are made (CUDA), (10, 0.3)
    # is (9, 0.3)'s cache one key longer: its plans relocated, no validation again.
    from flashtile.ops import _launch
    assert validated["calls"] == (2 if _launch.ready(q) else 3)


# The tensor methods that read a value on the host: on a GPU each is a device sync.
_HOST_READS = ("item", "tolist", "nonzero", "__bool__", "__int__", "__float__",
               "__index__")


def _host_reads_per_step(layers, monkeypatch):
    """Host reads of a left-padded batch's prefill and of one decode step through
    flashtile's integration, with the kernels replaced by zeros (they do not sync on
    the GPU, and the CPU backends' own reads are not the integration's)."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **{**COMMON, "num_hidden_layers": layers}, num_key_value_heads=2, head_dim=12))
    _use(model.eval(), "flashtile")
    ids, mask = _batch("left", "cpu")

    def zeros(q, k, v, *args, **kwargs):
        return q.new_zeros(*q.shape[:-1], v.shape[-1])

    for name in ("flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache"):
        monkeypatch.setattr(flashtile, name, zeros)
    monkeypatch.setattr(hf_attention, "_attention",
                        lambda q, k, v, **kw: (zeros(q, k, v), None))
    reads = collections.Counter()
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, use_cache=True)
        with monkeypatch.context() as m:
            for name in _HOST_READS:
                m.setattr(torch.Tensor, name,
                          _counting(reads, name, getattr(torch.Tensor, name)))
            m.setattr(torch, "nonzero", _counting(reads, "nonzero", torch.nonzero))
            model(input_ids=ids, attention_mask=mask, use_cache=True)
            prefill = dict(reads)
            reads.clear()
            step_mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], 1)
            model(input_ids=ids[:, -1:], attention_mask=step_mask,
                  past_key_values=out.past_key_values, use_cache=True)
    return prefill, dict(reads)


@pytest.mark.skipif(not MASK_INTERFACE, reason="transformers < 4.53 hands flashtile 4-D "
                    "masks (its own reads, not the integration's)")
def test_decode_compiles_without_a_graph_break(device, monkeypatch):
    """Under torch.compile(fullgraph=True) a decode step is flash_attn_with_kvcache's
    custom op, not the eager memo (a stream query, and a tensor kept in a global that
    the compiled graph would write)."""
    monkeypatch.setattr(hf_attention, "_last_decode", [None])
    q = torch.randn(2, 1, 4, 16, device=device)
    k, v = (torch.randn(2, 9, 2, 16, device=device) for _ in "kv")
    step = torch.compile(lambda q, k, v: hf_attention._decode(q, k, v, True, (-1, -1),
                                                               None, 0.0), fullgraph=True)
    want = flashtile.flash_attn_with_kvcache(q, k, v, cache_seqlens=9, causal=True)
    torch.testing.assert_close(step(q, k, v), want, rtol=1e-6, atol=1e-6)
    assert hf_attention._last_decode == [None]


def test_padded_batch_host_reads_do_not_grow_with_layers(monkeypatch):
    """Regression (issue 16): the prefill of a padded batch unpadded the mask with
    nonzero (a device sync) in every layer; now once per forward, reused by the other
    layers. A decode step reads nothing per layer either: build_mask's one read per
    forward answers both whether the mask is all ones and whether its padding is all
    at the left (the decode kernel's cache_leftpad)."""
    two, five = (_host_reads_per_step(n, monkeypatch) for n in (2, 5))
    assert two == five, (two, five)
    assert two[0].get("nonzero", 0) <= 1, two
    assert sum(two[1].values()) <= 1, two


@pytest.mark.gpu
def test_padded_generate_syncs_do_not_grow_with_layers():
    """On the GPU: a left-padded generate syncs as often with 2 layers as with 4 (the
    syncs left are transformers' and flashtile's once-per-forward reads)."""
    def syncs(layers):
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            **{**COMMON, "num_hidden_layers": layers}, num_key_value_heads=2,
            head_dim=12)).cuda().eval()
        ids, mask = _batch("left", "cuda")
        _generate(model, "flashtile", ids, mask, min_new_tokens=NEW)  # compiles first
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                # Every row runs all NEW steps (a row that sampled EOS changes nothing
                # here, but a batch that all did would stop early).
                _generate(model, "flashtile", ids, mask, min_new_tokens=NEW)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        # Only the syncs: not the warning that sync debug mode is a prototype, which
        # torch gives once per process ("... detect all synchronizing operations"), so
        # in the first of the two counts (22 against 21 in session 11).
        return sum("called a synchronizing" in str(w.message) for w in seen)

    assert syncs(2) == syncs(4)


@pytest.mark.parametrize("family", ["llama"] + ENCODERS)
def test_training_steps(family, device):
    """Three AdamW steps on right-padded batches: the same losses and weights."""
    losses, weights, lr = {}, {}, 1e-2
    for impl in ("sdpa", "flashtile"):
        model, _ = _model(family, device)
        _use(model, impl).train()
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
        torch.manual_seed(1)
        losses[impl] = []
        for _ in range(3):
            ids, mask = _batch("right", device)
            labels = ids.masked_fill(mask == 0, -100)
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses[impl].append(loss.item())
        weights[impl] = torch.cat([p.detach().flatten() for p in model.parameters()])
    assert losses["flashtile"] == pytest.approx(losses["sdpa"], rel=1e-5)
    # Adam divides each gradient by its running RMS: where a gradient is ~0, float32
    # rounding moves that weight by up to lr per step, so the bound is a fraction of lr.
    torch.testing.assert_close(weights["flashtile"], weights["sdpa"], rtol=0, atol=1e-2 * lr)


@pytest.mark.parametrize("family,pad", [("llama", "none"), ("mistral", "left")])
def test_compiled_training_step(family, pad, device):
    """torch.compile(fullgraph=True) of forward and backward: no graph break (mask
    creation included), the eager reference's logits and gradients."""
    model, ref = _model(family, device)
    ids, mask = _batch(pad, device)
    want_logits, want_grads = _forward_backward(model, ref, ids, mask, use_cache=False)
    _use(model, "flashtile")
    torch._dynamo.reset()
    step = torch.compile(lambda i, m: model(input_ids=i, attention_mask=m,
                                            use_cache=False).logits,
                         backend="aot_eager", fullgraph=True)
    model.zero_grad(set_to_none=True)
    logits = step(ids, mask)
    real = mask.bool()
    torch.nn.functional.cross_entropy(logits[real], torch.roll(ids, -1, 1)[real]).backward()
    torch.testing.assert_close(logits.detach()[real], want_logits[real], rtol=1e-5,
                               atol=1e-5)
    _assert_grads_close(_grads(model), want_grads)


def test_compiled_generate_static_cache(device):
    """generate's own compilation of the decode step (static cache)."""
    config_cls = getattr(transformers, "CompileConfig", None)
    if config_cls is None or not hasattr(config_cls, "_compile_all_devices"):
        pytest.skip("this transformers cannot compile generate on every device")
    model, ref = _model("llama", device)
    model.eval()
    ids, mask = _batch("left", device)
    want = _generate(model, ref, ids, mask, cache_implementation="static")
    compile_config = config_cls(backend="aot_eager", mode=None)
    compile_config._compile_all_devices = True
    torch._dynamo.reset()
    got = _generate(model, "flashtile", ids, mask, cache_implementation="static",
                    compile_config=compile_config)
    assert torch.equal(got, want), (got, want)


def _generate_batch(model, impl, prompts, device):
    """generate_batch's greedy tokens (a paged cache) with the implementation impl, in
    the order of prompts."""
    _use(model, impl)
    # A small paged cache: left to size itself, transformers 5.25 fills most free memory
    # (on CPU 33 s of zeroing). Newer versions take the sizes in a ContinuousBatchingConfig
    # of their own, older ones read them from the GenerationConfig.
    sizes = dict(num_blocks=16, max_batch_tokens=64)
    config = transformers.GenerationConfig(max_new_tokens=NEW, do_sample=False,
                                           eos_token_id=-1, pad_token_id=0)
    kwargs = {}
    cb_config = getattr(transformers, "ContinuousBatchingConfig", None)
    if cb_config is not None and set(sizes) <= set(inspect.signature(cb_config).parameters) \
            and "continuous_batching_config" in inspect.signature(model.generate_batch).parameters:
        kwargs["continuous_batching_config"] = cb_config(**sizes)
    else:
        for name, value in sizes.items():
            setattr(config, name, value)
        if device.type == "cpu":  # 5.0 turns CUDA graphs on for flash-like implementations
            config.use_cuda_graph = False
    out = model.generate_batch(prompts, generation_config=config, **kwargs)
    # By prompt: 5.0 numbers the requests in an order of its own.
    got = {tuple(o.prompt_ids): o.generated_tokens for o in out.values()}
    return [got.get(tuple(p)) for p in prompts]


@pytest.mark.skipif(TF < version.parse("5.0"), reason="generate_batch's paged API of 5.x")
@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_generate_batch(family, device, calls, monkeypatch):
    """Continuous batching (a paged cache): the greedy tokens of generate, per request."""
    # transformers 5.0 checks the paged cache's size against the device's total memory,
    # which it reports as None on CPU (later versions report the host's): give it 16 GiB.
    import transformers.generation.continuous_batching.cache as cb_cache
    breakdown = getattr(cb_cache, "get_device_and_memory_breakdown", None)
    if breakdown is not None and breakdown()[1] is None:
        monkeypatch.setattr(cb_cache, "get_device_and_memory_breakdown",
                            lambda: (torch.device("cpu"), 1 << 34, 0, 0))
    model, ref = _model(family, device)
    model.eval()
    prompts = [torch.randint(0, VOCAB, (n,)).tolist() for n in (5, 9, 3)]
    if family == "gemma2" and TF < version.parse("5.17"):
        # Continuous batching before 5.17 (seen in 5.0-5.14) gives Gemma 2 other tokens
        # than generate does, with its own paged eager attention too: flashtile's paged
        # path must give what transformers' gives.
        want = _generate_batch(model, ref, prompts, device)
    else:
        want = [_generate(model, ref, torch.tensor([p], device=device), None)[0].tolist()
                for p in prompts]
    calls.clear()
    assert _generate_batch(model, "flashtile", prompts, device) == want
    assert set(calls) == {"flash_attn_varlen_func"}, dict(calls)


@pytest.mark.skipif(TF < version.parse("4.57"), reason="BART calls the attention "
                    "interface in 4.57 (not yet in 4.51)")
@pytest.mark.parametrize("pad", ["left", "right"])
def test_encoder_decoder_cross_attention(pad, device, calls):
    """BART: a padded encoder, the decoder's cross-attention over its real tokens
    (every decoder query sees them: no causality across the two), greedy generate.
    Its decode steps' cross-attention takes the decode kernel (cache_leftpad, not
    causal) when the encoder's padding is at the left, the masked kernel else."""
    torch.manual_seed(0)
    model = transformers.BartForConditionalGeneration(transformers.BartConfig(
        vocab_size=VOCAB, d_model=48, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
        decoder_ffn_dim=64, max_position_embeddings=64, dropout=0.0,
        attention_dropout=0.0, activation_dropout=0.0)).to(device).eval()
    ids, mask = _batch(pad, device)
    decoder_ids = torch.randint(0, VOCAB, (3, 6), device=device)
    out = {}
    for impl in ("sdpa", "flashtile"):
        _use(model, impl)
        calls.clear()
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=mask,
                           decoder_input_ids=decoder_ids).logits
        out[impl] = logits, _generate(model, impl, ids, mask, num_beams=1)
    torch.testing.assert_close(out["flashtile"][0], out["sdpa"][0], rtol=1e-5, atol=1e-5)
    assert torch.equal(out["flashtile"][1], out["sdpa"][1])
    if TF >= version.parse("5.0"):  # 4.57's BART builds 4-D masks itself
        cross = "decode" if pad == "left" else "masked"
        assert calls["flash_attn_varlen_func"] > 0 and calls[cross] > 0, dict(calls)
        if pad == "left":
            assert "masked" not in calls, dict(calls)


def test_given_cu_seqlens(device, calls):
    """cu_seq_lens_q/k and max_length_q/k from the caller (DataCollatorWithFlattening's
    return_flash_attn_kwargs=True) are used as given."""
    model, _ = _model("llama", device)
    model.eval()
    _use(model, "flashtile")
    lengths = [4, 7]
    ids = torch.randint(0, VOCAB, (1, sum(lengths)), device=device)
    cu = torch.tensor([0, 4, 11], dtype=torch.int32, device=device)
    pos = torch.cat([torch.arange(n) for n in lengths])[None].to(device)
    with torch.no_grad():
        got = model(input_ids=ids, position_ids=pos, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                    max_length_q=7, max_length_k=7, use_cache=False).logits
        alone = torch.cat([model(input_ids=p, use_cache=False).logits
                           for p in ids.split(lengths, dim=1)], 1)
    torch.testing.assert_close(got, alone, rtol=1e-5, atol=1e-5)
    assert calls["flash_attn_varlen_func"] == COMMON["num_hidden_layers"]


def _module(is_causal=True):
    return torch.nn.Module() if is_causal is None else type(
        "Attn", (torch.nn.Module,), {"is_causal": is_causal})()


def _sdpa_ref(q, k, v, causal, scale=None):
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    sq, sk = q.shape[2], k.shape[2]
    keep = (torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(sk - sq)
            if causal else None)
    return torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=keep, scale=scale).transpose(1, 2)


def test_padded_generate_batch_rows(device):
    """generate_batch pads q and k for its CUDA graphs past the last sequence, its
    cu_seq_lens plateauing there: the real rows are unaffected."""
    torch.manual_seed(0)
    q = torch.randn(1, 4, 9, 16, device=device)  # 5 + 3 real tokens, 1 padding row
    k, v = (torch.randn(1, 2, 12, 16, device=device) for _ in range(2))  # 5 + 6, 1 pad
    cu_q = torch.tensor([0, 5, 8, 8], device=device)
    cu_k = torch.tensor([0, 5, 11, 11], device=device)
    out, _ = hf.attention_forward(_module(), q, k, v, None, cu_seq_lens_q=cu_q,
                                  cu_seq_lens_k=cu_k, max_length_q=5, max_length_k=6)
    want = torch.cat([_sdpa_ref(q[:, :, :5], k[:, :, :5], v[:, :, :5], True),
                      _sdpa_ref(q[:, :, 5:8], k[:, :, 5:11], v[:, :, 5:11], True)], 1)
    torch.testing.assert_close(out[:, :8], want, rtol=1e-5, atol=1e-6)


def test_smaller_value_head_dim(device):
    """MLA-style value head_dim below the query's: zero-padded, then cropped."""
    torch.manual_seed(0)
    q, k = torch.randn(2, 4, 7, 24, device=device), torch.randn(2, 2, 7, 24, device=device)
    v = torch.randn(2, 2, 7, 16, device=device)
    out, weights = hf.attention_forward(_module(), q, k, v, None, scaling=0.3)
    assert weights is None and out.shape == (2, 7, 4, 16)
    torch.testing.assert_close(out, _sdpa_ref(q, k, v, True, scale=0.3), rtol=1e-5,
                               atol=1e-6)


def test_user_4d_mask(device, calls):
    """A 4-D mask the caller builds is read as given, tile by tile."""
    model, _ = _model("llama", device)
    model.eval()
    ids, _ = _batch("none", device, batch=2)
    keep = torch.rand(2, 1, LENGTH, LENGTH, device=device) > 0.3
    keep |= torch.eye(LENGTH, dtype=torch.bool, device=device)
    mask = torch.zeros(keep.shape, device=device).masked_fill(~keep, torch.finfo().min)
    out = {}
    for impl in ("sdpa", "flashtile"):
        _use(model, impl)
        with torch.no_grad():
            out[impl] = model(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(out["flashtile"], out["sdpa"], rtol=1e-5, atol=1e-5)
    _assert_served(calls, {"masked": COMMON["num_hidden_layers"]})


@pytest.fixture
def masking():
    if TF < version.parse("4.53"):
        pytest.skip("AttentionMaskInterface came with transformers 4.53")
    from transformers import masking_utils
    return masking_utils


def _positions(masking, q_length, q_offset=0):
    import inspect
    if "q_length" in inspect.signature(masking.sdpa_mask).parameters:
        return dict(q_length=q_length, q_offset=q_offset)
    return dict(cache_position=torch.arange(q_offset, q_offset + q_length))


def test_mask_forms(masking):
    """build_mask: None without padding, the 2-D mask with it, cu_seqlens for packed
    sequences, the buffer's filled part for a static cache without a mask."""
    causal = masking.causal_mask_function
    pos = _positions(masking, 6)
    full = torch.ones(2, 6, dtype=torch.bool)
    assert hf.build_mask(batch_size=2, kv_length=6, mask_function=causal,
                         attention_mask=full, **pos) is None
    padded = full.clone()
    padded[0, :2] = False
    assert torch.equal(hf.build_mask(batch_size=2, kv_length=6, mask_function=causal,
                                     attention_mask=padded, **pos), padded)
    # a sliding layer's keys are the last kv_length positions of the mask
    assert torch.equal(hf.build_mask(batch_size=2, kv_length=5, mask_function=causal,
                                     attention_mask=padded, **pos), padded[:, -5:])
    segments = torch.tensor([[0, 0, 1, 1, 1, 2], [0, 0, 0, 0, 1, 1]])
    packed = masking.and_masks(causal, masking.packed_sequence_mask_function(segments))
    cu = hf.build_mask(batch_size=2, kv_length=6, mask_function=packed, **pos)
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 2, 5, 6, 10, 12]
    static = hf.build_mask(batch_size=2, kv_length=16, mask_function=causal,
                           **_positions(masking, 1, q_offset=torch.tensor(6)))
    assert torch.equal(static, torch.ones(2, 7, dtype=torch.bool))


def test_left_padding_marked_in_decode_steps(masking):
    """build_mask marks a decode step's purely left-padded mask with cache_leftpad (the
    column of each row's first token); not a prefill's, not a mask with a hole or
    right padding, not once the mask is modified in place."""
    from flashtile.integrations.transformers.masks import marked_leftpad
    causal = masking.causal_mask_function
    mask = torch.ones(3, 7, dtype=torch.bool)
    mask[0, :4], mask[2, :1] = False, False

    def built(m, q_length):
        return hf.build_mask(batch_size=3, kv_length=7, mask_function=causal,
                             attention_mask=m, **_positions(masking, q_length, 7 - q_length))

    got = built(mask, 1)
    assert torch.equal(got, mask) and marked_leftpad(got).tolist() == [4, 0, 1]
    assert marked_leftpad(built(mask, 7)) is None
    for hole in ((1, 3), (1, 6)):  # inside a row, at the query's own column
        other = mask.clone()
        other[hole] = False
        assert marked_leftpad(built(other, 1)) is None
    got[1, 2] = False
    assert marked_leftpad(got) is None


def test_unknown_mask_pattern_is_materialised(masking):
    """A pattern outside causal/bidirectional/window/packed (here: every query also sees
    key 0) becomes transformers' own 4-D mask."""
    def sink(batch_idx, head_idx, q_idx, kv_idx):
        return kv_idx == 0

    fn = masking.or_masks(masking.sliding_window_causal_mask_function(2), sink)
    pos = _positions(masking, 6)
    got = hf.build_mask(batch_size=2, kv_length=6, mask_function=fn, **pos)
    want = masking.sdpa_mask(batch_size=2, kv_length=6, mask_function=fn,
                             allow_is_causal_skip=False, **pos)
    assert got.dim() == 4 and torch.equal(got, want)


def test_from_pretrained(tmp_path, device):
    """attn_implementation="flashtile" at load time; set_attn_implementation after."""
    model, _ = _model("llama", device)
    model.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, attn_implementation="flashtile").to(device).eval()
    assert loaded.config._attn_implementation == "flashtile"
    ids, mask = _batch("left", device)
    with torch.no_grad():
        got = loaded(input_ids=ids, attention_mask=mask).logits
        want = _use(model.eval(), "sdpa")(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(got[mask.bool()], want[mask.bool()], rtol=1e-5, atol=1e-5)
    assert hf.register() == "flashtile"  # idempotent


@pytest.mark.parametrize("pad", ["none", "left"])
def test_attention_dropout_in_training(pad, device, calls):
    """A model with attention_dropout in training mode: forward and backward run, the
    same seed gives the same logits and gradients, and the logits differ from eval
    mode's (transformers passes dropout 0.0 there), which still equals sdpa's. The
    masks are flashtile's own draw, so training mode is not compared with sdpa."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **COMMON, num_key_value_heads=2, head_dim=12, attention_dropout=0.3)).to(device)
    ids, mask = _batch(pad, device)
    real = mask.bool()

    def train_step(seed):
        torch.manual_seed(seed)
        return _forward_backward(model.train(), "flashtile", ids, mask)

    (first, first_grads), (again, again_grads) = train_step(1), train_step(1)
    other, _ = train_step(2)
    assert torch.equal(first, again) and first_grads.keys() == again_grads.keys()
    assert all(torch.equal(first_grads[n], again_grads[n]) for n in first_grads)
    assert all(torch.isfinite(g).all() for g in first_grads.values())
    assert not torch.equal(first[real], other[real])
    served = "flash_attn_func" if pad == "none" else "flash_attn_varlen_func"
    _assert_served(calls, {served: 3 * COMMON["num_hidden_layers"]})
    model.eval()
    with torch.no_grad():
        want = _use(model, "sdpa")(input_ids=ids, attention_mask=mask).logits
        got = _use(model, "flashtile")(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(got[real], want[real], rtol=1e-5, atol=1e-5)
    assert (got[real] - first[real]).abs().max() > 1e-3


def _dropout_reference(q, k, v, keep, p, mask=None):
    """float64 attention of q (b, h, sq, d) over k, v (b, h, sk, d), with a bool mask
    (True = attend), dropping the probabilities where keep (b, h, sq, sk) is False:
    out (b, sq, h, d)."""
    q, k, v = (x.double() for x in (q, k, v))
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return (torch.softmax(scores, -1) * keep / (1 - p) @ v).transpose(1, 2)


def _keep(p, seed, b, h, sq, sk, device):
    """The keep mask a dense call that draws its seed first after torch.manual_seed(seed)
    applies, from flash_attn_func's debug path (dropped entries come back negated)."""
    torch.manual_seed(seed)
    q, k = torch.zeros(b, sq, h, 8, device=device), torch.zeros(b, sk, h, 8, device=device)
    return ~torch.signbit(flashtile.flash_attn_func(q, k, k, dropout_p=p,
                                                    return_attn_probs=True)[2])


@pytest.mark.parametrize("kernels", ["default", "triton"])
@pytest.mark.parametrize("path", ["dense", "masked", "decode"])
def test_dropout_paths_equal_reference(path, kernels, device, calls, request):
    """dropout on the dense and the 4-D mask paths equals the float64 reference with the
    mask the same seed draws; a decode step (sq = 1, no gradient) with dropout leaves
    the decode kernel (it has none) for flash_attn_func."""
    if kernels == "triton":
        request.getfixturevalue("triton")
    p, seed = 0.4, 3
    torch.manual_seed(0)
    sq = 1 if path == "decode" else 6
    q, k, v = torch.randn(2, 2, sq, 16, device=device), *torch.randn(
        2, 2, 2, 9, 16, device=device)
    mask = None
    if path == "masked":
        mask = torch.rand(2, 1, sq, 9, device=device) > 0.3
        mask[..., 0] = True
    torch.manual_seed(seed)
    with torch.no_grad():
        out, _ = hf.attention_forward(_module(False), q, k, v, mask, dropout=p)
    served = "masked" if path == "masked" else "flash_attn_func"
    assert calls == {served: 1}, dict(calls)
    keep = _keep(p, seed, 2, 2, sq, 9, device)
    want = _dropout_reference(q, k, v, keep, p, mask)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-6)


def test_bad_dropout_is_refused():
    q = torch.randn(1, 2, 3, 8)
    with pytest.raises(ValueError, match=r"dropout: expected a probability in \[0, 1\)"):
        hf.attention_forward(_module(), q, q, q, None, dropout=1.0)


@pytest.mark.parametrize("name", ["s_aux", "position_bias", "head_mask", "block_table"])
def test_unsupported_arguments_are_refused(name):
    q = torch.randn(1, 2, 3, 8)
    with pytest.raises(NotImplementedError, match=name):
        hf.attention_forward(_module(), q, q, q, None, **{name: torch.zeros(2)})


def test_mask_wider_than_keys_is_refused():
    q = torch.randn(1, 2, 3, 8)
    with pytest.raises(ValueError, match=r"attention_mask.shape\[1\]: expected at most"):
        hf.attention_forward(_module(), q, q, q, torch.ones(1, 4, dtype=torch.bool))


def test_old_or_missing_transformers(monkeypatch):
    # sys.modules' entry, not the module imported above: transformers replaces its
    # lazy module object there (save_pretrained does, for one).
    monkeypatch.setattr(sys.modules["transformers"], "__version__", "4.50.0")
    with pytest.raises(ImportError, match=r"transformers >= 4\.51 .* got 4\.50\.0"):
        hf.register()
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ImportError, match=r"pip install 'flashtile\[hf\]'"):
        hf.register()


@pytest.mark.skipif(TF < version.parse("4.56"), reason="flashtile bench hf needs 4.56")
def test_bench_hf_smoke(tmp_path):
    from flashtile.cli import main
    out = tmp_path / "hf.json"
    assert main(["bench", "hf", "--device", "cpu", "--batches", "2", "--prompt", "8",
                 "--new", "2", "--train-tokens", "8", "--reps", "1",
                 "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {(r["task"], r["impl"]) for r in rows} == {
        (task, impl) for task in ("generate", "train step")
        for impl in ("flashtile", "sdpa", "eager")}
    assert all(r["tokens_s"] > 0 for r in rows)


@pytest.mark.skipif(TF < version.parse("4.56"), reason="flashtile bench hf needs 4.56")
def test_bench_hf_padded_smoke(tmp_path, calls):
    """--pad: left-padded generate prompts (each row up to prompt/4 tokens shorter),
    whose decode steps take the decode kernel; the default stays unpadded."""
    from flashtile.bench.hf import _parser
    from flashtile.cli import main
    assert not _parser().parse_args([]).pad
    out = tmp_path / "hf.json"
    assert main(["bench", "hf", "--device", "cpu", "--batches", "4", "--prompt", "16",
                 "--new", "2", "--train-tokens", "8", "--reps", "1", "--pad",
                 "--impls", "flashtile", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    generate = [r for r in rows if r["task"] == "generate"]
    assert len(generate) == 1 and 0 < generate[0]["padding"] <= 4 * 4, generate
    assert calls["decode"] > 0 and "masked" not in calls, dict(calls)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_bench_hf_needs_cuda(capsys):
    from flashtile.bench.hf import main
    assert main([]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "needs a CUDA device" in err


@pytest.mark.skipif(TF < version.parse("4.56"), reason="flashtile bench hf needs 4.56")
def test_bench_hf_profile_smoke(tmp_path, capsys):
    """--profile N: one more training step and generate per implementation under
    torch.profiler, their N most expensive kernels (host time on the CPU) printed and
    kept in the JSON, generate's with the host time inside the attention function;
    the timed rows and their ratios are unchanged by them. --profile -1 is refused."""
    from flashtile.cli import main
    out = tmp_path / "hf.json"
    assert main(["bench", "hf", "--device", "cpu", "--batches", "1", "--prompt", "8",
                 "--new", "1", "--train-tokens", "8", "--reps", "1", "--profile", "3",
                 "--impls", "flashtile", "sdpa", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    profiles = {r["impl"]: r for r in rows if r["task"] == "train step profile"}
    steps = {r["impl"]: r["ms"] for r in rows if r["task"] == "train step"}
    assert set(profiles) == {"flashtile", "sdpa"}
    for impl, profile in profiles.items():
        top = profile["kernels"]
        assert 1 <= len(top) <= 3 and all(ms > 0 and calls >= 1 for _, ms, calls in top)
        assert [ms for _, ms, _ in top] == sorted((ms for _, ms, _ in top), reverse=True)
        # Every kernel's time, the top ones included; the timed step's ms beside it.
        assert profile["kernel_ms"] >= sum(ms for _, ms, _ in top) * (1 - 1e-9)
        assert profile["step_ms"] == steps[impl]
    assert all(r["vs_sdpa"] > 0 for r in rows if "tokens_s" in r)
    # One generate per implementation, with the host time inside the attention
    # function: one call a layer a forward (the tiny model has 2 layers, 1 new token).
    generated = {r["impl"]: r for r in rows if r["task"] == "generate profile"}
    timed = {r["impl"]: r["ms"] for r in rows if r["task"] == "generate"}
    assert set(generated) == {"flashtile", "sdpa"}
    for impl, profile in generated.items():
        assert 1 <= len(profile["kernels"]) <= 3 and profile["ms"] == timed[impl]
        assert profile["attention_calls"] == 2 and profile["attention_host_us"] > 0
    printed = capsys.readouterr().out
    assert "flashtile train step: kernels " in printed and "top kernels (ms, calls)" in printed
    assert "inside the attention function (2 calls)" in printed
    assert main(["bench", "hf", "--device", "cpu", "--profile", "-1"]) == 2
    assert "--profile must be >= 0, got -1" in capsys.readouterr().err
