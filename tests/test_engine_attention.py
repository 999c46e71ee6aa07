"""The engine's attention layer on each backend against a float64 reference: a decode
step and a prefill chunk over keys already in the pool, GQA, a sliding window, sequences
of different lengths in scattered pages."""

import pytest
import torch

from flashtile.engine.attention import Attention, AttentionMetadata

H, HKV, D = 6, 2, 16


def _reference(q, keys, values, q_pos, window_left):
    """q (Lq, H, d) at positions q_pos over keys/values (Lk, Hkv, d), float64."""
    g = H // HKV
    k = keys.double().repeat_interleave(g, dim=1)
    v = values.double().repeat_interleave(g, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) / D ** 0.5
    k_pos = torch.arange(keys.shape[0])
    allowed = k_pos <= q_pos[:, None]
    if window_left >= 0:
        allowed &= k_pos > q_pos[:, None] - window_left - 1
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


@pytest.mark.parametrize("window_left", [-1, 7])
@pytest.mark.parametrize("backend", ["flashtile", "sdpa", "naive"])
@pytest.mark.parametrize("new", [1, 3], ids=["decode", "chunk"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_attention_backends_match_reference(backend, window_left, new, device):
    torch.manual_seed(0)
    key_lens = [5, 17, 40]  # after this step's new tokens
    ps = 64 if backend == "naive" else 16  # naive: one max_model_len slab per sequence
    pages = [-(-n // ps) for n in key_lens]
    num_blocks = sum(pages) + 3
    layer = Attention(H, HKV, D, window_left=window_left, backend=backend)
    layer.k_cache = torch.randn(num_blocks + 1, ps, HKV, D)
    layer.v_cache = torch.randn(num_blocks + 1, ps, HKV, D)
    order = torch.randperm(num_blocks)  # each sequence's pages scattered over the pool
    tables, used = [], 0
    for n in pages:
        tables.append(order[used:used + n].tolist())
        used += n
    width = max(pages)
    block_tables = torch.tensor([t + [num_blocks] * (width - len(t)) for t in tables],
                                dtype=torch.int32)
    slots, key_slots = [], []
    for t, n in zip(tables, key_lens):
        seq_slots = [t[i // ps] * ps + i % ps for i in range(n)]
        slots += seq_slots[n - new:]
        key_slots += seq_slots
    q = torch.randn(len(key_lens) * new, H, D)
    k, v = torch.randn(len(key_lens) * new, HKV, D), torch.randn(len(key_lens) * new, HKV, D)
    qlens = [new] * len(key_lens)
    cu = lambda xs: torch.tensor([0] + torch.tensor(xs).cumsum(0).tolist(), dtype=torch.int32)
    meta = AttentionMetadata(
        cu_seqlens_q=cu(qlens), cu_seqlens_k=cu(key_lens), max_seqlen_q=new,
        max_seqlen_k=max(key_lens), slot_mapping=torch.tensor(slots),
        cache_seqlens=torch.tensor(key_lens, dtype=torch.int32), block_tables=block_tables,
        is_decode=new == 1, has_context=True, query_lens=qlens, key_lens=key_lens,
        key_slots=torch.tensor(key_slots))
    layer.k_cache, layer.v_cache = layer.k_cache.to(device), layer.v_cache.to(device)
    meta = AttentionMetadata(**{f: getattr(meta, f).to(device) if isinstance(
        getattr(meta, f), torch.Tensor) else getattr(meta, f) for f in meta.__dataclass_fields__})
    out = layer(q.to(device), k.to(device), v.to(device), meta).cpu()
    layer.k_cache, layer.v_cache = layer.k_cache.cpu(), layer.v_cache.cpu()
    flat_k = layer.k_cache.view(-1, HKV, D)
    flat_v = layer.v_cache.view(-1, HKV, D)
    for b, (t, n) in enumerate(zip(tables, key_lens)):
        idx = torch.tensor([t[i // ps] * ps + i % ps for i in range(n)])
        want = _reference(q[b * new:(b + 1) * new], flat_k[idx], flat_v[idx],
                          torch.arange(n - new, n), window_left)
        torch.testing.assert_close(out[b * new:(b + 1) * new].double(), want,
                                   atol=1e-5, rtol=1e-5)
