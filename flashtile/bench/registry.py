"""One registry of providers and sweeps for ``flashtile bench``, and the one FLOP count.

A provider is an attention implementation to time: a name, the input layout it takes,
where it can run, and ``build(cell, device) -> attn(q, k, v) -> out``. A sweep is the
grid of shapes: head dims x causal x modes x seqlens, at a fixed number of tokens
(batch * seqlen) and heads. ``Sweep.cells()`` lists one ``Cell`` per provider and shape.
To add either: docs/benchmarks/ADDING_A_BENCH.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashtile
from flashtile.reference import attention_naive

MODES = ("fwd", "fwd_bwd")


def attn_flops(batch: int, nheads: int, seqlen_q: int, seqlen_k: int, head_dim: int,
               causal: bool, mode: str) -> float:
    """FLOPs of one attention call, as every flashtile table counts them.

    4 * B * H * Nq * Nk * D: two matrix products (q k^T, then p v) of 2 FLOPs per
    multiply-add. x0.5 when causal (half the score matrix is kept), x3.5 for forward +
    backward (the backward's five products are 2.5x the forward's two).
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    flops = 4.0 * batch * nheads * seqlen_q * seqlen_k * head_dim
    return flops * (0.5 if causal else 1.0) * (3.5 if mode == "fwd_bwd" else 1.0)


@dataclass(frozen=True)
class Cell:
    """One measurement: ``provider`` at one shape; q/k/v are (batch, seqlen, nheads,
    head_dim) in flash-attn's layout (their transpose for SDPA)."""

    provider: str
    head_dim: int
    causal: bool
    mode: str  # "fwd" (no autograd) or "fwd_bwd" (forward, then grad of q, k and v)
    seqlen: int
    batch: int
    nheads: int
    dtype: torch.dtype

    def flops(self) -> float:
        return attn_flops(self.batch, self.nheads, self.seqlen, self.seqlen, self.head_dim,
                          self.causal, self.mode)

    def row(self) -> tuple:
        """The table row this cell belongs to (its columns are the providers)."""
        return (self.head_dim, self.causal, self.mode, self.seqlen)

    def label(self) -> str:
        return (f"{self.provider} d{self.head_dim} {'causal' if self.causal else 'full'} "
                f"{self.mode} N={self.seqlen}")


@dataclass(frozen=True)
class Provider:
    """An attention implementation to time.

    name: column name. layout: "bshd" (flash-attn: batch, seqlen, nheads, head_dim) or
    "bhsd" (SDPA: batch, nheads, seqlen, head_dim); the runner makes contiguous inputs
    in it. build(cell, device) returns attn(q, k, v) -> out, called once per cell so
    per-shape set-up (a block mask, a compile) stays out of the timing. devices: device
    types it runs on. max_seqlen: {device type: longest seqlen run}, for providers that
    hold the (B, H, N, N) score matrix. modes: the MODES it can time. prepare: turns
    each input set (q, k, v, dout) into what attn takes, once, outside the timing (the
    FP8 providers quantise there).
    """

    name: str
    layout: str
    build: Callable[[Cell, torch.device], Callable]
    devices: tuple[str, ...] = ("cuda", "cpu")
    max_seqlen: dict = field(default_factory=dict)
    about: str = ""
    modes: tuple[str, ...] = MODES
    prepare: Callable | None = None

    def skip_reason(self, cell: Cell, device: torch.device) -> str | None:
        if device.type not in self.devices:
            return f"runs on {'/'.join(self.devices)} only"
        if cell.mode not in self.modes:
            return f"{'/'.join(self.modes)} only"
        limit = self.max_seqlen.get(device.type)
        if limit is not None and cell.seqlen > limit:
            return f"seqlen > {limit} on {device.type}: holds the (B, H, N, N) scores"
        return None


PROVIDERS: dict[str, Provider] = {}


def register(provider: Provider) -> Provider:
    if provider.layout not in ("bshd", "bhsd"):
        raise ValueError(f"{provider.name}: layout must be 'bshd' or 'bhsd', got "
                         f"{provider.layout!r}")
    PROVIDERS[provider.name] = provider
    return provider


def _flashtile(cell, device):
    # Looked up at call time, so a test can patch flashtile.flash_attn_func.
    return lambda q, k, v: flashtile.flash_attn_func(q, k, v, causal=cell.causal)


