"""EngineConfig (vLLM's argument names) and ModelConfig (read from a checkpoint's config.json).

ModelConfig normalises the few ways Hugging Face checkpoints spell the same thing: rotary
settings under ``rope_parameters`` (transformers 5) or ``rope_theta`` + ``rope_scaling``
(older, with the type under ``rope_type`` or ``type``), the dtype under ``dtype`` or
``torch_dtype``, ``head_dim`` given or derived.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field, replace
from typing import Optional

import torch

from flashtile._validate import _fail
from flashtile.engine.parallel import check_model_split

# Architecture name in config.json -> the switches of engine/model.py it needs.
ARCHITECTURES = {
    "LlamaForCausalLM": dict(qkv_bias=False, qk_norm=False),
    "MistralForCausalLM": dict(qkv_bias=False, qk_norm=False),
    "Qwen2ForCausalLM": dict(qkv_bias=True, qk_norm=False),
    "Qwen3ForCausalLM": dict(qkv_bias=False, qk_norm=True),
}
MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
               "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
ROPE_TYPES = ("default", "llama3", "linear")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16,
          "half": torch.float16, "float": torch.float32}
BACKENDS = ("flashtile", "sdpa", "naive")
# kv_cache_dtype (vLLM's names): "auto" is the model's dtype; "fp8" is e4m3.
KV_CACHE_DTYPES = {"auto": None, "fp8": torch.float8_e4m3fn,
                   "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
LOAD_FORMATS = ("auto", "dummy")


def _rope(cfg: dict) -> tuple[float, dict]:
    """(rope_theta, scaling dict with a "rope_type" key) from either spelling."""
    params = dict(cfg.get("rope_parameters") or {})
    legacy = dict(cfg.get("rope_scaling") or {})
    theta = params.pop("rope_theta", cfg.get("rope_theta", 10000.0))
    scaling = params or legacy
    rope_type = scaling.pop("rope_type", scaling.pop("type", "default"))
    if rope_type not in ROPE_TYPES:
        _fail(ValueError, "config.json rope type", f"one of {ROPE_TYPES}", repr(rope_type))
    return float(theta), dict(scaling, rope_type=rope_type)


@dataclass(frozen=True)
class ModelConfig:
    """The model's shape, as engine/model.py needs it."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    sliding_window: Optional[int]  # keys a query sees, itself included (Mistral); None: all
    dtype: Optional[torch.dtype]
    eos_token_ids: tuple[int, ...]
    initializer_range: float = 0.02

    @classmethod
    def from_dict(cls, cfg: dict) -> "ModelConfig":
        # A config saved without a model names only its model_type.
        archs = cfg.get("architectures") or [MODEL_TYPES.get(cfg.get("model_type"))]
        arch = next((a for a in archs if a in ARCHITECTURES), None)
        if arch is None:
            _fail(ValueError, "config.json architectures", f"one of {sorted(ARCHITECTURES)}",
                  cfg.get("architectures") or f"model_type {cfg.get('model_type')!r}",
                  "flashtile.engine runs the Llama, Mistral, Qwen2 and Qwen3 families")
        heads = cfg["num_attention_heads"]
        theta, scaling = _rope(cfg)
        sliding = cfg.get("sliding_window")
        if arch.startswith("Qwen"):
            if cfg.get("use_sliding_window"):
                _fail(ValueError, "config.json use_sliding_window", "false (Qwen's per-layer "
                      "sliding window is not supported)", cfg["use_sliding_window"])
            sliding = None
        name = cfg.get("dtype") or cfg.get("torch_dtype")
        eos = cfg.get("eos_token_id")
        eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        return cls(
            architecture=arch, vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"], num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6), rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            sliding_window=sliding, dtype=DTYPES.get(name) if name else None,
            eos_token_ids=tuple(eos), initializer_range=cfg.get("initializer_range", 0.02),
            **ARCHITECTURES[arch])

    @classmethod
    def from_pretrained(cls, model_dir: str) -> "ModelConfig":
        path = os.path.join(model_dir, "config.json")
        if not os.path.isdir(model_dir):
            _fail(ValueError, "model", "a checkpoint directory", repr(model_dir))
        if not os.path.isfile(path):
            _fail(ValueError, "model", "a directory with config.json",
                  f"{model_dir!r} without one", "Point model= at a Hugging Face checkpoint")
        with open(path) as f:
            config = cls.from_dict(json.load(f))
        gen_path = os.path.join(model_dir, "generation_config.json")
        if os.path.isfile(gen_path):
            with open(gen_path) as f:
                eos = json.load(f).get("eos_token_id")
            if eos is not None:  # the model's own stop tokens win over config.json's
                eos = (eos,) if isinstance(eos, int) else tuple(eos)
                config = replace(config, eos_token_ids=eos)
        return config


