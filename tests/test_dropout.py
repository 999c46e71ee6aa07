"""Attention dropout (issue 17 item 4): flash-attn 2's training semantics.

The mask is read back through the debug path (return_attn_probs: dropped entries are
negated), and the output and gradients must equal a float64 reference that applies that
mask, on the torch backend and in the Triton kernels (interpreter on CPU; split and
fused backward). The reference's mask is computed in PyTorch
(flashtile.reference.Dropout), so the kernels agreeing with it also checks that
forward and backward regenerate one mask whatever their tiles.
"""

import math

import pytest
import torch

import flashtile
from flashtile import reference
from tests.utils import assert_close_rule, max_err, reference_pair

BACKENDS = ["torch", "triton", "triton-fused"]


def _keep(probs):
    """The keep mask the call applied (its return_attn_probs sign code)."""
    return ~torch.signbit(probs)


def _inputs(b, sq, sk, h, hkv, d, dtype, device):
    return [torch.randn(shape, dtype=dtype, device=device, requires_grad=True)
            for shape in ((b, sq, h, d), (b, sk, hkv, d), (b, sk, hkv, d))]


def _check_against_reference(out, lse, grads, q, k, v, dout, keep, p, **kw):
    """out, lse and grads equal the float64 reference applying ``keep``, by the accuracy
    rule (2x PyTorch's own error at the dtype, plus a floor)."""
    (ref, ref_lse, ref_g), (same, _, same_g) = reference_pair(
        q, k, v, dout, dropout_p=p, dropout_mask=keep, **kw)
    assert_close_rule("out", out, ref, same)
    fin = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), fin)
    assert max_err(lse[fin], ref_lse[fin]) < 1e-5  # fp32 lse of unchanged scores
    for name, g, r, s in zip(("dq", "dk", "dv"), grads, ref_g, same_g):
        assert_close_rule(name, g, r, s)


CASES = {  # (batch, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim, options)
    "gqa-causal-odd": (2, 37, 45, 4, 2, 24, dict(causal=True)),
    "mha-full": (1, 64, 64, 2, 2, 16, dict()),
    "mqa-window-sq>sk": (1, 50, 19, 3, 1, 8, dict(window_size=(6, 0))),
}
DTYPES = [pytest.param(torch.float32, id="float32"),
          pytest.param(torch.float16, id="float16"),
          pytest.param(torch.bfloat16, marks=pytest.mark.gpu, id="bfloat16")]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
def test_dense_equals_reference_with_the_same_mask(case, dtype, backend, device):
    b, sq, sk, h, hkv, d, opts = CASES[case]
    if dtype == torch.float16 and backend == "torch" and case != "mha-full":
        pytest.skip("one fp16 case on the torch backend is enough")
    p = 0.3
    q, k, v = _inputs(b, sq, sk, h, hkv, d, dtype, device)
    dout = torch.randn(b, sq, h, d, dtype=dtype, device=device)
    out, lse, probs = flashtile.flash_attn_func(q, k, v, dropout_p=p,
                                                return_attn_probs=True, **opts)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    keep = _keep(probs)
    assert 0 < keep.sum() < keep.numel()
    _check_against_reference(out, lse, grads, q, k, v, dout, keep, p, **opts)


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
def test_varlen_equals_reference_per_sequence(backend, device):
    """Packed sequences (one empty, odd lengths, seqlen_q != seqlen_k): each sequence's
    out and gradients equal the reference with its corner of the returned mask."""
    lens_q, lens_k, h, hkv, d, p = [5, 0, 33, 17], [9, 4, 30, 17], 4, 2, 16, 0.25
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32,
                               device=device) for n in (lens_q, lens_k))
    q = torch.randn(sum(lens_q), h, d, device=device, requires_grad=True)
    k, v = (torch.randn(sum(lens_k), hkv, d, device=device, requires_grad=True)
            for _ in range(2))
    dout = torch.randn_like(q)
    out, lse, probs = flashtile.flash_attn_varlen_func(
        q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), dropout_p=p, causal=True,
        return_attn_probs=True)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    for i, (nq, nk) in enumerate(zip(lens_q, lens_k)):
        qs, ks = cu_q[i].item(), cu_k[i].item()
        if nq == 0:
            continue
        rows, keys = slice(qs, qs + nq), slice(ks, ks + nk)
        _check_against_reference(
            out[None, rows], lse[None, :, rows],
            (dq[None, rows], dk[None, keys], dv[None, keys]),
            q[None, rows], k[None, keys], v[None, keys], dout[None, rows],
            _keep(probs[i:i + 1, :, :nq, :nk]), p, causal=True)


