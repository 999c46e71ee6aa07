"""flashtile.sdpa_override: existing models written against PyTorch's SDPA run on
flashtile unchanged, and fall back to PyTorch (one log line per reason) where flashtile
does not take the arguments.

The models are small vision transformers written here: one in timm's style (its own
attention calling F.scaled_dot_product_attention, and a block calling a name imported
before the switch), one in torchvision's (nn.TransformerEncoder, i.e.
nn.MultiheadAttention). timm and torchvision themselves are not installable on this
CPU-only torch (torchvision's wheels on the package index are CUDA builds whose
operators fail to load).
"""

import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import flashtile
from flashtile import sdpa_routing
# Bound before any switch: the override must rebind this module-level name too.
from torch.nn.functional import scaled_dot_product_attention as sdpa_by_name
from tests.utils import assert_close_rule, max_err

_TORCH_SDPA = torch._C._nn.scaled_dot_product_attention


@pytest.fixture(autouse=True)
def _override_off_after_each_test(monkeypatch):
    monkeypatch.setattr(sdpa_routing._state, "reasons_logged", set())
    yield
    flashtile.sdpa_override(False)


@pytest.fixture
def flashtile_calls(monkeypatch):
    """How many calls reached flashtile's SDPA (the model's outputs alone would also
    agree if nothing were routed)."""
    calls = []
    real = sdpa_routing._flashtile_sdpa

    def counting(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)
    monkeypatch.setattr(sdpa_routing, "_flashtile_sdpa", counting)
    return calls


class TimmAttention(nn.Module):
    """timm's VisionTransformer attention (fused_attn path), reduced."""

    def __init__(self, dim, heads, attn_drop=0.0, by_name=False):
        super().__init__()
        self.heads, self.by_name = heads, by_name
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)
        self.attn_drop = nn.Dropout(attn_drop)

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, c // self.heads) \
            .permute(2, 0, 3, 1, 4).unbind(0)
        p = self.attn_drop.p if self.training else 0.0
        if self.by_name:
            x = sdpa_by_name(q, k, v, dropout_p=p)
        else:
            x = F.scaled_dot_product_attention(q, k, v, dropout_p=p)
        return self.proj(x.transpose(1, 2).reshape(b, n, c))


