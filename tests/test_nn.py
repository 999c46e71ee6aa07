"""flashtile.nn: MultiheadAttention against torch.nn.MultiheadAttention, Attention against
a plain float64 reference, forward and backward, including the KV-cache decode loop.

Accuracy (tests.utils.assert_close_rule): err(flashtile fp32) <= 2 * err(torch fp32) +
floor, both against float64.
The argument grid runs on the PyTorch path (fast); cases marked with the ``backend``
fixture also run the Triton kernels (through the interpreter on CPU).
"""

import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from flashtile import flash_attn_func
from flashtile.nn import Attention, MultiheadAttention
from tests.utils import assert_close_rule, max_err

E, H = 8, 2

# torch warns when key_padding_mask and attn_mask differ in type; the grid mixes them.
pytestmark = pytest.mark.filterwarnings("ignore:Support for mismatched key_padding_mask")


@pytest.fixture
def grid_backend(monkeypatch, on_gpu):
    """The grid's many small cases: the PyTorch path on CPU (the Triton interpreter
    would take minutes), the Triton kernels on a GPU."""
    if not on_gpu:
        monkeypatch.setenv("FLASHTILE_BACKEND", "torch")


def dropout_keep(p, seed, batch, nheads, seqlen_q, seqlen_k, device):
    """The keep mask (batch, nheads, seqlen_q, seqlen_k) of a dense call that draws its
    dropout seed first after torch.manual_seed(seed): flash_attn_func's debug path on the
    same seed (the mask depends on the seed and the positions only, not on q, k, v; the
    entries it drops come back negated)."""
    torch.manual_seed(seed)
    q = torch.zeros(batch, seqlen_q, nheads, 8, device=device)
    k = torch.zeros(batch, seqlen_k, nheads, 8, device=device)
    _, _, probs = flash_attn_func(q, k, k, dropout_p=p, return_attn_probs=True)
    return ~torch.signbit(probs)


def check_against_reference(out, grads, reference, x, params, dout):
    """out and grads (of x, then params) against reference(x', dtype) at float64, by
    the accuracy rule with the same reference at float32 as PyTorch's own error."""
    results = {}
    for dtype in (torch.float64, torch.float32):
        xr = x.to(dtype).requires_grad_()
        ref = reference(xr, dtype)
        results[dtype] = (ref.detach(), torch.autograd.grad(ref, [xr] + params,
                                                            dout.to(dtype)))
    assert_close_rule("out", out, results[torch.float64][0], results[torch.float32][0])
    for i, (g, t, r) in enumerate(zip(grads, results[torch.float32][1],
                                      results[torch.float64][1])):
        assert_close_rule(f"grad {i}", g, r, t)


# ---------------------------------------------------------------------------------------
# MultiheadAttention

def make_inputs(inputs, batch_first, n, l, s, kdim, vdim, device):
    """query, key, value as the module takes them; "self" passes one tensor three times
    and "kv" one tensor as key and value (the fused projections' cases)."""
    shape = (lambda length, dim: (n, length, dim)) if batch_first else \
        (lambda length, dim: (length, n, dim))
    q = torch.randn(shape(l, E), device=device)
    if inputs == "self":
        return q, q, q
    k = torch.randn(shape(s, kdim), device=device)
    if inputs == "kv":
        return q, k, k
    return q, k, torch.randn(shape(s, vdim), device=device)


def make_masks(kpm_kind, mask_kind, n, l, s, device):
    """key_padding_mask (N, S) and attn_mask (L, S) or (N * H, L, S) in torch's meaning
    (bool True = masked out, float additive). Every row keeps key 0, so no row is
    empty (torch's paths disagree on empty rows: 0 or NaN)."""
    kpm = attn = None
    if kpm_kind != "none":
        kpm = torch.rand(n, s, device=device) < 0.4
        kpm[:, 0] = False
        if kpm_kind == "float":
            kpm = torch.zeros(n, s, device=device).masked_fill(kpm, float("-inf")) \
                + torch.randn(n, s, device=device) * 0.5
    if mask_kind != "none":
        dims, kind = mask_kind.split("_")
        shape = (l, s) if dims == "2d" else (n * H, l, s)
        if kind == "bool":
            attn = torch.rand(shape, device=device) < 0.4
            attn[..., 0] = False
        else:
            attn = torch.randn(shape, device=device)
    return kpm, attn