@pytest.mark.parametrize("backend", ["torch", "triton"], indirect=True)
def test_keep_rate(backend, device):
    """The kernel's own keep rate, read from its output: with q = 0 every visible key
    has probability 1 / seqlen_k and v = 1, so out * (1 - p) * seqlen_k counts the kept
    keys of a row. Over n = 16384 entries the rate has standard deviation
    sqrt(p (1 - p) / n) <= 0.0040; the bound, 0.025, is over 6 of them (a false
    failure about once in 10**9 runs). The counts also equal the debug path's mask."""
    b, s, h, d = 1, 128, 2, 16
    n = b * h * s * s
    for p in (0.1, 0.5, 0.8):
        q = torch.zeros(b, s, h, d, device=device)
        k = torch.randn(b, s, h, d, device=device)
        v = torch.ones(b, s, h, d, device=device)
        out, _, probs = flashtile.flash_attn_func(q, k, v, dropout_p=p,
                                                  return_attn_probs=True)
        kept = out[..., 0].double() * (1 - p) * s                     # (b, s, h)
        assert max_err(kept, kept.round()) < 1e-3
        assert torch.equal(kept.round().long(), _keep(probs).sum(-1).transpose(1, 2))
        rate = kept.sum().item() / n
        assert abs(rate - (1 - p)) < 0.025, (p, rate)
        assert 6 * math.sqrt(p * (1 - p) / n) < 0.025


def _mask_read_from_output(b, s, h, p, seed, device):
    """(philox, keep): the mask a forward call applied, read from its output (not from
    the debug path): with q = 0 every key has probability 1 / s, and v = the identity
    (head_dim s) puts key j's kept share in column j, so out * s * (1 - p) is the
    (b, s, h, s) keep mask. philox is the key the call drew under torch.manual_seed."""
    q = torch.zeros(b, s, h, s, device=device)
    k = torch.randn(b, s, h, s, device=device)
    v = torch.eye(s, device=device)[None, :, None, :].expand(b, s, h, s).contiguous()
    torch.manual_seed(seed)
    philox = flashtile.interface._philox(q, p)
    torch.manual_seed(seed)
    out = flashtile.flash_attn_func(q, k, v, dropout_p=p)
    kept = out.double() * (1 - p) * s
    assert max_err(kept, kept.round()) < 1e-3
    return philox, kept.round().bool().transpose(1, 2)                   # (b, h, s, s)


@pytest.mark.parametrize("backend", ["torch", "triton"], indirect=True)
def test_words_of_one_philox_call_are_independent(backend, device):
    """One Philox call serves queries {i, i + 8} x keys {j, j + 8}: its four words (and
    neighbouring calls, heads and batch entries) must be kept independently, each pair
    at rate (1 - p)**2. Over n pairs the rate has standard deviation sqrt(q (1 - q) / n),
    q = (1 - p)**2; the bound is 6 of them (a false failure about once in 10**9)."""
    b, s, h, p = 2, 64, 2, 0.5
    _, keep = _mask_read_from_output(b, s, h, p, seed=7, device=device)
    keep = keep.double()
    lo = torch.arange(s) % 16 < 8                       # bit 3 clear: a group's first
    pairs = {
        "word 0/1 (keys j, j + 8)": keep[..., lo] * keep[..., ~lo],
        "word 0/2 (queries i, i + 8)": keep[..., lo, :] * keep[..., ~lo, :],
        "word 0/3, 1/2 (diagonal)": keep[..., lo, :][..., lo] * keep[..., ~lo, :][..., ~lo],
        "neighbouring calls (keys j, j + 1)": keep[..., :-1] * keep[..., 1:],
        "neighbouring calls (queries i, i + 1)": keep[..., :-1, :] * keep[..., 1:, :],
        "heads": keep[:, 0] * keep[:, 1],
        "batch entries": keep[0] * keep[1],
    }
    q = (1 - p) ** 2
    for name, both in pairs.items():
        bound = 6 * math.sqrt(q * (1 - q) / both.numel())
        assert abs(both.mean().item() - q) < bound, (name, both.mean().item(), bound)
    all_four = (keep[..., lo, :][..., lo] * keep[..., lo, :][..., ~lo]
                * keep[..., ~lo, :][..., lo] * keep[..., ~lo, :][..., ~lo])
    q4 = (1 - p) ** 4
    assert abs(all_four.mean().item() - q4) < 6 * math.sqrt(q4 * (1 - q4) / all_four.numel())


