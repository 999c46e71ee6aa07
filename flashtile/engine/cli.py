"""``flashtile generate MODEL_DIR --prompt ...``: stream a completion to stdout.

Registered by flashtile/cli.py through ``add_generate``; the engine (torch model,
safetensors, tokenizers) is imported only when the command runs.
"""

from __future__ import annotations

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
    p.set_defaults(handler=_generate)


def _generate(args) -> int:
    from flashtile.engine import LLM, SamplingParams

    llm = LLM(args.model, dtype=args.dtype, device=args.device,
              max_model_len=args.max_model_len, attention_backend=args.attention_backend,
              load_format=args.load_format, enforce_eager=args.enforce_eager,
              max_num_seqs=1)
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
    return 0
