"""Decode benchmark: one query token per sequence over a KV cache (issue 4's table).

bf16, 32 query heads over 8 KV heads, head_dim 128. Effective bandwidth = bytes of K and
V read / time, beside the device-copy ceiling and PyTorch SDPA (enable_gqa) in the same
run. The flashtile-fp8 providers read the same cache in float8_e4m3fn (bf16 queries,
k_descale/v_descale given): their bytes, and so their GB/s, are counted in FP8 bytes,
half the bf16 cache's. copy-fp8 copies K's FP8 bytes into another buffer, moving (read
plus written) as many bytes as flashtile-fp8 reads: the copy ceiling at this size, with a
kernel's ramp and tail, where the device-copy ceiling is a 1 GiB copy's. Every
provider is timed as a replayed CUDA graph (triton.testing.do_bench_cudagraph) so
Python launch overhead, which a serving engine also captures away, is not counted.

A cache smaller than the L2 (batch 1 x 8k keys: 34 MB against the H200's 60 MB) would
be read from the L2 the previous replay left warm, which no serving step sees (every
other layer's cache and weights pass through the L2 in between). So each provider's
step runs over enough copies of the inputs, in turn, to move three times the L2 per
round, and the time per step is the round's over the copies. ``warm_l2=True`` times
one copy (what tables before 2026-11-29's session 6 show).

A second table times the engine's decode calls (``run_engine_decode_rows``: flashtile
paged at the engine's page size, the 0.5B, 1B and 8B shapes' heads at batch 1 and 256
over 1k keys) with the tile and split count the launcher picks;
``python3 -m flashtile.bench.decode --engine`` runs it alone. (A sweep of those calls
over tiles and split counts, session 19, found the launcher's choice within 7% of the
fastest cell at every engine shape and was removed: docs/benchmarks/NOTES.md section 29.)
"""

from __future__ import annotations

import json
import math

import torch

SHAPES = [(1, 8192), (8, 8192), (32, 4096), (8, 32768), (1, 131072), (64, 2048)]
NHEADS, NHEADS_KV, HEAD_DIM = 32, 8, 128
# 64: a key tile lies in one page (one page lookup per tile); 16: a tile spans four
# pages (one lookup per page).
PAGE_SIZES = (64, 16)


def kv_bytes(batch, seqlen_k, element_size=2, nheads_kv=NHEADS_KV, head_dim=HEAD_DIM):
    return 2 * batch * seqlen_k * nheads_kv * head_dim * element_size


def provider_bytes(name, batch, seqlen_k):
    """The K/V bytes a provider reads: FP8 caches one byte an element."""
    return kv_bytes(batch, seqlen_k, 1 if "fp8" in name else 2)


def _decode_inputs(batch, seqlen_k, device, nheads=NHEADS, nheads_kv=NHEADS_KV,
                   head_dim=HEAD_DIM):
    """bf16 q (one token per sequence), a full contiguous K/V cache, its int32 lengths."""
    q = torch.randn(batch, 1, nheads, head_dim, device=device, dtype=torch.bfloat16)
    k = torch.randn(batch, seqlen_k, nheads_kv, head_dim, device=device,
                    dtype=torch.bfloat16)
    v = torch.randn_like(k)
    seqlens = torch.full((batch,), seqlen_k, dtype=torch.int32, device=device)
    return q, k, v, seqlens


