"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3) over packed token batches.

One module for the four architectures, which differ only by switches read from
ModelConfig: ``qkv_bias`` (Qwen2), ``qk_norm`` (Qwen3's per-head RMSNorm of q and k before
the rotary embedding), ``sliding_window`` (Mistral). Inputs are packed, with no batch
dimension: ``input_ids`` and ``positions`` are (num_tokens,), and the step's
AttentionMetadata says where each sequence starts. q/k/v and gate/up are fused into one
matmul each; the loader splits Hugging Face's separate tensors into them.

With tensor parallelism (engine/parallel.py, ``tp`` of size > 1) each process holds its
slice of the heads, of the MLP's intermediate features and of the vocabulary; the
attention and the KV cache of a rank cover its own heads only.

The numerics follow transformers' modules (RMSNorm in fp32 then cast before the weight
multiply, rotary tables in fp32), so fp32 logits agree to rounding. On CUDA the
elementwise work (RMSNorm with the residual add, SiLU-and-multiply, the rotary embedding
with the cache write) runs in flashtile's Triton kernels (engine/layernorm.py,
activation.py, rope_store.py), elsewhere in their PyTorch references (``use_kernels``).
Steps of one or two tokens run the linears as a GEMV (engine/gemv.py), which can take
the norm before a product and SiLU-and-multiply in too: so each layer runs its norms
with the product after them (``normed_product``), and the MLP passes SiLU to the down
projection.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from flashtile.engine import activation, gemv, layernorm
from flashtile.engine.attention import Attention, AttentionMetadata
from flashtile.engine.config import ModelConfig
from flashtile.engine.parallel import SINGLE, MergedColumnParallelLinear, ParallelGroup, \
    ParallelLMHead, QKVParallelLinear, RowParallelLinear, VocabParallelEmbedding
from flashtile.engine.rope_store import rope_and_store, rotate_halves


def use_kernels(x) -> bool:
    """Whether the layers' elementwise work on tensors like x runs in flashtile's Triton
    kernels (CUDA); CPU runs keep the PyTorch references, whose logits tests compare with
    transformers' (a test forces the kernels on through the interpreter)."""
    return x.is_cuda


def _kernel_on_cuda(kernel, reference):
    def run(*args):
        return kernel(*args) if use_kernels(args[0]) else reference(*args)
    return run


# Triton kernels launched through plans (engine/layernorm.py, activation.py): one launch
# and a few microseconds of host time a call. The torch.compile'd references they
# replaced took 23-51 us of host time a call, and on the H200 a 0.5B prompt step of
# 8 x 1024 tokens 25.7 ms against the kernels' 17.7 ms.
rms_norm = _kernel_on_cuda(layernorm.rms_norm, layernorm.rms_norm_reference)
add_rms_norm = _kernel_on_cuda(layernorm.add_rms_norm, layernorm.add_rms_norm_reference)
silu_and_mul = _kernel_on_cuda(activation.silu_and_mul, activation.silu_and_mul_reference)


def rope(q, k, v, cos, sin, slot_mapping, attn):
    """(q, k, stored): rotated q and k, and whether k and v are in the pool already (not
    where attn's FP8 scales are still to be set from them: attn stores them then)."""
    if use_kernels(q):
        k_cache = None if attn.calibrate else attn.k_cache
        return (*rope_and_store(q, k, v, cos, sin, slot_mapping, k_cache, attn.v_cache,
                                attn.k_scale, attn.v_scale), k_cache is not None)
    return rotate_halves(q, cos, sin), rotate_halves(k, cos, sin), False


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x, residual=None):
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return add_rms_norm(x, residual, self.weight, self.eps)


def normed_product(proj, norm: RMSNorm, x, residual):
    """(proj(norm(x + residual)), x + residual), x itself for the residual where it is
    None. Where the step's product runs as a GEMV (engine/gemv.py, ``fuses``) the add
    and the norm run inside it: one kernel instead of two."""
    if gemv.fuses(x, proj.weight, proj.bias, norm.weight):
        return gemv.gemv_norm(x, residual, norm.weight, norm.eps, proj.weight, proj.bias)
    if residual is None:
        return proj(norm(x)), x
    x, residual = norm(x, residual)
    return proj(x), residual


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies (head_dim / 2,) fp32 for rope types default, linear, llama3."""
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float) / d))
    scaling = config.rope_scaling
    if scaling["rope_type"] == "linear":
        return inv_freq / scaling["factor"]
    if scaling["rope_type"] == "llama3":
        # Llama 3.1: long wavelengths slowed by `factor`, short ones kept, a smooth blend
        # between the two bands.
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, blended, scaled)
    return inv_freq


class Rotary(nn.Module):
    """cos/sin of every position up to max_len, built once on the model's device."""

    def __init__(self, config: ModelConfig, max_len: int):
        super().__init__()
        self.config, self.max_len = config, max_len
        self.cos = self.sin = None

    def build(self, device):
        inv_freq = rope_inv_freq(self.config).to(device)
        freqs = torch.arange(self.max_len, device=device, dtype=torch.float)[:, None] * inv_freq
        self.cos, self.sin = freqs.cos(), freqs.sin()                  # (max_len, d / 2)

    def forward(self, positions):
        return self.cos[positions], self.sin[positions]