@pytest.mark.parametrize("backend", ["torch", "triton"], indirect=True)
def test_keep_threshold_is_exact(backend, device):
    """A 32-bit word r is kept where r >= ceil(p * 2**32): the keep probability is 1 - p
    to within 2**-32 (no 8-bit quantised p, which biases it by up to 0.4%). At a word r
    below 2**23 of the call's own mask, p = r / 2**32 (exact in fp32) keeps it and the
    next fp32 p, whose p * 2**32 lies strictly between r and r + 1, drops it: the
    kernel rounds the threshold up, not to nearest or down."""
    b, s, h, seed = 1, 64, 2, 11
    q0 = torch.zeros(b, s, h, s, device=device)
    torch.manual_seed(seed)
    philox = flashtile.interface._philox(q0, 0.5)
    words = reference.Dropout.dense(philox, 0.5, b, h, s).words(torch.arange(s),
                                                                 torch.arange(s))
    small = (words < 2**23).nonzero()
    assert len(small) > 0  # P(r < 2**23) = 2**-9 for each of 8192 words
    bb, hh, i, j = small[0].tolist()
    r = words[bb, hh, i, j].item()
    p_keep = r / 2**32
    p_drop = torch.nextafter(torch.tensor(p_keep, dtype=torch.float32),
                             torch.tensor(1.0)).item()
    assert 0 < p_drop * 2**32 - r < 1
    for p, kept in ((p_keep, True), (p_drop, False)):
        _, keep = _mask_read_from_output(b, s, h, p, seed, device)
        assert keep[bb, hh, i, j].item() is kept, (p, r)
        assert torch.equal(keep, reference.Dropout.dense(philox, p, b, h, s).keep(
            torch.arange(s), torch.arange(s)).to(keep.device))


@pytest.mark.parametrize("backend", ["torch", "triton"], indirect=True)
def test_reproducible_under_manual_seed(backend, device):
    """The same seed gives the same mask, bit for bit, forward and backward; another
    seed, or the next call, another mask."""
    q, k, v = _inputs(1, 24, 24, 2, 2, 16, torch.float32, device)

    def run(seed):
        if seed is not None:
            torch.manual_seed(seed)
        out = flashtile.flash_attn_func(q, k, v, dropout_p=0.4, causal=True)
        return (out, *torch.autograd.grad(out.sum(), (q, k, v)))

    first, again, other, following = run(1), run(1), run(2), run(None)
    assert all(torch.equal(x, y) for x, y in zip(first, again))
    assert not torch.equal(first[0], other[0])
    assert not torch.equal(again[0], following[0])


@pytest.mark.parametrize("backend", ["torch", "triton"], indirect=True)
def test_packed_and_sdpa_forms_draw_the_same_mask(backend, device):
    """qkvpacked and the SDPA drop-in pass dropout_p through: with the same seed they
    give flash_attn_func's result (seqlen_q == seqlen_k: both causal alignments agree)."""
    qkv = torch.randn(2, 19, 3, 2, 8, device=device)
    q, k, v = qkv.unbind(2)
    torch.manual_seed(3)
    expected = flashtile.flash_attn_func(q, k, v, dropout_p=0.5, causal=True)
    torch.manual_seed(3)
    packed = flashtile.flash_attn_qkvpacked_func(qkv, dropout_p=0.5, causal=True)
    torch.manual_seed(3)
    sdpa = flashtile.scaled_dot_product_attention(
        *(x.transpose(1, 2) for x in (q, k, v)), dropout_p=0.5, is_causal=True)
    assert torch.equal(packed, expected)
    assert torch.equal(sdpa.transpose(1, 2), expected)