def run_mha(module, dtype, inputs, kpm, attn, **kw):
    """Output and gradients (inputs, then parameters) of module at dtype."""
    m = module.to(dtype)
    leaves = {}  # one leaf per distinct input, so "self" and "kv" stay shared
    xs = [leaves.setdefault(id(x), x.detach().to(dtype).requires_grad_()) for x in inputs]
    kpm, attn = (x if x is None or x.dtype == torch.bool else x.to(dtype)
                 for x in (kpm, attn))
    out, weights = m(*xs, key_padding_mask=kpm, attn_mask=attn, need_weights=False, **kw)
    assert weights is None
    gen = torch.Generator(out.device).manual_seed(1)
    dout = torch.randn(out.shape, generator=gen, dtype=torch.float64,
                       device=out.device).to(dtype)
    grads = torch.autograd.grad(out, list(leaves.values()) + list(m.parameters()), dout)
    return out.detach(), grads


def compare_mha(torch_mha, ours, inputs, kpm, attn, **kw):
    ours.load_state_dict(torch_mha.state_dict())
    ref64 = run_mha(torch_mha.double(), torch.float64, inputs, kpm, attn, **kw)
    t32 = run_mha(torch_mha.float(), torch.float32, inputs, kpm, attn, **kw)
    got = run_mha(ours, torch.float32, inputs, kpm, attn, **kw)
    assert_close_rule("out", got[0], ref64[0], t32[0])
    assert len(got[1]) == len(ref64[1])
    for i, (g, t, r) in enumerate(zip(got[1], t32[1], ref64[1])):
        assert_close_rule(f"grad {i}", g, r, t)


INPUTS = ["self", "kv", "separate", "kdim_vdim"]
KPM = ["none", "bool", "float"]
ATTN = ["none", "2d_bool", "2d_float", "3d_bool", "3d_float"]
FLAGS = list(itertools.product([False, True], repeat=4))


def flag_id(flags):
    names = ("batch_first", "bias", "bias_kv", "zero_attn")
    return "-".join(n if f else f"no_{n}" for n, f in zip(names, flags))


@pytest.mark.parametrize("mask_kind", ATTN)
@pytest.mark.parametrize("kpm_kind", KPM)
@pytest.mark.parametrize("inputs", INPUTS)
@pytest.mark.parametrize("flags", FLAGS, ids=flag_id)
def test_mha_matches_torch(flags, inputs, kpm_kind, mask_kind, grid_backend, device):
    batch_first, bias, add_bias_kv, add_zero_attn = flags
    kdim, vdim = (6, 10) if inputs == "kdim_vdim" else (None, None)
    kw = dict(bias=bias, add_bias_kv=add_bias_kv, add_zero_attn=add_zero_attn, kdim=kdim,
              vdim=vdim, batch_first=batch_first, device=device)
    torch_mha = torch.nn.MultiheadAttention(E, H, **kw)
    ours = MultiheadAttention(E, H, **kw)
    n, l = 2, 5
    s = l if inputs == "self" else 7
    xs = make_inputs(inputs, batch_first, n, l, s, kdim or E, vdim or E, device)
    kpm, attn = make_masks(kpm_kind, mask_kind, n, l, s, device)
    compare_mha(torch_mha, ours, xs, kpm, attn)