class SelfAttention(nn.Module):
    def __init__(self, config: ModelConfig, backend: str, tp: ParallelGroup = SINGLE):
        super().__init__()
        d = config.head_dim
        self.qkv_proj = QKVParallelLinear(config.hidden_size, config.num_attention_heads,
                                          config.num_key_value_heads, d, config.qkv_bias, tp)
        h, hkv = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads  # this rank's
        self.sizes = [h * d, hkv * d, hkv * d]
        self.heads, self.kv_heads, self.head_dim = h, hkv, d
        self.o_proj = RowParallelLinear(config.num_attention_heads * d, config.hidden_size,
                                        bias=False, tp=tp)
        if config.qk_norm:
            self.q_norm = RMSNorm(d, config.rms_norm_eps)
            self.k_norm = RMSNorm(d, config.rms_norm_eps)
        window = config.sliding_window
        self.attn = Attention(h, hkv, d, window_left=window - 1 if window else -1,
                              backend=backend)

    def forward(self, qkv, cos, sin, meta: AttentionMetadata):
        """qkv: qkv_proj's output (the layer runs it, with the norm before it)."""
        q, k, v = qkv.split(self.sizes, dim=-1)
        q = q.view(-1, self.heads, self.head_dim)
        k = k.view(-1, self.kv_heads, self.head_dim)
        v = v.view(-1, self.kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        attn = self.attn
        # On CUDA one kernel for the rotary embedding and this layer's cache write (three
        # otherwise: a decode step at small batch pays per kernel).
        q, k, stored = rope(q, k, v, cos, sin, meta.slot_mapping, attn)
        return self.o_proj(attn(q, k, v, meta, stored=stored).flatten(1))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, tp: ParallelGroup = SINGLE):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size,
                                                       config.intermediate_size, tp)
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size,
                                           bias=False, tp=tp)

    def forward(self, gate_up):
        """gate_up: gate_up_proj's output (the layer runs it, with the norm before it)."""
        if gemv.fuses(gate_up, self.down_proj.weight, self.down_proj.bias):
            return self.down_proj(gate_up, gemv.gemv_silu)
        return self.down_proj(silu_and_mul(gate_up))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, backend: str, tp: ParallelGroup = SINGLE):
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.self_attn = SelfAttention(config, backend, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)
        self.mlp = MLP(config, tp)

    def forward(self, x, residual, cos, sin, meta):
        """x: the previous layer's output; residual: the stream before it (None at the
        first layer). Returns the same pair: each add is fused into the next norm."""
        qkv, residual = normed_product(self.self_attn.qkv_proj, self.input_layernorm, x,
                                       residual)
        x = self.self_attn(qkv, cos, sin, meta)
        gate_up, residual = normed_product(self.mlp.gate_up_proj,
                                           self.post_attention_layernorm, x, residual)
        return self.mlp(gate_up), residual


class Backbone(nn.Module):
    """Hugging Face's ``model.*`` submodule: embeddings, layers, final norm."""

    def __init__(self, config: ModelConfig, backend: str, tp: ParallelGroup = SINGLE):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(config, backend, tp)
                                    for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class CausalLM(nn.Module):
    """Parameter names match the checkpoints' (``model.layers.N.self_attn...``) except the
    fused ``qkv_proj`` and ``gate_up_proj`` (engine/loader.py maps them). tp: the ranks
    the model is split over (engine/parallel.py); every rank computes the full logits."""

    def __init__(self, config: ModelConfig, max_len: int, backend: str = "flashtile",
                 tp: ParallelGroup = SINGLE):
        super().__init__()
        self.config, self.tp = config, tp
        self.model = Backbone(config, backend, tp)
        self.rotary = Rotary(config, max_len)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp)
        self.tie_weights()

    def tie_weights(self):
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def forward(self, input_ids, positions, meta: AttentionMetadata):
        """Hidden states (num_tokens, hidden_size) after the final norm."""
        cos, sin = self.rotary(positions)
        x, residual = self.model.embed_tokens(input_ids), None
        for layer in self.model.layers:
            x, residual = layer(x, residual, cos, sin, meta)
        return self.model.norm(x, residual)[0]

    def compute_logits(self, hidden):
        """Logits (rows, vocab_size) for the given rows only (the runner passes each
        sequence's last token, so the vocabulary matmul skips the rest)."""
        return self.lm_head(hidden)
