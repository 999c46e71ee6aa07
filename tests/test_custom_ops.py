"""The flashtile:: custom ops: opcheck, and torch.compile(fullgraph=True) with no break."""

import pytest
import torch

import flashtile
from flashtile import custom_ops


@pytest.fixture
def torch_backend(monkeypatch, on_gpu):
    if not on_gpu:
        monkeypatch.setenv("FLASHTILE_BACKEND", "torch")


def test_opcheck(torch_backend, device):
    q = torch.randn(2, 19, 4, 16, device=device, requires_grad=True)
    k = torch.randn(2, 23, 2, 16, device=device, requires_grad=True)
    v = torch.randn(2, 23, 2, 16, device=device, requires_grad=True)
    args = (q, k, v, None, None, 0.25, 4, -1, 0, 0.0, False)
    torch.library.opcheck(custom_ops.attn_fwd, args)


class TinyBlock(torch.nn.Module):
    def __init__(self, dim=64, heads=4, kv_heads=2):
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, dim // heads
        self.q = torch.nn.Linear(dim, dim)
        self.kv = torch.nn.Linear(dim, 2 * kv_heads * self.hd)
        self.o = torch.nn.Linear(dim, dim)

    def forward(self, x, use_sdpa=False):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.heads, self.hd)
        k, v = self.kv(x).view(b, s, 2, self.kv_heads, self.hd).unbind(2)
        if use_sdpa:
            o = flashtile.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                enable_gqa=True).transpose(1, 2)
        else:
            o = flashtile.flash_attn_func(q, k, v, causal=True, window_size=(8, 0))
        return self.o(o.reshape(b, s, -1))


@pytest.mark.parametrize("use_sdpa", [False, True], ids=["flash_attn_func", "sdpa"])
def test_compile_fullgraph(use_sdpa, torch_backend, device):
    torch._dynamo.reset()
    model = TinyBlock().to(device)
    x = torch.randn(2, 33, 64, device=device)
    eager = model(x, use_sdpa)
    eager_grads = torch.autograd.grad(eager.sum(), list(model.parameters()))
    compiled = torch.compile(model, fullgraph=True)
    out = compiled(x, use_sdpa)
    grads = torch.autograd.grad(out.sum(), list(model.parameters()))
    torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-5)
    for a, b in zip(grads, eager_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_opcheck_varlen(torch_backend, device):
    q = torch.randn(12, 4, 16, device=device, requires_grad=True)
    k = torch.randn(15, 2, 16, device=device, requires_grad=True)
    v = torch.randn(15, 2, 16, device=device, requires_grad=True)
    cu_q = torch.tensor([0, 5, 12], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, 9, 15], dtype=torch.int32, device=device)
    torch.library.opcheck(custom_ops.varlen_attn_fwd,
                          (q, k, v, cu_q, cu_k, 7, 9, None, 0.25, -1, 0, 0.0, False))