@pytest.mark.parametrize("mask_dtype", ["bool", "float"])
@pytest.mark.parametrize("kpm_kind", KPM)
@pytest.mark.parametrize("flags", FLAGS, ids=flag_id)
def test_mha_is_causal(flags, kpm_kind, mask_dtype, grid_backend, device):
    """is_causal with the causal mask: torch computes the causal mask itself when no key
    padding mask is given (appended bias/zero keys then unseen), the mask otherwise."""
    batch_first, bias, add_bias_kv, add_zero_attn = flags
    kw = dict(bias=bias, add_bias_kv=add_bias_kv, add_zero_attn=add_zero_attn,
              batch_first=batch_first, device=device)
    n, l = 2, 6
    causal = torch.ones(l, l, dtype=torch.bool, device=device).triu(1)  # True = masked
    if mask_dtype == "float":
        causal = torch.zeros(l, l, device=device).masked_fill(causal, float("-inf"))
    xs = make_inputs("self", batch_first, n, l, l, E, E, device)
    kpm, _ = make_masks(kpm_kind, "none", n, l, l, device)
    compare_mha(torch.nn.MultiheadAttention(E, H, **kw), MultiheadAttention(E, H, **kw),
                xs, kpm, causal, is_causal=True)


@pytest.mark.parametrize("kpm_kind", ["none", "bool"])
def test_mha_unbatched(kpm_kind, grid_backend, device):
    torch_mha = torch.nn.MultiheadAttention(E, H, add_bias_kv=True, device=device)
    q, k = torch.randn(5, E, device=device), torch.randn(7, E, device=device)
    kpm = None if kpm_kind == "none" else torch.tensor([0, 1, 0, 0, 1, 1, 0],
                                                       dtype=torch.bool, device=device)
    mask = torch.randn(H, 5, 7, device=device)  # 3-d: (1 * num_heads, L, S)
    compare_mha(torch_mha, MultiheadAttention(E, H, add_bias_kv=True, device=device),
                (q, k, k), kpm, mask)


@pytest.mark.parametrize("case", [
    ("self-bias_kv-kpm_bool", "self", True, "bool", "none"),
    ("cross-zero_attn-3d_float", "separate", False, "none", "3d_float"),
], ids=lambda c: c[0])
def test_mha_kernels(case, backend, device):
    """The Triton kernels (and the PyTorch path) under the module, a few cases."""
    _, inputs, add_bias_kv, kpm_kind, mask_kind = case
    kw = dict(add_bias_kv=add_bias_kv, add_zero_attn=not add_bias_kv, batch_first=True,
              device=device)
    n, l = 2, 5
    s = l if inputs == "self" else 7
    xs = make_inputs(inputs, True, n, l, s, E, E, device)
    kpm, attn = make_masks(kpm_kind, mask_kind, n, l, s, device)
    compare_mha(torch.nn.MultiheadAttention(E, H, **kw), MultiheadAttention(E, H, **kw),
                xs, kpm, attn)


@pytest.mark.parametrize("kdim", [None, 6], ids=["packed", "separate_weights"])
def test_mha_state_dict_round_trip(kdim, device):
    kw = dict(kdim=kdim, vdim=kdim, add_bias_kv=True, device=device)
    torch_mha = torch.nn.MultiheadAttention(E, H, **kw)
    ours = MultiheadAttention(E, H, **kw)
    assert isinstance(ours, torch.nn.MultiheadAttention)
    assert ours.state_dict().keys() == torch_mha.state_dict().keys()
    ours.load_state_dict(torch_mha.state_dict())          # strict: same names and shapes
    back = torch.nn.MultiheadAttention(E, H, **kw)
    back.load_state_dict(ours.state_dict())
    for (name, a), b in zip(torch_mha.state_dict().items(), back.state_dict().values()):
        assert torch.equal(a, b), name