def _naive(cell, device):
    return lambda q, k, v: attention_naive(q, k, v, causal=cell.causal, upcast=False)[0]


def _sdpa(backend):
    def build(cell, device):
        def attn(q, k, v):  # the backend is chosen in the forward; backward follows it
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=cell.causal)
        return attn
    return build


def _causal_mask(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx  # seqlen_q == seqlen_k here: top-left == bottom-right


def _flex(cell, device):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    # One static-shape compile per cell. Resetting dynamo first keeps its recompile
    # limit (8 per function) from sending later shapes to the slow eager fallback.
    torch._dynamo.reset()
    compiled = torch.compile(flex_attention, dynamic=False)
    block_mask = None
    if cell.causal:
        block_mask = create_block_mask(_causal_mask, B=None, H=None, Q_LEN=cell.seqlen,
                                       KV_LEN=cell.seqlen, device=device)
    return lambda q, k, v: compiled(q, k, v, block_mask=block_mask)


# The score matrix of the naive paths at 32k tokens per sequence is 32k^2 * H * 2 bytes
# (34 GB at bf16, H=16) before autograd keeps copies: they stop at 16k on GPU, and at
# 2k (naive) on a CPU with a few GB to spare.
for _p in (
    Provider("flashtile", "bshd", _flashtile, about="flashtile.flash_attn_func"),
    Provider("sdpa-cudnn", "bhsd", _sdpa(SDPBackend.CUDNN_ATTENTION), ("cuda",),
             about="SDPA, cuDNN backend"),
    Provider("sdpa-flash", "bhsd", _sdpa(SDPBackend.FLASH_ATTENTION),
             about="SDPA, flash backend (FlashAttention-2 on CUDA, PyTorch's fused "
                   "flash kernel on CPU)"),
    Provider("sdpa-efficient", "bhsd", _sdpa(SDPBackend.EFFICIENT_ATTENTION), ("cuda",),
             about="SDPA, memory-efficient (xformers) backend"),
    Provider("sdpa-math", "bhsd", _sdpa(SDPBackend.MATH), max_seqlen={"cuda": 16384},
             about="SDPA, math backend (PyTorch ops, scores in memory)"),
    Provider("flex", "bhsd", _flex,
             about="FlexAttention under torch.compile, causal block mask (forward only "
                   "on CPU, where torch has no backward for it)"),
    Provider("naive", "bshd", _naive, max_seqlen={"cuda": 16384, "cpu": 2048},
             about="flashtile.reference.attention_naive(upcast=False)"),
):
    register(_p)


@dataclass(frozen=True)
class Sweep:
    """The grid of a run. batch = max(1, tokens // seqlen); nheads = head_budget //
    head_dim (2048 // 128 = 16 on GPU), or ``nheads`` when head_budget is None."""

    providers: tuple[str, ...]
    head_dims: tuple[int, ...]
    seqlens: tuple[int, ...]
    causals: tuple[bool, ...] = (False, True)
    modes: tuple[str, ...] = MODES
    dtype: torch.dtype = torch.bfloat16
    tokens: int = 16384
    head_budget: int | None = 2048
    nheads: int = 4

    def heads(self, head_dim: int) -> int:
        if self.head_budget is None:
            return self.nheads
        return max(1, self.head_budget // head_dim)

    def cells(self) -> list[Cell]:
        unknown = [p for p in self.providers if p not in PROVIDERS]
        if unknown:
            raise ValueError(f"unknown provider(s) {unknown}; registered: "
                             f"{sorted(PROVIDERS)}")
        return [Cell(p, d, causal, mode, s, max(1, self.tokens // s), self.heads(d),
                     self.dtype)
                for d in self.head_dims for causal in self.causals
                for mode in self.modes for s in self.seqlens for p in self.providers]

    def settings(self) -> dict:
        return dict(providers=list(self.providers), head_dims=list(self.head_dims),
                    seqlens=list(self.seqlens), causal=list(self.causals),
                    modes=list(self.modes), dtype=str(self.dtype).replace("torch.", ""),
                    tokens=self.tokens, head_budget=self.head_budget,
                    nheads=self.nheads if self.head_budget is None else None)


ALL = tuple(PROVIDERS)


def _check_matches(out, lse, ref, ref_lse, rel=None):
    """Raise unless (out, lse) is finite and matches the reference kernel's within two
    rounding steps of out's dtype (relative to its largest value) and 1e-4 of lse: two
    correct kernels differ by their rounding only, a broken one by O(1). rel: the bound
    relative to the reference's largest value instead (FP8: the rounding of P)."""
    bound = (rel * ref.abs().max().item() if rel is not None
             else 2 * torch.finfo(out.dtype).eps * max(1.0, ref.abs().max().item()))
    err = (out.float() - ref.float()).abs().max().item()
    lse_err = (lse - ref_lse).abs().max().item()
    lse_bound = 1e-4 * max(1.0, ref_lse.abs().max().item())
    if not (torch.isfinite(out).all() and torch.isfinite(lse).all()) \
            or not err <= bound or not lse_err <= lse_bound:
        raise RuntimeError(f"output does not match the portable kernel's: max error {err:.3g} "
                           f"(bound {bound:.3g}), lse {lse_err:.3g} (bound {lse_bound:.3g})")


def _flashtile_hopper(cell, device):
    """The Gluon Hopper forward's launcher, validated on this cell's own inputs against the
    portable kernel before it is timed (issue 15: validate every timed configuration)."""
    from flashtile.bench.run import make_inputs
    from flashtile.ops import fwd, fwd_hopper

    kw = dict(attn_mask=None, alibi_slopes=None, softmax_scale=cell.head_dim ** -0.5,
              diag_offset=0, window_left=-1, window_right=0 if cell.causal else -1,
              softcap=0.0, allow_tf32=False)
    q, k, v, _ = make_inputs(cell, "bshd", device)[0]
    with torch.no_grad():
        _check_matches(*fwd_hopper.attn_fwd(q, k, v, **kw), *fwd.attn_fwd(q, k, v, **kw))
    return lambda q, k, v: fwd_hopper.attn_fwd(q, k, v, **kw)[0]


def _fp8_inputs(q, k, v, dout):
    """(x_fp8, descale) pairs in e4m3, a scale per (batch, head): flash-attn 3's inputs."""
    from flashtile.fp8 import quantize

    return (*(quantize(x) for x in (q, k, v)), dout)


def _flashtile_fp8(cell, device):
    return lambda q, k, v: flashtile.flash_attn_func(
        q[0], k[0], v[0], causal=cell.causal, q_descale=q[1], k_descale=k[1],
        v_descale=v[1])


def _flashtile_hopper_fp8(cell, device):
    """The Gluon Hopper forward on flashtile-fp8's inputs (e4m3, descales per (batch,
    head), bf16 out; V's keys-contiguous copy is part of each call, as there), validated
    on this cell's inputs against the portable FP8 kernel before it is timed: lse within
    1e-4, out within 2**-4 of its largest value (one e4m3 rounding of P; the two kernels
    round P from the same scores)."""
    from flashtile.bench.run import make_inputs
    from flashtile.ops import fwd, fwd_hopper

    kw = dict(attn_mask=None, alibi_slopes=None, softmax_scale=cell.head_dim ** -0.5,
              diag_offset=0, window_left=-1, window_right=0 if cell.causal else -1,
              softcap=0.0, allow_tf32=False, out_dtype=torch.bfloat16)

    def call(impl, q, k, v):
        return impl(q[0], k[0], v[0], q_descale=q[1], k_descale=k[1], v_descale=v[1], **kw)

    q, k, v, _ = _fp8_inputs(*make_inputs(cell, "bshd", device)[0])
    with torch.no_grad():
        _check_matches(*call(fwd_hopper.attn_fwd, q, k, v), *call(fwd.attn_fwd, q, k, v),
                       rel=2.0**-4)
    return lambda q, k, v: call(fwd_hopper.attn_fwd, q, k, v)[0]


def _flashtile_fp8_varlen(cell, device):
    """The same work through flash_attn_varlen_func (batch sequences of seqlen packed):
    V read as it is, transposed tile by tile in registers, where the dense call copies
    it keys-contiguous first. The pair says which FP8 P @ V layout is faster."""
    cu = torch.arange(0, (cell.batch + 1) * cell.seqlen, cell.seqlen, dtype=torch.int32,
                      device=device)
    return lambda q, k, v: flashtile.flash_attn_varlen_func(
        q[0].flatten(0, 1), k[0].flatten(0, 1), v[0].flatten(0, 1), cu, cu, cell.seqlen,
        cell.seqlen, causal=cell.causal, q_descale=q[1], k_descale=k[1], v_descale=v[1])


for _p in (
    Provider("flashtile-fp8", "bshd", _flashtile_fp8, ("cuda",), modes=("fwd",),
             prepare=_fp8_inputs,
             about="flashtile.flash_attn_func, FP8 e4m3 q/k/v with descales (quantised "
                   "outside the timing), bf16 out; FLOPs counted as for bf16"),
    Provider("flashtile-fp8-varlen", "bshd", _flashtile_fp8_varlen, ("cuda",),
             modes=("fwd",), prepare=_fp8_inputs,
             about="flashtile.flash_attn_varlen_func on the same FP8 inputs (V not "
                   "copied keys-contiguous)"),
):
    register(_p)

# Outside ALL: the default sweeps leave it out until it is timed on the GPU; name it
# with --providers.
register(Provider("flashtile-hopper", "bshd", _flashtile_hopper, ("cuda",), modes=("fwd",),
                  about="flashtile.ops.fwd_hopper (Gluon, FA3 schedule, sm_90) launcher, "
                        "forward only, validated against the portable kernel first"))
register(Provider("flashtile-hopper-fp8", "bshd", _flashtile_hopper_fp8, ("cuda",),
                  modes=("fwd",), prepare=_fp8_inputs,
                  about="flashtile.ops.fwd_hopper's launcher on flashtile-fp8's inputs, "
                        "validated against the portable FP8 kernel first"))
def _validated_fwd_bwd(cell, device, forward, backward, name):
    """``forward(q, k, v, **kw) -> (out, lse)`` and ``backward(dout, q, k, v, out, lse,
    **kw) -> (dq, dk, dv)`` as one autograd function, called through the launchers so
    that the pair can be timed beside "flashtile" in one run. Before it is timed, its
    gradients on this cell's inputs must match the portable split backward's within two
    rounding steps of their dtype (issue 15: validate what is timed)."""
    from flashtile.bench.run import make_inputs
    from flashtile.ops import bwd

    kw = dict(attn_mask=None, alibi_slopes=None, softmax_scale=cell.head_dim ** -0.5,
              diag_offset=0, window_left=-1, window_right=0 if cell.causal else -1,
              softcap=0.0, allow_tf32=False)

    class FwdBwd(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            out, lse = forward(q, k, v, **kw)
            ctx.save_for_backward(q, k, v, out, lse)
            return out

        @staticmethod
        def backward(ctx, dout):
            return backward(dout.contiguous(), *ctx.saved_tensors, **kw)

    q, k, v, dout = make_inputs(cell, "bshd", device)[0]
    with torch.no_grad():
        out, lse = forward(q, k, v, **kw)
        split = bwd.attn_bwd(dout, q, k, v, out, lse, None, fused=False, **kw)
        ours = backward(dout, q, k, v, out, lse, **kw)
    for grad, mine, ref in zip(("dq", "dk", "dv"), ours, split):
        bound = 2 * torch.finfo(ref.dtype).eps * max(1.0, ref.abs().max().item())
        err = (mine.float() - ref.float()).abs().max().item()
        if not (torch.isfinite(mine).all() and err <= bound):
            raise RuntimeError(f"{name}'s {grad} does not match the split backward's: "
                               f"max error {err:.3g} (bound {bound:.3g})")
    return FwdBwd.apply


def _flashtile_fused_bwd(cell, device):
    """flashtile's forward and its fused backward (what FLASHTILE_BWD=fused gives
    flash_attn_func with deterministic=False)."""
    from flashtile.ops import bwd, fwd

    return _validated_fwd_bwd(
        cell, device, fwd.attn_fwd,
        lambda dout, *saved, **kw: bwd.attn_bwd(dout, *saved, None, fused=True, **kw),
        "fused backward")


def _flashtile_hopper_bwd(cell, device):
    """flashtile's forward as flash_attn_func picks it (FLASHTILE_HOPPER_FWD) and the
    Gluon Hopper backward (what FLASHTILE_HOPPER_BWD=1 gives it); a call the Gluon
    backward declines is n/a, not the portable one timed under this name."""
    from flashtile import custom_ops
    from flashtile.ops import bwd_hopper

    def forward(q, k, v, **kw):
        return custom_ops._attn_fwd_impl(q, k, v, **kw)

    def backward(dout, q, k, v, out, lse, **kw):
        reason = bwd_hopper.unsupported(q, k, v, out, dout, **kw)
        if reason is not None:
            raise ValueError(f"flashtile.ops.bwd_hopper cannot run this call: {reason}")
        return bwd_hopper.backward(dout, q, k, v, out, lse, None, kw["softmax_scale"],
                                   kw["diag_offset"], causal=kw["window_right"] == 0)

    return _validated_fwd_bwd(cell, device, forward, backward, "Gluon Hopper backward")


# Outside ALL, as the Gluon forward: name it with --providers to A/B the backwards.
register(Provider("flashtile-fusedbwd", "bshd", _flashtile_fused_bwd, ("cuda",),
                  modes=("fwd_bwd",),
                  about="flashtile's forward + fused backward (FLASHTILE_BWD=fused) "
                        "launchers, gradients validated against the split backward first"))
register(Provider("flashtile-hopper-bwd", "bshd", _flashtile_hopper_bwd, ("cuda",),
                  modes=("fwd_bwd",),
                  about="flashtile's forward + flashtile.ops.bwd_hopper (Gluon, sm_90, "
                        "FLASHTILE_HOPPER_BWD=1), gradients validated against the split "
                        "backward first"))
# Attention dropout (training): flashtile's Philox mask in the kernels beside SDPA's
# backends that take dropout_p, at one rate. Outside ALL: name them with --providers.
DROPOUT_P = 0.1


def _flashtile_dropout(cell, device):
    return lambda q, k, v: flashtile.flash_attn_func(q, k, v, dropout_p=DROPOUT_P,
                                                     causal=cell.causal)


def _sdpa_dropout(backend):
    def build(cell, device):
        def attn(q, k, v):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, dropout_p=DROPOUT_P,
                                                      is_causal=cell.causal)
        return attn
    return build


for _p in (
    Provider("flashtile-dropout", "bshd", _flashtile_dropout, ("cuda",),
             about=f"flashtile.flash_attn_func with dropout_p={DROPOUT_P}"),
    Provider("sdpa-flash-dropout", "bhsd", _sdpa_dropout(SDPBackend.FLASH_ATTENTION),
             ("cuda",), about=f"SDPA, flash backend, dropout_p={DROPOUT_P}"),
    Provider("sdpa-cudnn-dropout", "bhsd", _sdpa_dropout(SDPBackend.CUDNN_ATTENTION),
             ("cuda",), about=f"SDPA, cuDNN backend, dropout_p={DROPOUT_P}"),
):
    register(_p)
# GPU: 512..16k for speed; 32k and 64k for the memory plot (naive and math skip them).
GPU_SWEEP = Sweep(ALL, (64, 128), tuple(2**i for i in range(9, 17)))
# CPU, 2 cores: fp32, d64, 4 heads, 4k tokens. Every provider that runs on CPU runs
# (SDPA's flash and math backends, Flex forward, naive); Flex compiles each forward
# cell (~10 s on 2 cores), most of the sweep's time.
CPU_SWEEP = Sweep(ALL, (64,), tuple(2**i for i in range(7, 13)), dtype=torch.float32,
                  tokens=4096, head_budget=None, nheads=4)
# Quick: a smoke run. On GPU every provider once per mode, causal (Flex's block mask);
# its two Flex compiles are most of the minute.
GPU_QUICK = Sweep(ALL, (128,), (2048,), causals=(True,))
CPU_QUICK = Sweep(("flashtile", "sdpa-math", "naive"), (32,), (64, 128),
                  dtype=torch.float32, tokens=256, head_budget=None, nheads=2)


def default_sweep(device: torch.device, quick: bool = False) -> Sweep:
    if torch.device(device).type == "cuda":
        return GPU_QUICK if quick else GPU_SWEEP
    return CPU_QUICK if quick else CPU_SWEEP
