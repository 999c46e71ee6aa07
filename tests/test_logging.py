"""The first launch of each kernel variant logs one INFO line (logger 'flashtile')."""

import logging

import pytest
import torch

import flashtile
from flashtile.ops import configs


def test_one_line_per_new_variant(backend, device, caplog, monkeypatch):
    if backend != "triton":
        pytest.skip("the tiled PyTorch path compiles nothing")
    monkeypatch.setattr(configs, "_seen_variants", set())
    q = torch.randn(1, 20, 2, 16, device=device)
    with caplog.at_level(logging.INFO, logger="flashtile"):
        flashtile.flash_attn_func(q, q, q)
        flashtile.flash_attn_func(q, q, q)                          # same variant: quiet
        flashtile.flash_attn_func(q, q, q, causal=True)             # new variant
        flashtile.flash_attn_func(q, q, q, causal=True, softcap=2.0)  # new variant
    lines = [r.getMessage() for r in caplog.records if "compiling forward" in r.getMessage()]
    assert len(lines) == 3, lines
    assert "MASK_RIGHT" in lines[1] and "HAS_SOFTCAP" in lines[2]


def test_each_page_size_is_its_own_decode_variant(backend, device, caplog, monkeypatch):
    """The page size is a constexpr of the decode kernel: each one compiles, and logs."""
    if backend != "triton":
        pytest.skip("the tiled PyTorch path compiles nothing")
    monkeypatch.setattr(configs, "_seen_variants", set())
    q = torch.randn(1, 1, 2, 16, device=device)
    seqlens = torch.tensor([20], dtype=torch.int32, device=device)
    with caplog.at_level(logging.INFO, logger="flashtile"):
        for page in (16, 32):
            pool = torch.randn(4, page, 1, 16, device=device)
            table = torch.arange(64 // page, dtype=torch.int32, device=device)[None]
            flashtile.flash_attn_with_kvcache(q, pool, pool, cache_seqlens=seqlens,
                                              block_table=table)
    lines = [r.getMessage() for r in caplog.records if "compiling decode" in r.getMessage()]
    assert len(lines) == 2 and "PAGE_SIZE=16" in lines[0] and "PAGE_SIZE=32" in lines[1]