def test_mha_need_weights_error_and_dropout_off_in_eval(device):
    m = MultiheadAttention(E, H, dropout=0.1, device=device)
    x = torch.randn(4, 1, E, device=device)
    with pytest.raises(NotImplementedError, match="need_weights=True"):
        m(x, x, x, need_weights=True)
    with pytest.raises(ValueError, match=r"dropout: expected a probability in \[0, 1\)"):
        MultiheadAttention(E, H, dropout=1.0, device=device)
    m.eval()  # dropout is off in eval mode, as in torch: torch's output exactly
    torch_mha = torch.nn.MultiheadAttention(E, H, dropout=0.1, device=device).eval()
    m.load_state_dict(torch_mha.state_dict())
    with torch.no_grad():
        out, weights = m(x, x, x)
        ref = torch_mha(x, x, x, need_weights=False)[0]
    assert weights is None and max_err(out, ref) < 1e-5


def mha_reference(m, x, kpm, keep, p, dtype):
    """m (batch_first, add_bias_kv) on x (N, L, E) as self-attention with the bool key
    padding mask kpm (N, L), True = masked, written out at dtype, dropping the attention
    weights (N, H, L, L + 1) where keep is False and scaling the rest by 1 / (1 - p)."""
    w = {name: t.to(dtype) for name, t in m.named_parameters()}
    n, l, _ = x.shape
    d = E // H
    q, k, v = F.linear(x, w["in_proj_weight"], w["in_proj_bias"]).view(
        n, l, 3, H, d).unbind(2)
    k = torch.cat([k, w["bias_k"].view(1, 1, H, d).expand(n, 1, H, d)], dim=1)
    v = torch.cat([v, w["bias_v"].view(1, 1, H, d).expand(n, 1, H, d)], dim=1)
    scores = torch.einsum("nqhd,nkhd->nhqk", q, k) / math.sqrt(d)
    scores = scores.masked_fill(F.pad(kpm, (0, 1))[:, None, None, :], float("-inf"))
    weights = torch.softmax(scores, dim=-1) * keep / (1 - p)
    out = torch.einsum("nhqk,nkhd->nqhd", weights, v).flatten(2)
    return F.linear(out, w["out_proj.weight"], w["out_proj.bias"])


@pytest.mark.parametrize("backend", ["torch", "triton"], indirect=True)
def test_mha_dropout_equals_reference_with_the_same_mask(backend, device):
    """Training mode: the attention weights (the appended bias_k key and the key
    padding mask included) are dropped with p = dropout, the mask drawn from PyTorch's
    generator; output and gradients equal a float64 reference applying that mask.
    Not torch's draw (another RNG stream), so torch's module is no reference here."""
    p, n, l, seed = 0.3, 2, 6, 5
    m = MultiheadAttention(E, H, dropout=p, add_bias_kv=True, batch_first=True,
                           device=device)
    x = torch.randn(n, l, E, device=device)
    kpm = torch.rand(n, l, device=device) < 0.3
    kpm[:, 0] = False
    xg = x.clone().requires_grad_()
    torch.manual_seed(seed)
    out, _ = m(xg, xg, xg, key_padding_mask=kpm)
    dout = torch.randn_like(out)
    params = list(m.parameters())
    grads = torch.autograd.grad(out, [xg] + params, dout)
    keep = dropout_keep(p, seed, n, H, l, l + 1, device)
    assert 0 < keep.sum() < keep.numel()
    check_against_reference(out, grads, lambda xr, dtype: mha_reference(
        m, xr, kpm, keep.to(dtype), p, dtype), x, params, dout)


def test_mha_dropout_reproducible_and_training_only(grid_backend, device):
    m = MultiheadAttention(E, H, dropout=0.4, device=device)
    x = torch.randn(5, 2, E, device=device)

    def run(seed):
        torch.manual_seed(seed)
        return m(x, x, x)[0]

    first, again, other = run(1), run(1), run(2)
    assert torch.equal(first, again) and not torch.equal(first, other)
    m.eval()
    assert torch.equal(run(1), run(2))
    assert not torch.equal(run(1), first)