class TimmViT(nn.Module):
    def __init__(self, dim=32, heads=4, depth=2, attn_drop=0.0, patch=4, image=16):
        super().__init__()
        self.patch = nn.Conv2d(3, dim, patch, stride=patch)
        self.cls = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
        self.pos = nn.Parameter(torch.randn(1, (image // patch) ** 2 + 1, dim) * 0.02)
        self.blocks = nn.ModuleList()
        for i in range(depth):
            block = nn.ModuleDict({"norm1": nn.LayerNorm(dim), "norm2": nn.LayerNorm(dim),
                                   "attn": TimmAttention(dim, heads, attn_drop, i % 2 == 1),
                                   "mlp": nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(),
                                                        nn.Linear(2 * dim, dim))})
            self.blocks.append(block)
        self.head = nn.Linear(dim, 10)

    def forward(self, images):
        x = self.patch(images).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos
        for blk in self.blocks:
            x = x + blk["attn"](blk["norm1"](x))
            x = x + blk["mlp"](blk["norm2"](x))
        return self.head(x[:, 0])


class TorchvisionViT(nn.Module):
    """torchvision's VisionTransformer shape: nn.TransformerEncoder over patch tokens."""

    def __init__(self, dim=32, heads=4, depth=2, patch=4):
        super().__init__()
        self.patch = nn.Conv2d(3, dim, patch, stride=patch)
        layer = nn.TransformerEncoderLayer(dim, heads, 2 * dim, dropout=0.0,
                                           batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)
        self.head = nn.Linear(dim, 10)

    def forward(self, images):
        return self.head(self.encoder(self.patch(images).flatten(2).transpose(1, 2))
                         .mean(1))


def outputs_and_grads(model, images):
    images = images.clone().requires_grad_()
    out = model(images)
    grads = torch.autograd.grad(out.square().sum(), [images] + list(model.parameters()))
    return out.detach(), grads


def compare_with_and_without(model, images, flashtile_calls, expected_calls):
    """Outputs and all gradients under the override against PyTorch's fp32 run, both
    against the float64 run (the accuracy rule)."""
    plain = outputs_and_grads(model, images)
    ref64 = outputs_and_grads(model.double(), images.double())
    model.float()
    with flashtile.sdpa_override():
        routed = outputs_and_grads(model, images)
    assert len(flashtile_calls) == expected_calls
    assert_close_rule("logits", routed[0], ref64[0], plain[0])
    for i, (g, t, r) in enumerate(zip(routed[1], plain[1], ref64[1])):
        assert_close_rule(f"grad {i}", g, r, t)


def test_timm_style_vit(flashtile_calls, device):
    """Both blocks are routed: the one calling F.scaled_dot_product_attention and the
    one calling a name imported from torch.nn.functional before the switch."""
    model = TimmViT().to(device)
    compare_with_and_without(model, torch.randn(3, 3, 16, 16, device=device),
                             flashtile_calls, expected_calls=2)


def test_torchvision_style_vit(flashtile_calls, device):
    """nn.TransformerEncoderLayer -> nn.MultiheadAttention ->
    F.multi_head_attention_forward, which looks up F's scaled_dot_product_attention
    when called."""
    model = TorchvisionViT().to(device)
    compare_with_and_without(model, torch.randn(3, 3, 16, 16, device=device),
                             flashtile_calls, expected_calls=2)


def test_mha_fast_path_is_not_sdpa(flashtile_calls, device):
    """nn.MultiheadAttention's inference fast path (eval, no grad) runs a fused native
    kernel, not SDPA: the override cannot reach it unless the fast path is off."""
    model = TorchvisionViT().to(device).eval()
    images = torch.randn(2, 3, 16, 16, device=device)
    with torch.no_grad(), flashtile.sdpa_override():
        model(images)
        assert flashtile_calls == []
        try:
            torch.backends.mha.set_fastpath_enabled(False)
            out = model(images)
        finally:
            torch.backends.mha.set_fastpath_enabled(True)
    assert len(flashtile_calls) == 2
    with torch.no_grad():
        assert max_err(out, model(images)) < 1e-5


def test_vit_kernels(backend, flashtile_calls, device):
    """The Triton kernels (and the PyTorch path) under a model, forward and backward."""
    model = TimmViT(depth=1).to(device)
    compare_with_and_without(model, torch.randn(2, 3, 16, 16, device=device),
                             flashtile_calls, expected_calls=1)


def fallback_records(caplog):
    return [r.getMessage() for r in caplog.records
            if "runs PyTorch's implementation" in r.getMessage()]


def test_dropout_is_routed(flashtile_calls, caplog, device):
    """attn_drop > 0 in training: flashtile takes the calls (it has dropout now, with
    its own random numbers: reproducible under torch.manual_seed, not PyTorch's), and
    nothing falls back."""
    model = TimmViT(attn_drop=0.2).to(device).train()
    images = torch.randn(2, 3, 16, 16, device=device)
    with caplog.at_level(logging.WARNING, logger="flashtile"), flashtile.sdpa_override():
        torch.manual_seed(5)
        first = model(images)
        torch.manual_seed(5)
        again = model(images)
        other = model(images)
    assert torch.equal(first, again) and not torch.equal(first, other)
    assert len(flashtile_calls) == 6 and fallback_records(caplog) == []


@pytest.mark.parametrize("case", ["float64", "key_head_dim", "5d_batch_broadcast",
                                  "mask_dtype", "mask_shape", "unknown_kwarg"])
def test_unsupported_arguments_fall_back(case, flashtile_calls, caplog, device):
    q = torch.randn(2, 3, 5, 8, device=device)
    k, v = torch.randn_like(q), torch.randn_like(q)
    kw = {}
    if case == "float64":
        q, k, v = q.double(), k.double(), v.double()
    elif case == "key_head_dim":
        k = torch.randn(2, 3, 5, 6, device=device)
    elif case == "5d_batch_broadcast":  # key's batch dims broadcast to the query's
        q, k, v = q[None].expand(2, *q.shape), k[None], v[None]
    elif case == "mask_dtype":
        kw["attn_mask"] = torch.zeros(5, 5, dtype=torch.float64, device=device)
    elif case == "mask_shape":
        kw["attn_mask"] = torch.zeros(4, 5, dtype=torch.bool, device=device)
    else:
        kw["future_argument"] = 1
    with caplog.at_level(logging.WARNING, logger="flashtile"), flashtile.sdpa_override():
        if case == "unknown_kwarg":  # PyTorch's function gives its own error
            with pytest.raises(TypeError):
                F.scaled_dot_product_attention(q, k, v, **kw)
        elif case.startswith("mask") or case == "key_head_dim":  # PyTorch's errors
            with pytest.raises(RuntimeError):
                F.scaled_dot_product_attention(q, k, v, **kw)
        else:
            out = F.scaled_dot_product_attention(q, k, v, **kw)
            assert torch.equal(out, _TORCH_SDPA(q, k, v, **kw))
    assert flashtile_calls == []
    assert len(fallback_records(caplog)) == 1


def test_supported_arguments_are_routed(flashtile_calls, device):
    """Masks, causal, scale, GQA and 3-d inputs go to flashtile, with PyTorch's results."""
    q = torch.randn(2, 4, 6, 8, device=device)
    k = torch.randn(2, 2, 9, 8, device=device)
    v = torch.randn(2, 2, 9, 8, device=device)
    cases = [dict(attn_mask=torch.rand(6, 9, device=device) > 0.3, enable_gqa=True),
             dict(attn_mask=torch.randn(2, 1, 6, 9, device=device), enable_gqa=True),
             dict(is_causal=True, scale=0.2, enable_gqa=True)]
    for kw in cases:
        with flashtile.sdpa_override():
            out = F.scaled_dot_product_attention(q, k, v, **kw)
        assert max_err(out, _TORCH_SDPA(q, k, v, **kw)) < 1e-5, kw
    v12 = torch.randn(2, 2, 9, 12, device=device)  # value's own head dim (MLA)
    with flashtile.sdpa_override():
        out = F.scaled_dot_product_attention(q, k, v12, enable_gqa=True)
    assert max_err(out, _TORCH_SDPA(q, k, v12, enable_gqa=True)) < 1e-5
    q3 = q[:, 0]
    with flashtile.sdpa_override():
        out = sdpa_by_name(q3, q3, q3)
    assert max_err(out, _TORCH_SDPA(q3, q3, q3)) < 1e-5
    q5, k5, v5 = (x[None].expand(3, *x.shape) for x in (q, k, v))  # more batch dims
    with flashtile.sdpa_override():
        out = F.scaled_dot_product_attention(q5, k5, v5, enable_gqa=True)
    assert max_err(out, _TORCH_SDPA(q5, k5, v5, enable_gqa=True)) < 1e-5
    assert len(flashtile_calls) == 6


def test_switch_global_and_context_manager():
    assert F.scaled_dot_product_attention is _TORCH_SDPA and sdpa_by_name is _TORCH_SDPA
    assert not flashtile.sdpa_override.is_enabled()
    flashtile.sdpa_override()                      # on for the process
    routed = sdpa_routing.routed_scaled_dot_product_attention
    assert flashtile.sdpa_override.is_enabled()
    assert F.scaled_dot_product_attention is routed
    assert globals()["sdpa_by_name"] is routed
    with flashtile.sdpa_override(False):           # off inside, back on after
        assert F.scaled_dot_product_attention is _TORCH_SDPA
        with flashtile.sdpa_override():
            assert flashtile.sdpa_override.is_enabled()
        assert not flashtile.sdpa_override.is_enabled()
    assert flashtile.sdpa_override.is_enabled()
    flashtile.sdpa_override(False)
    assert F.scaled_dot_product_attention is _TORCH_SDPA
    assert globals()["sdpa_by_name"] is _TORCH_SDPA
    assert torch.nn.functional.scaled_dot_product_attention is _TORCH_SDPA
    with pytest.raises(TypeError, match="enable: expected a bool"):
        flashtile.sdpa_override("yes")


def test_bound_while_on_follows_the_switch(flashtile_calls, device):
    """A name imported while the override was on holds the routing function; once
    off, that function calls PyTorch's SDPA."""
    q = torch.randn(1, 2, 4, 8, device=device)
    with flashtile.sdpa_override():
        held = F.scaled_dot_product_attention
    out = held(q, q, q)
    assert flashtile_calls == [] and torch.equal(out, _TORCH_SDPA(q, q, q))


def test_torch_compile(flashtile_calls, device):
    """Compiled while on: flashtile's op in the graph, no graph break (fullgraph);
    switching off recompiles to PyTorch's SDPA."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(str(gm.graph))
        return gm.forward

    def f(q):
        return F.scaled_dot_product_attention(q, q, q, is_causal=True) * 2
    compiled = torch.compile(f, backend=backend, fullgraph=True)
    q = torch.randn(1, 2, 7, 8, device=device)
    with flashtile.sdpa_override():
        out = compiled(q)
    assert len(graphs) == 1 and "flashtile" in graphs[0]
    assert max_err(out, f(q)) < 1e-5
    compiled(q)
    assert len(graphs) == 2 and "flashtile" not in graphs[1]