def test_dropout_zero_is_the_plain_path(device):
    """dropout_p=0.0 draws no seed (no generator step) and returns the exact
    probabilities, unsigned."""
    q, k, v = _inputs(1, 8, 8, 1, 1, 8, torch.float32, device)
    state = torch.get_rng_state()
    _, _, probs = flashtile.flash_attn_func(q, k, v, return_attn_probs=True)
    assert torch.equal(torch.get_rng_state(), state)
    assert not torch.signbit(probs).any()


def test_philox_matches_a_published_test_vector():
    """The PyTorch Philox-4x32-10 (the kernels' tl.philox) against Random123's
    kat_vectors ("pi" line: counter 243f6a88 85a308d3 13198a2e 03707344, key a4093822
    299f31d0 -> d16cfe09 94fdcceb 5001e420 24126ea1): all four words, since the mask
    uses them all."""
    philox = torch.tensor([0x299F31D0_A4093822, 0x03707344_13198A2E])
    words = reference.philox_words(philox, torch.tensor(0x243F6A88), torch.tensor(0x85A308D3))
    assert [int(w) for w in words] == [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1]


def test_dropout_p_that_float32_rounds_to_one_is_refused():
    """The kernels take p in fp32: 1 - 2**-26 would be 1.0 there (every score dropped,
    scaled by inf, and a keep threshold past 32 bits). The largest fp32 below 1 runs."""
    q = torch.randn(1, 16, 2, 16)
    with pytest.raises(ValueError, match=r"dropout_p: expected at most 0\.99999994"):
        flashtile.flash_attn_func(q, q, q, dropout_p=1 - 2 ** -26)
    out = flashtile.flash_attn_func(q, q, q, dropout_p=1 - 2 ** -24)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("call", ["fp8", "block_table"])
def test_paths_without_dropout_refuse_it(call, device):
    q = torch.randn(1, 8, 2, 16, device=device)
    if call == "fp8":
        f8 = q.to(torch.float8_e4m3fn)
        with pytest.raises(ValueError, match=r"dropout_p: expected 0.0 with FP8 inputs"):
            flashtile.flash_attn_func(f8, f8, f8, dropout_p=0.1)
    else:
        pool = torch.randn(2, 16, 2, 16, device=device)
        cu = torch.tensor([0, 8], dtype=torch.int32, device=device)
        table = torch.zeros(1, 1, dtype=torch.int32, device=device)
        with pytest.raises(ValueError, match=r"dropout_p: expected 0.0 with block_table"):
            flashtile.flash_attn_varlen_func(q[0], pool, pool, cu, cu, 8, 8,
                                             dropout_p=0.1, block_table=table)


@pytest.mark.gpu
def test_cuda_graph_draws_a_new_mask_per_replay():
    """A forward and backward with dropout captured in a CUDA graph: the seed is drawn
    on the device inside the graph, so each replay takes a fresh mask from PyTorch's
    generator, and equals an eager step from the same generator state."""
    q, k, v = _inputs(2, 64, 64, 4, 2, 64, torch.bfloat16, "cuda")
    dout = torch.randn(2, 64, 4, 64, dtype=torch.bfloat16, device="cuda")

    def step():
        out = flashtile.flash_attn_func(q, k, v, dropout_p=0.2, causal=True)
        return (out, *torch.autograd.grad(out, (q, k, v), dout))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: compile, launch plans
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = step()
    replays, states = [], []
    for _ in range(2):
        states.append(torch.cuda.get_rng_state())
        graph.replay()
        replays.append([x.clone() for x in static])
    assert not torch.equal(replays[0][0], replays[1][0])
    for state, replay in zip(states, replays):
        torch.cuda.set_rng_state(state)
        eager = step()
        assert all(torch.equal(x, y) for x, y in zip(eager, replay))
