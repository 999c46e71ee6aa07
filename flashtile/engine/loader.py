"""Build the model on the meta device, materialise it on the target device, fill it.

Weights come from a Hugging Face checkpoint's safetensors files (one file, or shards listed
by model.safetensors.index.json), or, with load_format="dummy", from a seeded random
initialisation of config.json's shapes (vLLM's name; benchmarks at real shapes without
the weights). Meta construction allocates nothing, so each parameter is allocated once, on
its device and in its dtype, and then written once.

Under tensor parallelism each process keeps only its slice: the layers of
engine/parallel.py take their part of a full checkpoint tensor (``load_weight``), and
dummy weights are drawn full, identically on every rank (one seeded generator), then
sliced, so that a split model computes what the whole one does.
"""

from __future__ import annotations

import glob
import json
import logging
import os

import torch
from safetensors import safe_open

from flashtile._validate import _fail
from flashtile.engine.config import EngineConfig
from flashtile.engine.model import CausalLM
from flashtile.engine.parallel import ParallelGroup

log = logging.getLogger("flashtile.engine")

# Checkpoint tensor name piece -> (our fused parameter, index of its shard).
FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
         "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
# Buffers some older checkpoints saved; the engine computes them.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# An FP8 KV cache's calibrated scales, one scalar a layer (vLLM's checkpoint names; the
# older kv_scale serves both): kept on the layer's Attention as ``checkpoint_scales``,
# which the runner takes for an FP8 pool (kv_cache_dtype="fp8") unless
# calculate_kv_scales, and ignores for a 16-bit one.
KV_SCALE_SUFFIXES = {"self_attn.k_scale": ("k",), "self_attn.v_scale": ("v",),
                     "self_attn.kv_scale": ("k", "v")}


def checkpoint_files(model_dir: str) -> list[str]:
    """The safetensors files of a checkpoint, from its index if it is sharded."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        files = [os.path.join(model_dir, n) for n in names]
        missing = [f for f in files if not os.path.isfile(f)]
        if missing:
            _fail(ValueError, "model", "every shard named by model.safetensors.index.json",
                  f"missing {missing}")
        return files
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        _fail(ValueError, "model", "a checkpoint directory with *.safetensors weights",
              f"none in {model_dir!r}", "Or pass load_format='dummy' for random weights")
    return files


def _owner(model: CausalLM, key: str):
    """(module, parameter name) of parameter `key`."""
    path, _, name = key.rpartition(".")
    return model.get_submodule(path), name


def _full_shape(module, name: str, shard) -> tuple:
    """Shape of the checkpoint tensor (piece `shard` of a fused parameter) for a
    parameter; a parallel layer's parameter is a slice of it."""
    if hasattr(module, "full_shape"):
        return module.full_shape(name, shard)
    return tuple(getattr(module, name).shape)


def _fill(module, name: str, full, shard=None):
    """Copy full (the whole tensor, or piece `shard` of a fused one; a tensor or a
    safetensors slice) into the parameter, this rank's slice of it for a parallel
    layer."""
    if hasattr(module, "load_weight"):
        module.load_weight(name, full, shard)
    else:
        getattr(module, name).copy_(full[:])


def _kv_scale(model, name, f) -> bool:
    """Whether checkpoint tensor `name` is a layer's KV-cache scale; if so, kept as that
    layer's Attention's checkpoint_scales (a scalar a layer, else a ValueError)."""
    path, _, suffix = name.rpartition(".")
    kinds = KV_SCALE_SUFFIXES.get(path.rpartition(".")[2] + "." + suffix)
    if kinds is None:
        return False
    tensor = f.get_tensor(name)
    if tensor.numel() != 1:
        _fail(ValueError, f"checkpoint tensor {name!r} shape", "one scale a layer ()",
              tuple(tensor.shape))
    value = float(tensor)
    if not 0 < value < float("inf"):
        _fail(ValueError, f"checkpoint tensor {name!r}", "a positive finite scale", value)
    attn = model.get_submodule(path).attn
    attn.checkpoint_scales = {**getattr(attn, "checkpoint_scales", {}),
                              **{k: value for k in kinds}}
    return True


def _target(model, params, name):
    """(parameter key, index of its fused piece or None) that checkpoint tensor `name`
    fills, or None to skip it."""
    if name.endswith(IGNORED_SUFFIXES):
        return None
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part in FUSED:
            fused, shard = FUSED[part]
            key = ".".join(parts[:i] + [fused] + parts[i + 1:])
            if key in params:
                return key, shard
    if name in params:
        return name, None
    _fail(ValueError, f"checkpoint tensor {name!r}", f"a parameter of "
          f"{model.config.architecture} as config.json describes it", "no such parameter",
          "Is config.json the checkpoint's own?")


@torch.no_grad()
def load_weights(model: CausalLM, model_dir: str) -> None:
    """Copy every checkpoint tensor into its parameter (converting the dtype); a shape that
    disagrees with config.json, or a parameter the checkpoint lacks, is a ValueError."""
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded = set()
    for path in checkpoint_files(model_dir):
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                if _kv_scale(model, name, f):
                    continue
                target = _target(model, params, name)
                if target is None:
                    continue
                key, shard = target
                module, pname = _owner(model, key)
                want = _full_shape(module, pname, shard)
                # A slice object: a parallel layer reads only its rank's rows or columns.
                tensor = f.get_slice(name)
                shape = tuple(tensor.get_shape())
                if shape != want:
                    _fail(ValueError, f"checkpoint tensor {name!r} shape", want, shape,
                          "The weights do not match config.json")
                _fill(module, pname, tensor, shard)
                loaded.add((key, shard))
    expected = set()
    for key, param in model.named_parameters():  # tied weights counted once
        pieces = len(getattr(_owner(model, key)[0], "output_sizes", ()))
        expected.update([(key, i) for i in range(pieces)] if pieces > 1 else [(key, None)])
    missing = sorted(f"{k}[{s}]" if s is not None else k for k, s in expected - loaded)
    if missing:
        _fail(ValueError, "model weights", "a tensor for every parameter",
              f"{len(missing)} missing: {missing[:8]}")


@torch.no_grad()
def dummy_init(model: CausalLM, seed: int) -> None:
    """Random weights the way transformers initialises them: normal(0,
    initializer_range) matrices, unit norm weights, zero biases; seeded. Each matrix is
    drawn whole (the same on every rank) and each rank keeps its slice."""
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        elif name.endswith(".bias"):
            p.zero_()
        else:
            module, pname = _owner(model, name)
            full = torch.empty(_full_shape(module, pname, None), dtype=p.dtype, device=device)
            _fill(module, pname, full.normal_(0.0, model.config.initializer_range,
                                              generator=gen))


def build_model(config: EngineConfig) -> CausalLM:
    """The model on config's device and dtype, weights loaded (or dummy), in eval mode."""
    tp = ParallelGroup.for_size(config.tensor_parallel_size)
    with torch.device("meta"):
        model = CausalLM(config.model_config, config.max_model_len, config.attention_backend,
                         tp)
    model = model.to(config.torch_dtype).to_empty(device=config.torch_device)
    model.tie_weights()  # to_empty gives each module its own new tensor
    model.rotary.build(config.torch_device)
    if config.load_format == "dummy":
        dummy_init(model, config.seed)
    else:
        load_weights(model, config.model)
    log.info("loaded %s (%.1fM parameters, %s, %s)", config.model_config.architecture,
             sum(p.numel() for p in model.parameters()) / 1e6, config.torch_dtype,
             config.load_format)
    return model.eval().requires_grad_(False)
