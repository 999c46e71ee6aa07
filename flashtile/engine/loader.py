"""Build the model on the meta device, materialise it on the target device, fill it.

Weights come from a Hugging Face checkpoint's safetensors files (one file, or shards listed
by model.safetensors.index.json), or, with load_format="dummy", from a seeded random
initialisation of config.json's shapes (vLLM's name; benchmarks at real shapes without
the weights). Meta construction allocates nothing, so each parameter is allocated once, on
its device and in its dtype, and then written once.
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

log = logging.getLogger("flashtile.engine")

# Checkpoint tensor name piece -> (our fused parameter, index of its shard).
FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
         "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
# Buffers some older checkpoints saved; the engine computes them.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


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


def _shard_sizes(model: CausalLM, fused: str) -> list[int]:
    if fused == "qkv_proj":
        return model.model.layers[0].self_attn.sizes
    return [model.config.intermediate_size] * 2


def _target(model, params, name):
    """(parameter, row slice) that checkpoint tensor `name` fills, or None to skip it."""
    if name.endswith(IGNORED_SUFFIXES):
        return None
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part in FUSED:
            fused, shard = FUSED[part]
            key = ".".join(parts[:i] + [fused] + parts[i + 1:])
            if key in params:
                sizes = _shard_sizes(model, fused)
                start = sum(sizes[:shard])
                return key, params[key], slice(start, start + sizes[shard])
    if name in params:
        return name, params[name], slice(None)
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
                target = _target(model, params, name)
                if target is None:
                    continue
                key, param, rows = target
                dest = param[rows]
                tensor = f.get_tensor(name)
                if tensor.shape != dest.shape:
                    _fail(ValueError, f"checkpoint tensor {name!r} shape",
                          tuple(dest.shape), tuple(tensor.shape),
                          "The weights do not match config.json")
                dest.copy_(tensor)
                loaded.add((key, rows.start))
    expected = set()
    for key, param in model.named_parameters():  # tied weights counted once
        fused = next((f for f in ("qkv_proj", "gate_up_proj") if f".{f}." in key), None)
        if fused is None:
            expected.add((key, None))
            continue
        sizes = _shard_sizes(model, fused)
        expected.update((key, sum(sizes[:i])) for i in range(len(sizes)))
    missing = sorted(f"{k}[{s}:]" if s is not None else k for k, s in expected - loaded)
    if missing:
        _fail(ValueError, "model weights", "a tensor for every parameter",
              f"{len(missing)} missing: {missing[:8]}")


@torch.no_grad()
def dummy_init(model: CausalLM, seed: int) -> None:
    """Random weights the way transformers initialises them: normal(0,
    initializer_range) matrices, unit norm weights, zero biases; seeded."""
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        elif name.endswith(".bias"):
            p.zero_()
        else:
            p.normal_(0.0, model.config.initializer_range, generator=gen)


def build_model(config: EngineConfig) -> CausalLM:
    """The model on config's device and dtype, weights loaded (or dummy), in eval mode."""
    with torch.device("meta"):
        model = CausalLM(config.model_config, config.max_model_len, config.attention_backend)
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