def _providers(batch, seqlen_k, device):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import flashtile

    q, k, v, seqlens = _decode_inputs(batch, seqlen_k, device)
    paged = {size: _paged_pool(k, v, size) for size in PAGE_SIZES}
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def sdpa(backend):
        def run():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)
        return run

    # FP8: the same randn cache in e4m3 (within its range: descale 1, passed as a real
    # (batch, nheads_kv) tensor so the kernel loads it as a serving engine's would).
    k8, v8 = (x.to(torch.float8_e4m3fn) for x in (k, v))
    pool8 = (*(x.to(torch.float8_e4m3fn) for x in paged[64][:2]), paged[64][2])
    ones = torch.ones(batch, NHEADS_KV, device=device)
    fp8 = dict(k_descale=ones, v_descale=ones)
    refs = {"": flashtile.flash_attn_func(q, k, v),
            "fp8": flashtile.flash_attn_func(q, k8.to(q.dtype), v8.to(q.dtype))}
    return refs, {
        "flashtile": _kvcache_fn(q, seqlens, k, v),
        **{f"flashtile-paged{size}": _kvcache_fn(q, seqlens, *pool)
           for size, pool in paged.items()},
        "flashtile-fp8": _kvcache_fn(q, seqlens, k8, v8, **fp8),
        "flashtile-fp8-paged64": _kvcache_fn(q, seqlens, *pool8, **fp8),
        "copy-fp8": _copy_fn(k8.view(torch.uint8)),
        "sdpa-cudnn": sdpa(SDPBackend.CUDNN_ATTENTION),
        "sdpa-flash": sdpa(SDPBackend.FLASH_ATTENTION),
        "sdpa-efficient": sdpa(SDPBackend.EFFICIENT_ATTENTION),
    }


def _copy_fn(src):
    """A copy of src into a buffer of its own (no attention: nothing to check)."""
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)


def _paged_pool(k, v, page_size):
    """The cache's tokens in a pool of pages, in a random order."""
    batch, seqlen_k = k.shape[:2]
    pages = seqlen_k // page_size
    perm = torch.randperm(batch * pages, device=k.device).to(torch.int32)
    block_table = perm.view(batch, pages)
    shape = (batch * pages, page_size, *k.shape[2:])
    pool_k = torch.empty(shape, device=k.device, dtype=k.dtype)
    pool_v = torch.empty_like(pool_k)
    pool_k[block_table.long()] = k.view(batch, pages, *shape[1:])
    pool_v[block_table.long()] = v.view(batch, pages, *shape[1:])
    return pool_k, pool_v, block_table


def _kvcache_fn(q, seqlens, k_cache, v_cache, block_table=None, num_splits=0, **options):
    """A call of flash_attn_with_kvcache; options: its other arguments (FP8 descales,
    causal)."""
    import flashtile

    return lambda: flashtile.flash_attn_with_kvcache(q, k_cache, v_cache,
                                                     cache_seqlens=seqlens,
                                                     block_table=block_table,
                                                     num_splits=num_splits, **options)


def cache_copies(batch, seqlen_k, device, element_size=1, nheads_kv=NHEADS_KV,
                 head_dim=HEAD_DIM) -> int:
    """Input copies whose K/V together are at least three times the L2, counted in the
    smallest cache a provider reads (the FP8 one: 1 byte an element) so that no
    provider's round fits in the L2 (sessions up to 12 counted bf16 bytes: batch 1 x 8k
    rotated 6 copies, 100 MB of FP8 cache, 1.7 times the H200's L2)."""
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    return max(1, math.ceil(3 * l2 / kv_bytes(batch, seqlen_k, element_size, nheads_kv,
                                              head_dim)))


def in_turn(fns):
    """One call of each copy's step, in order (timed as one round)."""
    def run():
        for fn in fns:
            out = fn()
        return out
    return run


def time_rounds(steps, rounds=3, rep=100):
    """Microseconds per call of each step, one timing per round: {name: [us, ...]}.
    A step is a list of calls over input copies, timed as one CUDA graph round and
    divided by the copies. The steps are timed in turn within a round, so a step timed
    first (when the clocks may still be up) gains nothing from its place: batch 1 x 8k
    on the H200, the first timing of a script was 0.5-1 us faster than any later round
    (runs 29-40)."""
    import triton

    times = {name: [] for name in steps}
    for _round in range(rounds):
        for name, fns in steps.items():
            ms = triton.testing.do_bench_cudagraph(in_turn(fns), rep=rep,
                                                   return_mode="median")
            times[name].append(ms / len(fns) * 1e3)
    return times