def test_mha_dropout_keep_rate(grid_backend, device):
    """The module's own keep rate, read from its output: with q = 0 every key has
    weight 1 / S, v = 1 and out_proj the identity, so out * (1 - p) * S counts the kept
    keys of a (query, head). Over N * H * L * S = 16384 weights the rate's standard
    deviation is at most 0.0040; the bound 0.025 is over 6 of them."""
    n, s, p = 2, 64, 0.5
    m = MultiheadAttention(E, H, dropout=p, batch_first=True, device=device)
    with torch.no_grad():
        m.in_proj_weight.zero_()
        m.in_proj_bias.zero_()
        m.in_proj_bias[2 * E:] = 1.0
        m.out_proj.weight.copy_(torch.eye(E))
        m.out_proj.bias.zero_()
        x = torch.randn(n, s, E, device=device)
        out = m(x, x, x)[0]
    kept = out[..., ::E // H].double() * (1 - p) * s                   # (N, L, H)
    assert max_err(kept, kept.round()) < 1e-3
    rate = kept.sum().item() / (n * H * s * s)
    assert abs(rate - (1 - p)) < 0.025, rate


def test_mha_argument_errors(device):
    m = MultiheadAttention(E, H, device=device)
    x = torch.randn(4, 2, E, device=device)
    with pytest.raises(ValueError, match="is_causal=True needs attn_mask"):
        m(x, x, x, is_causal=True)
    with pytest.raises(ValueError, match=r"attn_mask.shape: expected \(4, 4\)"):
        m(x, x, x, attn_mask=torch.zeros(3, 4, device=device))
    with pytest.raises(ValueError, match=r"key_padding_mask.shape: expected \(batch, S\)"):
        m(x, x, x, key_padding_mask=torch.zeros(2, 5, dtype=torch.bool, device=device))
    with pytest.raises(ValueError, match=r"query.shape\[-1\]: expected embed_dim=8, got 6"):
        m(x[..., :6], x, x)
    with pytest.raises(TypeError, match="need_weights: expected a bool"):
        m(x, x, x, need_weights="no")
    with pytest.raises(TypeError, match="query: expected dtype float16"):
        m.double()(x.double(), x.double(), x.double())
    with pytest.raises(ValueError, match="head_dim\\): expected at most 512"):
        MultiheadAttention(2048, 2, device="meta")


def test_mha_compiles_without_graph_break(grid_backend, device):
    m = MultiheadAttention(E, H, batch_first=True, device=device)
    x = torch.randn(2, 5, E, device=device)
    kpm = torch.tensor([[0, 0, 1, 1, 1], [0, 0, 0, 0, 0]], dtype=torch.bool, device=device)
    compiled = torch.compile(m, backend="eager", fullgraph=True)
    assert max_err(compiled(x, x, x, key_padding_mask=kpm)[0],
                   m(x, x, x, key_padding_mask=kpm)[0]) == 0


# ---------------------------------------------------------------------------------------
# Attention

def rotate64(x, positions, rotary_dim, theta, interleaved):
    """The rotary embedding written out in float64: x (b, s, h, d), positions (b, s)."""
    if rotary_dim is None:
        return x
    inv = 1.0 / theta ** (torch.arange(0, rotary_dim, 2, dtype=x.dtype,
                                       device=x.device) / rotary_dim)
    ang = positions[..., None, None].to(x.dtype) * inv                # (b, s, 1, rd/2)
    xr, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
    else:
        x1, x2 = xr.chunk(2, dim=-1)
    r1, r2 = x1 * ang.cos() - x2 * ang.sin(), x1 * ang.sin() + x2 * ang.cos()
    rot = torch.stack((r1, r2), -1).flatten(-2) if interleaved else torch.cat((r1, r2), -1)
    return torch.cat((rot, rest), dim=-1)


def attention_reference(m, x, dtype, start=0, keep=None):
    """m's output for x (b, s, E) computed plainly at dtype: separate steps, GQA by
    repeat_interleave, the (s, start + s) score matrix with its masks. Queries sit at
    positions start .. start + s - 1 over keys 0 .. start + s - 1, given as the last
    rows of x (x holds all start + s tokens). keep: a dropout keep mask (b, h, s, start
    + s) applied to the probabilities with p = m.dropout."""
    p = {n: t.to(dtype) for n, t in m.named_parameters()}
    h, hkv, d = m.num_heads, m.num_kv_heads, m.head_dim
    x = x.to(dtype)
    b, total = x.shape[:2]
    qkv = F.linear(x, p["qkv_proj.weight"], p.get("qkv_proj.bias")).view(b, total, -1, d)
    q, k, v = qkv.split([h, hkv, hkv], dim=2)
    if m.q_norm is not None:
        def rms(t, w):
            return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + m.q_norm.eps) * w
        q, k = rms(q, p["q_norm.weight"]), rms(k, p["k_norm.weight"])
    pos = torch.arange(total, device=x.device).expand(b, total)
    q, k = (rotate64(t, pos, m.rotary_dim, m.rope_theta, m.rotary_interleaved)
            for t in (q, k))
    q = q[:, start:]
    k, v = (t.repeat_interleave(h // hkv, dim=2) for t in (k, v))
    scale = m.softmax_scale or 1.0 / math.sqrt(d)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if m.softcap:
        s = m.softcap * torch.tanh(s / m.softcap)
    i = torch.arange(start, total, device=x.device)[:, None]
    j = torch.arange(total, device=x.device)[None, :]
    left, right = m.window_size
    right = 0 if m.causal else right
    visible = torch.ones_like(s[0, 0], dtype=torch.bool)
    if right >= 0:
        visible &= j <= i + right
    if left >= 0:
        visible &= j >= i - left
    probs = torch.softmax(s.masked_fill(~visible, float("-inf")), dim=-1)
    if keep is not None:
        probs = probs * keep / (1 - m.dropout)
    out = torch.einsum("bhqk,bkhd->bqhd", probs, v).flatten(2)
    return F.linear(out, p["o_proj.weight"], p.get("o_proj.bias"))


ATTN_CASES = {
    "mha-plain": dict(num_heads=4),
    "gqa-causal-rotary": dict(num_heads=4, num_kv_heads=2, head_dim=8, causal=True,
                              rotary_dim=8),
    "mqa-window-softcap": dict(num_heads=4, num_kv_heads=1, head_dim=8, causal=True,
                               window_size=(3, 0), softcap=2.0, rotary_dim=8),
    "gqa-qknorm-partial-interleaved-bias": dict(
        num_heads=4, num_kv_heads=2, head_dim=8, causal=True, qk_norm=True, rotary_dim=4,
        rotary_interleaved=True, bias=True, out_bias=True),
    "bidirectional-window-scale": dict(num_heads=2, head_dim=12, window_size=(2, 1),
                                       softmax_scale=0.3, rotary_dim=12, rope_theta=500.0),
}


def make_attention(case, device):
    m = Attention(16, **ATTN_CASES[case], device=device)
    if m.q_norm is not None:  # non-trivial norm weights
        with torch.no_grad():
            m.q_norm.weight.uniform_(0.5, 1.5)
            m.k_norm.weight.uniform_(0.5, 1.5)
    return m


@pytest.mark.parametrize("case", list(ATTN_CASES))
def test_attention_matches_reference(case, grid_backend, device):
    m = make_attention(case, device)
    x = torch.randn(2, 11, 16, device=device)
    xg = x.clone().requires_grad_()
    out = m(xg)
    dout = torch.randn_like(out)
    params = list(m.parameters())
    grads = torch.autograd.grad(out, [xg] + params, dout)
    check_against_reference(out, grads, lambda xr, dtype: attention_reference(m, xr, dtype),
                            x, params, dout)


@pytest.mark.parametrize("backend", ["torch", "triton"], indirect=True)
def test_attention_dropout_equals_reference_with_the_same_mask(backend, device):
    """Training mode with dropout: output and gradients equal the float64 reference
    applying the mask the same seed gives flash_attn_func (GQA: one mask per query
    head)."""
    seed = 7
    m = make_attention("gqa-causal-rotary", device)
    m.dropout = 0.25
    x = torch.randn(2, 11, 16, device=device)
    xg = x.clone().requires_grad_()
    torch.manual_seed(seed)
    out = m(xg)
    dout = torch.randn_like(out)
    params = list(m.parameters())
    grads = torch.autograd.grad(out, [xg] + params, dout)
    keep = dropout_keep(m.dropout, seed, 2, m.num_heads, 11, 11, device)
    check_against_reference(out, grads, lambda xr, dtype: attention_reference(
        m, xr, dtype, keep=keep.to(dtype)), x, params, dout)


def test_attention_dropout_training_only(grid_backend, device):
    """Packed sequences: reproducible under torch.manual_seed, the plain attention in
    eval mode; decoding in training mode with dropout refuses."""
    m = Attention(16, 2, causal=True, dropout=0.3, device=device)
    x = torch.randn(9, 16, device=device, requires_grad=True)
    cu = torch.tensor([0, 4, 9], dtype=torch.int32, device=device)

    def run(seed):
        torch.manual_seed(seed)
        return m(x, cu_seqlens=cu, max_seqlen=5)

    first, again, other = run(1), run(1), run(2)
    assert torch.equal(first, again) and not torch.equal(first, other)
    (g,) = torch.autograd.grad(first.sum(), x)
    assert torch.isfinite(g).all() and g.abs().sum() > 0
    cache = (torch.zeros(1, 8, 2, 8, device=device),) * 2
    with torch.no_grad(), pytest.raises(ValueError, match="dropout: expected 0.0 with "
                                        "kv_cache in training mode"):
        m(x[None, :3], kv_cache=cache, cache_seqlens=0)
    m.eval()
    plain = Attention(16, 2, causal=True, device=device)
    plain.load_state_dict(m.state_dict())
    assert torch.equal(run(1), plain(x, cu_seqlens=cu, max_seqlen=5))


def test_attention_packed_sequences(grid_backend, device):
    """Packed (varlen) input equals each sequence run alone; positions restart at 0."""
    m = make_attention("gqa-causal-rotary", device)
    lengths = [5, 0, 9, 3]
    xs = [torch.randn(n, 16, device=device) for n in lengths]
    cu = torch.tensor([0] + list(itertools.accumulate(lengths)), dtype=torch.int32,
                      device=device)
    packed = m(torch.cat(xs), cu_seqlens=cu, max_seqlen=max(lengths))
    for x, start, n in zip(xs, cu[:-1].tolist(), lengths):
        if n:
            ref64 = attention_reference(m, x[None], torch.float64)[0]
            assert_close_rule(f"sequence at {start}", packed[start:start + n], ref64,
                              attention_reference(m, x[None], torch.float32)[0])


def decode_loop(m, x, chunks, paged, device):
    """Feed x (b, total, E) through m's KV cache in chunks; returns the outputs (b,
    total, E)."""
    b, total = x.shape[:2]
    hkv, d = m.num_kv_heads, m.head_dim
    if paged:
        page, pages_per_seq = 16, -(-total // 16)
        k_cache = torch.zeros(b * pages_per_seq + 1, page, hkv, d, device=device)
        # Pages in reverse order, so a wrong table lookup cannot pass by luck.
        table = torch.arange(b * pages_per_seq, dtype=torch.int32, device=device).flip(0)
        table = table.view(b, pages_per_seq)
    else:
        k_cache, table = torch.zeros(b, total + 3, hkv, d, device=device), None
    v_cache = torch.zeros_like(k_cache)
    seqlens = torch.zeros(b, dtype=torch.int32, device=device)
    outs, pos = [], 0
    with torch.no_grad():
        for n in chunks:
            outs.append(m(x[:, pos:pos + n], kv_cache=(k_cache, v_cache),
                          cache_seqlens=seqlens, block_table=table))
            seqlens += n
            pos += n
    return torch.cat(outs, dim=1)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("case", ["gqa-causal-rotary", "mqa-window-softcap",
                                  "gqa-qknorm-partial-interleaved-bias"])
def test_attention_kv_cache_decode_loop(case, paged, grid_backend, device):
    """Prefill, a chunk, then token by token: each step's output equals the reference
    over every token so far (rotary at the cache positions, the window sliding)."""
    m = make_attention(case, device)
    chunks = [6, 3] + [1] * 5
    x = torch.randn(2, sum(chunks), 16, device=device)
    got = decode_loop(m, x, chunks, paged, device)
    with torch.no_grad():
        assert_close_rule("decode", got, attention_reference(m, x, torch.float64),
                          attention_reference(m, x, torch.float32))
        # The cache path is the same attention as the plain forward.
        assert max_err(got, m(x)) < 1e-5


def test_attention_kernels(backend, device):
    """The Triton kernels (and the PyTorch path): forward + backward and a short decode."""
    m = make_attention("gqa-qknorm-partial-interleaved-bias", device)
    x = torch.randn(1, 7, 16, device=device)
    xg = x.clone().requires_grad_()
    out = m(xg)
    (g,) = torch.autograd.grad(out.sum(), xg)
    xr = x.double().requires_grad_()
    ref = attention_reference(m, xr, torch.float64)
    (g_ref,) = torch.autograd.grad(ref.sum(), xr)
    assert max_err(out, ref) < 1e-5 and max_err(g, g_ref) < 1e-4
    got = decode_loop(m, x, [4, 1, 1, 1], paged=False, device=device)
    assert max_err(got, ref) < 1e-5


def test_attention_errors(device):
    with pytest.raises(ValueError, match="num_kv_heads: expected a divisor of num_heads=4"):
        Attention(16, 4, 3)
    with pytest.raises(ValueError, match="head_dim: expected at most 512"):
        Attention(16, 1, head_dim=1024)
    with pytest.raises(ValueError, match="rotary_dim: expected None or an even int"):
        Attention(16, 2, rotary_dim=5)
    with pytest.raises(ValueError, match="embed_dim: expected a multiple of num_heads=3"):
        Attention(16, 3)
    with pytest.raises(ValueError, match=r"dropout: expected a probability in \[0, 1\)"):
        Attention(16, 2, dropout=1.0)
    m = Attention(16, 2, device=device)
    x = torch.randn(1, 3, 16, device=device)
    cache = (torch.zeros(1, 8, 2, 8, device=device),) * 2
    with pytest.raises(NotImplementedError, match="inference only"):
        m(x, kv_cache=cache, cache_seqlens=0)
    with torch.no_grad():
        with pytest.raises(ValueError, match="cache_seqlens: expected an int"):
            m(x, kv_cache=cache)
        with pytest.raises(ValueError, match="cache_seqlens: expected None without"):
            m(x, cache_seqlens=0)
        with pytest.raises(ValueError, match="max_seqlen: expected an int with cu_seqlens"):
            m(x[0], cu_seqlens=torch.tensor([0, 3], dtype=torch.int32, device=device))
        with pytest.raises(ValueError, match=r"x.shape\[-1\]: expected embed_dim=16"):
            m(x[..., :8])


def test_attention_state_is_parameters_only(device):
    m = Attention(16, 4, 2, rotary_dim=4, qk_norm=True, bias=True, device=device)
    assert sorted(m.state_dict()) == ["k_norm.weight", "o_proj.weight", "q_norm.weight",
                                      "qkv_proj.bias", "qkv_proj.weight"]
    assert m.qkv_proj.weight.shape == ((4 + 2 * 2) * 4, 16)
    meta = Attention(16, 4, 2, rotary_dim=4, device="meta").to_empty(device=device)
    meta.reset_parameters()
    assert torch.equal(meta.inv_freq, m.inv_freq)