def _resolve_dtype(dtype, checkpoint_dtype) -> torch.dtype:
    """"auto" is the checkpoint's dtype (bf16 if it names none); a torch dtype or a name."""
    if dtype == "auto":
        return checkpoint_dtype or torch.bfloat16
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if dtype not in DTYPES:
        _fail(ValueError, "dtype", f"'auto' or one of {sorted(DTYPES)}", repr(dtype))
    return DTYPES[dtype]


@dataclass
class EngineConfig:
    """Engine settings, vLLM's names and defaults where they exist.

    max_model_len: longest sequence (prompt + output); default the model's
        max_position_embeddings.
    max_num_batched_tokens: tokens computed per step (the scheduler's budget; prompts
        longer than it are prefilled in chunks).
    gpu_memory_utilization: fraction of the GPU the engine may fill; the KV pool gets what
        the model and one forward at max_num_batched_tokens leave of it.
    kv_cache_memory: KV pool bytes on CPU (and on CUDA if given, instead of the fraction).
    page_size: tokens per KV page. 64 by default: flashtile's paged decode at page 64 is
        within 1-2% of a contiguous cache on the H200, page 16 up to 15% slower at batch 1
        (docs/benchmarks/decode-h200.md). The naive backend ignores it (one max_model_len
        slab per sequence).
    async_scheduling: launch each step before the previous step's sampled tokens reach
        the host (the next step reads them on the device), so that the host's work per
        step overlaps the device's; step() then returns each step's tokens one call
        later. Default (None): on CUDA; on CPU, where nothing runs asynchronously, off.
        Either way the tokens are the same.
    kv_cache_dtype: the KV pool's dtype (vLLM's names): "auto", the model's; "fp8" or
        "fp8_e4m3" (float8_e4m3fn), "fp8_e5m2". An FP8 pool holds twice the tokens of a
        16-bit one in the same bytes, and decode steps read half the KV bytes. Keys and
        values are stored as flashtile.fp8.quantize(x, scale) makes them (x / scale
        rounded to nearest even, saturated at the format's largest value; each layer's
        scale is the checkpoint's (vLLM's self_attn.k_scale / v_scale tensors) or 1.0,
        vLLM's default, unless calculate_kv_scales), and every step attends over the pool
        (prefill chunks and fresh prompts too), so a sequence's logits do not depend on
        how its prompt was split into steps. Needs a float16 or bfloat16 model and the
        flashtile backend.
    calculate_kv_scales: with an FP8 pool, each layer's scales come from the first step
        that serves a request (vLLM's option and rule: the largest |k| maps to 200, |v|
        to 100, leaving room below e4m3's 448), instead of the checkpoint's or 1.0:
        models whose keys or values sit far from 1 keep FP8's precision. Fixed from then
        on (a replayed decode graph reads them in place).
    tensor_parallel_size: processes the model is split over (engine/parallel.py): LLM
        runs rank 0 and starts the others (engine/workers.py); rank r runs on cuda:r
        (choose the GPUs with CUDA_VISIBLE_DEVICES), or on the CPU over gloo.
        kv_cache_memory is then per rank (each rank's pool holds its share of the heads).
    """

    model: str
    dtype: str = "auto"
    max_model_len: Optional[int] = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    gpu_memory_utilization: float = 0.9
    kv_cache_memory: Optional[int] = None
    page_size: int = 64
    enforce_eager: bool = False
    load_format: str = "auto"
    attention_backend: str = "flashtile"
    seed: int = 0
    enable_prefix_caching: bool = True
    device: str = "auto"
    async_scheduling: Optional[bool] = None
    tensor_parallel_size: int = 1
    kv_cache_dtype: str = "auto"
    calculate_kv_scales: bool = False
    model_config: ModelConfig = field(init=False, repr=False)
    torch_dtype: torch.dtype = field(init=False, repr=False)
    cache_dtype: torch.dtype = field(init=False, repr=False)  # kv_cache_dtype resolved

    def __post_init__(self):
        if self.load_format not in LOAD_FORMATS:
            _fail(ValueError, "load_format", f"one of {LOAD_FORMATS}", repr(self.load_format))
        if self.attention_backend not in BACKENDS:
            _fail(ValueError, "attention_backend", f"one of {BACKENDS}",
                  repr(self.attention_backend))
        if not isinstance(self.kv_cache_dtype, str) or \
                self.kv_cache_dtype not in KV_CACHE_DTYPES:
            _fail(ValueError, "kv_cache_dtype", f"one of {tuple(KV_CACHE_DTYPES)}",
                  repr(self.kv_cache_dtype))
        if not isinstance(self.calculate_kv_scales, bool):
            _fail(TypeError, "calculate_kv_scales", "a bool",
                  type(self.calculate_kv_scales).__name__)
        if self.calculate_kv_scales and KV_CACHE_DTYPES[self.kv_cache_dtype] is None:
            _fail(ValueError, "calculate_kv_scales", "False with kv_cache_dtype 'auto' "
                  "(scales serve an FP8 pool)", True)
        if KV_CACHE_DTYPES[self.kv_cache_dtype] is not None \
                and self.attention_backend != "flashtile":
            _fail(ValueError, "kv_cache_dtype", "'auto' with attention_backend "
                  f"{self.attention_backend!r} (an FP8 pool is read by flashtile's kernels)",
                  repr(self.kv_cache_dtype))
        for name in ("max_num_seqs", "max_num_batched_tokens", "tensor_parallel_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                _fail(ValueError, name, "an int >= 1", repr(value))
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            _fail(ValueError, "gpu_memory_utilization", "a fraction in (0, 1]",
                  self.gpu_memory_utilization)
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            _fail(ValueError, "kv_cache_memory", "a positive number of bytes or None",
                  self.kv_cache_memory)
        ps = self.page_size
        if self.attention_backend != "naive" and (
                not isinstance(ps, int) or not 16 <= ps <= 256 or ps & (ps - 1)):
            _fail(ValueError, "page_size", "a power of two from 16 to 256 (flashtile's paged "
                  "cache)", repr(ps))
        self.model_config = ModelConfig.from_pretrained(self.model)
        if self.tensor_parallel_size > 1:
            self._check_tensor_parallel()
        limit = self.model_config.max_position_embeddings
        if self.max_model_len is None:
            self.max_model_len = limit
        if not isinstance(self.max_model_len, int) or not 1 <= self.max_model_len <= limit:
            _fail(ValueError, "max_model_len", f"an int from 1 to the model's "
                  f"max_position_embeddings {limit}", repr(self.max_model_len))
        self.torch_dtype = _resolve_dtype(self.dtype, self.model_config.dtype)
        self.cache_dtype = KV_CACHE_DTYPES[self.kv_cache_dtype] or self.torch_dtype
        if self.cache_dtype != self.torch_dtype and \
                self.torch_dtype not in (torch.float16, torch.bfloat16):
            _fail(ValueError, "kv_cache_dtype", f"'auto' with dtype {self.torch_dtype} (an "
                  "FP8 pool serves float16 or bfloat16 models)", repr(self.kv_cache_dtype))
        if self.async_scheduling is None:
            self.async_scheduling = self.torch_device.type == "cuda"
        if not isinstance(self.async_scheduling, bool):
            _fail(TypeError, "async_scheduling", "a bool or None",
                  type(self.async_scheduling).__name__)
        if self.attention_backend == "naive":
            # One contiguous max_model_len slab per sequence: the layout naive caches use.
            self.page_size = self.max_model_len

    def _check_tensor_parallel(self):
        size = self.tensor_parallel_size
        check_model_split(self.model_config, size)
        device = self.torch_device
        if device.type == "cuda":
            if device.index is not None:
                _fail(ValueError, "device", "'auto' or 'cuda' with tensor_parallel_size > 1 "
                      "(rank r runs on cuda:r)", repr(self.device),
                      "Choose the GPUs with CUDA_VISIBLE_DEVICES")
            if size > torch.cuda.device_count():
                _fail(ValueError, "tensor_parallel_size", f"at most the "
                      f"{torch.cuda.device_count()} visible CUDA devices", size)
        elif device.type != "cpu":
            _fail(ValueError, "device", "CUDA or CPU with tensor_parallel_size > 1",
                  repr(self.device))

    @property
    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    @property
    def blocks_per_seq(self) -> int:
        """Pages one max_model_len sequence needs (the block table's width)."""
        return math.ceil(self.max_model_len / self.page_size)