def median(values):
    return sorted(values)[len(values) // 2]


def run_decode_bench(shapes=SHAPES, device="cuda", warm_l2=False, rounds=3):
    """Each provider's step in rounds (`time_rounds`), its median round kept."""
    rows = []
    for batch, seqlen_k in shapes:
        copies = 1 if warm_l2 else cache_copies(batch, seqlen_k, device)
        sets = [_providers(batch, seqlen_k, device) for _ in range(copies)]
        refs, providers = sets[0]
        row = dict(batch=batch, seqlen_k=seqlen_k, cache_gb=kv_bytes(batch, seqlen_k) / 1e9,
                   copies=copies)
        runnable = {}
        for name, fn in providers.items():
            try:
                out = fn()
                if name.startswith("copy"):
                    runnable[name] = [p[name] for _, p in sets]
                    continue
                if name.startswith("sdpa"):
                    out = out.transpose(1, 2)
                ref = refs["fp8" if "fp8" in name else ""]
                err = (out.float() - ref.float()).abs().max().item()
                if not err < 2e-2:
                    raise RuntimeError(f"wrong result, max error {err:.3g}")
                runnable[name] = [p[name] for _, p in sets]
            except Exception as e:  # a peer that cannot run this shape: n/a, go on
                row[name] = dict(error=f"{type(e).__name__}: {str(e)[:80]}")
        for name, us in time_rounds(runnable, rounds).items():
            row[name] = dict(us=median(us),
                             gbps=provider_bytes(name, batch, seqlen_k) / median(us) / 1e3,
                             rounds_us=[round(t, 2) for t in us])
        row = {k: row[k] for k in ("batch", "seqlen_k", "cache_gb", "copies", *providers)}
        rows.append(row)
        print(json.dumps(row), flush=True)
        del providers, sets, runnable
        torch.cuda.empty_cache()
    return rows


def decode_markdown(rows, copy_gbps=None):
    """One row per shape: the input copies a timed round rotates through, each
    provider's time and bandwidth (FP8 providers in FP8 bytes), the share of the copy
    ceiling of flashtile and of its FP8 cache, flashtile's ratio to the best SDPA
    backend, and each paged variant's time over the contiguous cache's (the paged
    overhead)."""
    names = [k for k in rows[0] if k not in ("batch", "seqlen_k", "cache_gb", "copies")]
    paged = [n for n in names if n.startswith("flashtile-paged")]
    ceiling = [n for n in ("flashtile", "flashtile-fp8") if n in names]
    lines = ["| batch | seqlen_k | KV GB | copies | " + " | ".join(f"{n} us (GB/s)" for n in names)
             + "".join(f" | {n} % of copy" for n in ceiling) + " | flashtile / best SDPA | "
             + "".join(f"{n} / flashtile time | " for n in paged).rstrip(),
             "|---" * (5 + len(ceiling) + len(names) + len(paged)) + "|"]
    for r in rows:
        cells = []
        for n in names:
            c = r[n]
            cells.append("n/a" if "error" in c else f"{c['us']:.1f} ({c['gbps']:.0f})")
        ours = r["flashtile"].get("gbps")
        sdpa = [r[n]["gbps"] for n in names if n.startswith("sdpa") and "gbps" in r[n]]
        pct = [f"{100 * r[n]['gbps'] / copy_gbps:.0f}%" if "gbps" in r[n] and copy_gbps
               else "n/a" for n in ceiling]
        ratio = f"{ours / max(sdpa):.2f}" if ours and sdpa else "n/a"
        overhead = [f"{r[n]['us'] / r['flashtile']['us']:.2f}"
                    if "us" in r[n] and ours else "n/a" for n in paged]
        lines.append(f"| {r['batch']} | {r['seqlen_k']} | {r['cache_gb']:.2f} | "
                     f"{r.get('copies', 1)} | "
                     + " | ".join(cells + pct + [ratio] + overhead) + " |")
    return "\n".join(lines)


# The engine's decode calls (flashtile.engine: pages of 64 keys, one query token per
# sequence): Qwen2.5-0.5B (14 query heads over 2 KV heads), Llama-3.2-1B (32/8) and
# Llama-3-8B (32/8, d128), at `bench throughput --decode-step`'s batches of 1k keys.
ENGINE_SHAPES = (("qwen2.5-0.5b", 14, 2, 64), ("llama-3.2-1b", 32, 8, 64),
                 ("llama-3-8b", 32, 8, 128))
ENGINE_BATCHES = ((1, 1024), (256, 1024))
ENGINE_PAGE = 64


def _decode_launch(q, k_cache, v_cache, block_table):
    """(tile, programs, splits) of a paged decode launch as attn_decode plans it (the
    split heuristic; the tile's rows are query heads per KV head, GQA packing)."""
    from flashtile.ops import configs
    from flashtile.ops import decode as ops

    hkv, d = k_cache.shape[2], q.shape[-1]
    cfg = ops._tile(q, k_cache, v_cache, False)
    work = q.shape[0] * hkv * ops._row_programs(q, hkv, cfg)
    splits = ops.split_plan(work, block_table.shape[1] * k_cache.shape[1], cfg.block_n,
                            k_cache.shape[1], 0, ops._num_sms(q), False,
                            configs.decode_programs_per_sm(d, cfg))[0]
    if splits == 1:
        cfg = ops._tile(q, k_cache, v_cache, False, split=False)
    return cfg, work * splits, splits


def run_engine_decode_rows(device="cuda"):
    """flashtile's paged decode at the engine's shapes (ENGINE_SHAPES x ENGINE_BATCHES)
    over cold input copies, each checked against the contiguous cache's output first."""
    import flashtile

    rows = []
    for model, h, hkv, d in ENGINE_SHAPES:
        for batch, seqlen_k in ENGINE_BATCHES:
            nbytes = kv_bytes(batch, seqlen_k, 2, hkv, d)
            fns = []
            for i in range(cache_copies(batch, seqlen_k, device, 2, hkv, d)):
                q, k, v, seqlens = _decode_inputs(batch, seqlen_k, device, h, hkv, d)
                pool = _paged_pool(k, v, ENGINE_PAGE)
                fns.append(_kvcache_fn(q, seqlens, *pool))
                if i == 0:
                    err = (fns[0]().float() - flashtile.flash_attn_func(q, k, v).float()
                           ).abs().max().item()
                    if not err < 2e-2:
                        raise RuntimeError(f"engine decode {model} b={batch}: max error "
                                           f"{err:.3g}")
                    cfg, programs, splits = _decode_launch(q, *pool)
                del k, v
            us = median(time_rounds({"engine": fns})["engine"])
            row = dict(model=model, heads=h, kv_heads=hkv, head_dim=d, batch=batch,
                       seqlen_k=seqlen_k, cache_gb=nbytes / 1e9, copies=len(fns),
                       tile=f"{cfg.block_m}x{cfg.block_n},{cfg.num_warps},{cfg.num_stages}",
                       programs=programs, splits=splits, us=round(us, 2),
                       gbps=round(nbytes / us / 1e3))
            rows.append(row)
            print(json.dumps(row), flush=True)
            del fns
            torch.cuda.empty_cache()
    return rows


def engine_decode_markdown(rows, copy_gbps=None):
    """One row per engine shape and batch: the tile (query rows x keys, warps, stages),
    the programs of the decode kernel over its splits (a split decode is two kernels:
    the decode and the combine), the time, the bandwidth and its share of the copy's."""
    lines = ["| model | heads / KV heads, d | batch | seqlen_k | KV GB | copies | tile "
             "| programs (splits) | kernels | us | GB/s | % of copy |", "|---" * 12 + "|"]
    for r in rows:
        pct = f"{100 * r['gbps'] / copy_gbps:.0f}%" if copy_gbps else "n/a"
        lines.append(f"| {r['model']} | {r['heads']} / {r['kv_heads']}, {r['head_dim']} "
                     f"| {r['batch']} | {r['seqlen_k']} | {r['cache_gb']:.3f} "
                     f"| {r['copies']} | {r['tile']} | {r['programs']} ({r['splits']}) "
                     f"| {1 + (r['splits'] > 1)} | {r['us']:.1f} | {r['gbps']} | {pct} |")
    return "\n".join(lines)


def sweep_decode_tiles(shapes=((1, 8192), (8, 32768)),
                       tiles=("16,64,4,3", "16,128,4,3", "16,64,4,4"),
                       splits=(0, 1, 8, 32, 64), page_sizes=(None,), device="cuda",
                       fp8=False, env=None):
    """flashtile's decode over num_splits and tile candidates (None: the launcher's
    own tile; page_size None: the contiguous cache), each step rotating through cold
    input copies as the table does: the data for the split heuristic and the tile
    choice. fp8: the caches in float8_e4m3fn with descales (bf16 queries), GB/s
    counted in FP8 bytes. env: environment variables set for the sweep (a kernel
    variant such as FLASHTILE_DECODE_FP8_KEYS_M=1), removed after it."""
    import os

    import triton

    from flashtile.ops import _launch

    env = env or {}
    os.environ.update(env)
    label = "".join(f" {k}={v}" for k, v in env.items())

    size = 1 if fp8 else 2
    scales = {}
    results = []
    for batch, seqlen_k in shapes:
        sets = []
        for _ in range(cache_copies(batch, seqlen_k, device, element_size=size)):
            q, k, v, seqlens = _decode_inputs(batch, seqlen_k, device)
            caches = {ps: (k, v, None) if ps is None else _paged_pool(k, v, ps)
                      for ps in page_sizes}
            if fp8:
                caches = {ps: (*(x.to(torch.float8_e4m3fn) for x in c[:2]), c[2])
                          for ps, c in caches.items()}
                ones = torch.ones(batch, NHEADS_KV, device=device)
                scales = dict(k_descale=ones, v_descale=ones)
            sets.append((q, seqlens, caches))
        for tile in tiles:
            if tile is None:
                os.environ.pop("FLASHTILE_DECODE_CONFIG", None)
            else:
                os.environ["FLASHTILE_DECODE_CONFIG"] = tile
            # Launch plans keep the tile (and the switches) they were made with.
            _launch.clear()
            for ps in page_sizes:
                for n in splits:
                    fns = [_kvcache_fn(q, seqlens, *caches[ps], num_splits=n, **scales)
                           for q, seqlens, caches in sets]
                    try:
                        ms = triton.testing.do_bench_cudagraph(
                            in_turn(fns), rep=50, return_mode="median") / len(fns)
                        gbps = round(kv_bytes(batch, seqlen_k, size) / ms / 1e6)
                    except Exception as e:
                        gbps = type(e).__name__
                    results.append((batch, seqlen_k, tile, ps, n, gbps, label.strip()))
                    print(f"decode sweep{' fp8' if fp8 else ''}{label} b={batch} "
                          f"sk={seqlen_k} tile={tile or 'default'} "
                          f"page={ps or 'contiguous'} splits={n}: {gbps} GB/s", flush=True)
        os.environ.pop("FLASHTILE_DECODE_CONFIG", None)
        del sets
        torch.cuda.empty_cache()
    for name in env:
        os.environ.pop(name, None)
    _launch.clear()
    return results


# Absorbed MLA decode (DeepSeek-V3): query heads over one latent KV head of 576 dims (512
# latent + 64 rope), values the first 512 of the same rows; pages of 64 keys. 128 heads is
# the model's, 16 one GPU's share under 8-way tensor parallelism.
MLA_SHAPES = [(1, 8192), (1, 32768), (32, 4096), (64, 8192)]
MLA_HEADS = (16, 128)
MLA_D, MLA_DV, MLA_PAGE = 576, 512, 64


def _mla_inputs(batch, seqlen_k, heads, device):
    """q (batch, 1, heads, 576), a paged latent pool in random page order, its
    block_table and lengths, and a float32 reference output."""
    q = torch.randn(batch, 1, heads, MLA_D, device=device, dtype=torch.bfloat16)
    latent = torch.randn(batch, seqlen_k, 1, MLA_D, device=device, dtype=torch.bfloat16)
    pages = seqlen_k // MLA_PAGE
    table = torch.randperm(batch * pages, device=device).to(torch.int32).view(batch, pages)
    pool = torch.empty(batch * pages, MLA_PAGE, 1, MLA_D, device=device, dtype=q.dtype)
    pool[table.long()] = latent.view(batch, pages, MLA_PAGE, 1, MLA_D)
    seqlens = torch.full((batch,), seqlen_k, dtype=torch.int32, device=device)
    scores = torch.einsum("bhd,bkd->bhk", q[:, 0].float(), latent[:, :, 0].float())
    ref = torch.einsum("bhk,bkd->bhd", (scores * MLA_D ** -0.5).softmax(-1),
                       latent[:, :, 0, :MLA_DV].float())[:, None]
    return q, pool, table, seqlens, ref


def run_mla_bench(shapes=MLA_SHAPES, heads=MLA_HEADS, device="cuda"):
    """flashtile's absorbed MLA decode over cold input copies: microseconds, the latent
    cache's GB/s (576 bf16 dims a key, read once) and TFLOP/s (2 * heads * keys *
    (576 + 512) a sequence), each output checked against float32 first."""
    import flashtile

    rows = []
    for h in heads:
        for batch, seqlen_k in shapes:
            cache_bytes = batch * seqlen_k * MLA_D * 2
            copies = max(1, math.ceil(3 * torch.cuda.get_device_properties(
                device).L2_cache_size / cache_bytes))
            fns = []
            for _ in range(copies):
                q, pool, table, seqlens, ref = _mla_inputs(batch, seqlen_k, h, device)
                fn = (lambda q=q, pool=pool, table=table, seqlens=seqlens:
                      flashtile.flash_attn_with_kvcache(
                          q, pool, pool[..., :MLA_DV], cache_seqlens=seqlens,
                          block_table=table))
                err = (fn().float() - ref).abs().max().item()
                if not err < 2e-2:
                    raise RuntimeError(f"MLA decode b={batch} sk={seqlen_k} h={h}: "
                                       f"max error {err:.3g}")
                fns.append(fn)
                del ref
            us = median(time_rounds({"mla": fns})["mla"])
            flops = 2 * batch * h * seqlen_k * (MLA_D + MLA_DV)
            row = dict(heads=h, batch=batch, seqlen_k=seqlen_k, us=round(us, 2),
                       gbps=round(cache_bytes / us / 1e3), tflops=round(flops / us / 1e6, 1))
            rows.append(row)
            print(json.dumps(row), flush=True)
            del fns
            torch.cuda.empty_cache()
    return rows


if __name__ == "__main__":
    import sys

    from flashtile.bench.machine import ceilings

    # `flashtile bench --decode` is the command; this entry point adds the tile sweep.
    copy = ceilings(torch.device("cuda"))[0]["copy_bytes_per_s"] / 1e9
    print(f"# device copy {copy:.0f} GB/s ({torch.cuda.get_device_name()})")
    if "--sweep" in sys.argv:
        sweep_decode_tiles()
    if "--sweep-splits-paged" in sys.argv:
        # Short walks under the per-row page lookup: does a longer walk per split pay?
        sweep_decode_tiles(shapes=((1, 8192), (8, 8192)), tiles=("16,64,4,3", "16,64,4,2"),
                           splits=(0, 8, 16, 24, 48), page_sizes=(None, 16))
    if "--sweep-splits" in sys.argv:
        # The split count of the split shapes (0: the heuristic's), batch 1 and batch 8.
        sweep_decode_tiles(shapes=((1, 8192), (1, 131072)), tiles=("16,64,4,3",),
                           splits=(0, 16, 24, 32, 40, 48, 64))
        sweep_decode_tiles(shapes=((8, 8192), (8, 32768)), tiles=("16,64,4,3",),
                           splits=(0, 4, 5, 6, 7, 8, 10, 12, 16))
    if "--sweep-paged" in sys.argv:
        # Small pages: 16-key tiles (one page each, deeper pipelining) against 32-128-key
        # tiles of several pages, the contiguous cache beside each.
        sweep_decode_tiles(shapes=((1, 8192), (32, 4096), (64, 2048)),
                           tiles=("16,16,4,4", "16,16,4,6", "16,32,4,4", "16,64,4,3",
                                  "16,64,4,4", "16,128,4,3"),
                           splits=(0,), page_sizes=(16, None))
    if "--sweep-fp8" in sys.argv:
        # FP8 cache tiles (issue 17) in the layout with query rows on the products' M
        # side (FLASHTILE_DECODE_FP8_KEYS_M=0): 128-key tiles at 3 and 4 stages against
        # 64-key ones, split and unsplit shapes, contiguous and paged.
        rows_m = {"FLASHTILE_DECODE_FP8_KEYS_M": "0"}
        sweep_decode_tiles(shapes=((8, 32768), (32, 4096), (1, 131072)),
                           tiles=("16,128,4,3", "16,128,4,4", "16,64,4,3", "16,64,4,5",
                                  "16,256,4,3"),
                           splits=(0,), page_sizes=(None, 64), fp8=True, env=rows_m)
        # The default KEYS_M layout (keys on the products' M side, 8 query rows as N:
        # 441 instructions a 128-key tile against 722, sm_90 SASS; 2-5% ahead in
        # session 14), the launcher's tile beside the other layout's in the same run,
        # then other depths and 256-key tiles, and split counts for 8 x 8k (its 83% of
        # copy is the row below issue 17's 90%: 39 us a step, where fixed costs show).
        for env in (rows_m, {}):
            sweep_decode_tiles(shapes=((8, 8192), (8, 32768), (32, 4096), (1, 131072),
                                       (64, 2048)),
                               tiles=(None,), splits=(0,), page_sizes=(None, 64),
                               fp8=True, env=env)
        sweep_decode_tiles(shapes=((8, 8192), (8, 32768), (32, 4096)),
                           tiles=("8,128,4,4", "8,128,4,5", "8,256,4,3"), splits=(0,),
                           page_sizes=(None, 64), fp8=True)
        sweep_decode_tiles(shapes=((8, 8192),), tiles=(None, "8,256,4,3"),
                           splits=(1, 2, 4, 8, 16), page_sizes=(None, 64), fp8=True)
    if "--mla" in sys.argv:
        # Absorbed MLA decode alone (issue 17): the table below is not run.
        for r in run_mla_bench():
            print(f"| MLA {r['heads']} heads | b={r['batch']} | sk={r['seqlen_k']} | "
                  f"{r['us']} us | {r['gbps']} GB/s ({100 * r['gbps'] / copy:.0f}% of copy) "
                  f"| {r['tflops']} TFLOP/s |")
        sys.exit(0)
    json_out = [a for a in sys.argv[1:] if a.endswith(".json")]
    def save(**tables):
        if json_out:
            with open(json_out[0], "w") as f:
                json.dump(dict(copy_gbps=copy, **tables), f, indent=1)

    # --engine: the engine's shapes alone. Otherwise they follow the table, which is
    # printed and saved first: a caller's time limit that ends the run in the engine
    # rows (the decode stage's 150 s) loses only them.
    rows = []
    if "--engine" not in sys.argv:
        rows = run_decode_bench(warm_l2="--warm-l2" in sys.argv)
        print(decode_markdown(rows, copy))
        save(rows=rows)
    engine_rows = run_engine_decode_rows()
    print(engine_decode_markdown(engine_rows, copy))
    save(rows=rows, engine_rows=engine_rows)
