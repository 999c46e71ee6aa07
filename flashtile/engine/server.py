"""``flashtile serve MODEL_DIR``: an OpenAI-compatible HTTP server over one engine (aiohttp).

    flashtile serve path/to/checkpoint --port 8000
    curl localhost:8000/v1/completions -d '{"prompt": "Hello", "max_tokens": 8}'

Endpoints: ``POST /v1/completions`` and ``POST /v1/chat/completions`` (with ``stream``:
server-sent events, a chunk per generated token, then ``data: [DONE]``; a chunk carries
several tokens when the stream's reader fell behind the engine, or with
``--stream-interval``), ``GET /v1/models``, ``GET /health``. Errors are OpenAI's JSON body
``{"error": {"message", "type", "param", "code"}}`` with a 4xx status for a bad request
and 500 for a fault of the server, which keeps serving.

Many clients share one engine through ``AsyncEngine`` (engine/async_engine.py: the engine
steps in one worker thread, the event loop stays free). A client that goes away (a failed
write, or aiohttp cancelling its handler) has its unfinished requests aborted and their KV
pages freed.

The event loop and the engine thread share one GIL, so the host work per token of every
stream counts against the engine's steps: a streamed request takes delta outputs (only
its new tokens and text, SamplingParams.output_kind) and a whole one only its final
output; each stream's reader is woken at most once per step and writes one preformatted
chunk per prompt (openai_protocol.ChunkFormat); the startup heap is frozen out of the
garbage collector. ``flashtile bench serve --fake-server`` measures what is left
(docs/benchmarks/NOTES.md, section 14).

Beyond OpenAI, vLLM's extensions (openai_protocol.py lists them and what is refused);
``/v1/models`` entries carry ``max_model_len`` (vLLM's) and ``vocab_size`` (so
``flashtile bench serve`` can draw random token ids).
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import re
import sys
import time
import uuid

try:
    from aiohttp import web
except ImportError:  # aiohttp is the engine extra's; flashtile's other commands run without
    web = None

from flashtile._validate import _fail
from flashtile.engine import openai_protocol as api
from flashtile.engine.async_engine import AsyncEngine
from flashtile.engine.openai_protocol import RequestError, error_body
from flashtile.engine.tokenizer import load_chat_template
from flashtile.engine.tool_parsers import TOOL_CALL_PARSERS, get_parser

log = logging.getLogger("flashtile.engine")

MAX_BODY_BYTES = 64 * 2**20  # a 128k-token prompt as a JSON id list is ~1 MB


class OpenAIServer:
    """The HTTP handlers over one AsyncEngine."""

    def __init__(self, engine: AsyncEngine, model_name: str, tool_call_parser=None,
                 enable_prompt_tokens_details: bool = False):
        self.engine, self.model_name = engine, model_name
        self.details = enable_prompt_tokens_details
        self.tool_parser = get_parser(tool_call_parser)
        self.llm = engine.llm
        self.tokenizer = engine.llm.tokenizer
        self.max_model_len = engine.llm.config.max_model_len
        self.created = int(time.time())

    async def health(self, request):
        if not self.engine.running:
            raise RequestError("the engine loop has stopped", status=503,
                               type="internal_server_error")
        return web.Response(status=200)

    async def metrics(self, request):
        """vLLM's /metrics: Prometheus' text format under vLLM's metric names."""
        text = await self.engine.metrics(self.model_name)
        return web.Response(body=text.encode(), headers={
            "Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    async def models(self, request):
        return web.json_response({"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": self.created,
            "owned_by": "flashtile", "root": self.llm.config.model,
            "max_model_len": self.max_model_len,
            "vocab_size": self.llm.config.model_config.vocab_size}]})

    async def completions(self, request):
        body = await self._body(request)
        flags = api.stream_flags(body)
        logprobs, echo = api.completion_logprobs(body), api.echo_flag(body, chat=False)
        # OpenAI's default: 16 tokens. echo with logprobs: the prompt's, k alternatives.
        params = api.sampling_params(body, logprobs,
                                     api.first(body, "max_tokens", default=16), flags[0],
                                     prompt_logprobs=logprobs if echo else None)
        prompts = texts = api.parse_prompts(body)
        if echo and self.tokenizer is None:
            raise RequestError("echo: expected a model with tokenizer.json (the prompt is "
                               "echoed as text), got none", "echo")
        if any(isinstance(p, str) for p in prompts):
            prompts = await asyncio.to_thread(self._encode, prompts)
        prompts = [params.truncate(p, self.max_model_len) for p in prompts]
        for p in prompts:
            api.check_fits(p, params, "prompt", self.max_model_len)
        if echo:  # a prompt sent as text is echoed as sent (truncated: what is kept),
            # token ids decoded
            cut = params.truncate_prompt_tokens is not None
            texts = [t if isinstance(t, str) and not cut else self.tokenizer.decode(
                p, skip_special_tokens=False) for t, p in zip(texts, prompts)]
        beam = api.beam_search_params(body, params, flags[0], echo,
                                      max(map(len, prompts)), self.max_model_len)
        if beam is not None:
            return await self._beam_respond(prompts, beam, chat=False)
        return await self._respond(request, flags, prompts, params, chat=False,
                                   echo=texts if echo else None)

    async def chat_completions(self, request):
        body = await self._body(request)
        flags = api.stream_flags(body)
        api.echo_flag(body, chat=True)
        # OpenAI's default: no limit but the context (max_tokens=None: up to max_model_len).
        params = api.sampling_params(body, api.chat_logprobs(body), api.first(
            body, "max_completion_tokens", "max_tokens"), flags[0])
        messages = api.parse_messages(body)
        tools = api.parse_tools(body, self.tool_parser)
        template = api.chat_template_args(body)
        if self.tokenizer is None:
            raise RequestError("messages: expected a model with tokenizer.json and a chat "
                               "template, got none; use /v1/completions", "messages")
        prompt = await asyncio.to_thread(self._render, messages, tools, template)
        prompt = params.truncate(prompt, self.max_model_len)
        api.check_fits(prompt, params, "messages", self.max_model_len)
        beam = api.beam_search_params(body, params, flags[0], False, len(prompt),
                                      self.max_model_len)
        if beam is not None:
            return await self._beam_respond([prompt], beam, chat=True)
        return await self._respond(request, flags, [prompt], params, chat=True,
                                   tools=tools is not None)

    async def tokenize(self, request):
        """vLLM's /tokenize: {prompt, add_special_tokens (default true)} or {messages,
        add_generation_prompt (default true), continue_final_message,
        chat_template_kwargs} -> {count, max_model_len, tokens}."""
        body = await self._body(request)
        if self.tokenizer is None:
            raise RequestError("prompt: expected a model with tokenizer.json, got none",
                               "prompt")
        if "messages" in body:
            messages = api.parse_messages(body)
            tokens = await asyncio.to_thread(self._render, messages, None,
                                             api.chat_template_args(body))
        else:
            prompt, special = body.get("prompt"), body.get("add_special_tokens", True)
            if not isinstance(prompt, str):
                raise RequestError(f"prompt: expected a string, got {json.dumps(prompt)[:80]}",
                                   "prompt")
            if not isinstance(special, bool):
                raise RequestError("add_special_tokens: expected a bool, got "
                                   f"{json.dumps(special)[:80]}", "add_special_tokens")
            tokens = self.tokenizer.encode(prompt, add_special_tokens=special)
        return web.json_response({"count": len(tokens), "max_model_len": self.max_model_len,
                                  "tokens": tokens})

    async def detokenize(self, request):
        """vLLM's /detokenize: {tokens} -> {prompt}."""
        body = await self._body(request)
        tokens, vocab = body.get("tokens"), self.llm.config.model_config.vocab_size
        if not isinstance(tokens, list) or not all(
                api.is_token(t) and 0 <= t < vocab for t in tokens):
            raise RequestError(f"tokens: expected a list of token ids in [0, {vocab}), got "
                               f"{json.dumps(tokens)[:80]}", "tokens")
        if self.tokenizer is None:
            raise RequestError("tokens: expected a model with tokenizer.json, got none",
                               "tokens")
        return web.json_response({"prompt": self.tokenizer.decode(tokens)})

    # ---- request helpers --------------------------------------------------------------
    async def _body(self, request) -> dict:
        try:
            body = json.loads(await request.read())
        except ValueError as err:  # JSONDecodeError, UnicodeDecodeError
            raise RequestError(f"request body: expected JSON, got malformed JSON ({err})")
        if not isinstance(body, dict):
            raise RequestError(f"request body: expected a JSON object, got "
                               f"{type(body).__name__}")
        model = body.get("model")
        if model is not None and model != self.model_name:
            raise RequestError(f"The model `{model}` does not exist.", "model", status=404,
                               code="model_not_found")
        api.check_unsupported(body)
        return body

    def _encode(self, prompts):
        if self.tokenizer is None:
            raise RequestError("prompt: expected token ids (the model has no "
                               "tokenizer.json), got a string", "prompt")
        return [self.tokenizer.encode(p) if isinstance(p, str) else p for p in prompts]

    def _render(self, messages, tools=None, template=None):
        """The conversation's prompt ids; template: chat_template_args' keywords."""
        import jinja2

        template = dict(template or {})
        if tools is not None:
            template["tools"] = tools
        try:
            text = self.tokenizer.render_chat(messages, **template)
        except jinja2.TemplateError as err:
            raise RequestError(f"messages: the chat template refused them: {err}",
                               "messages") from None
        except ValueError as err:  # continue_final_message's
            raise RequestError(str(err), api.param_of(err)) from None
        return self.tokenizer.encode(text, add_special_tokens=False)

    # ---- responses --------------------------------------------------------------------
    async def _respond(self, request, flags, prompts, params, chat: bool, echo=None,
                       tools: bool = False):
        """echo: each prompt's text, put before its choices' (completions' echo); tools:
        the answers' tool calls are parsed out (the server's tool-call parser)."""
        stream_mode, include_usage, continuous = flags
        parser = self.tool_parser if tools else None
        stream = await self._add(prompts, params)
        head = self._head(chat)
        try:
            if stream_mode:
                return await self._stream(request, stream, head, chat,
                                          (include_usage, continuous),
                                          params.logprobs is not None, params.n, echo,
                                          parser)
            final = {index: out async for index, out in stream}  # FINAL_ONLY: one each
            outs = [final[i] for i in range(len(prompts) * params.n)]
            choices = []
            for i, o in enumerate(outs):
                c = o.outputs[0]
                text, ids, lps, top = (c.text, c.token_ids, c.logprobs, c.top_logprobs) \
                    if echo is None else api.echoed(echo[i // params.n], o,
                                                     params.logprobs is not None)
                body = {**api.choice(chat, i, text, ids, lps, 0, self.tokenizer, top=top),
                        "finish_reason": c.finish_reason}
                if parser is not None:
                    content, calls = parser.parse(c.text)
                    body["message"]["content"] = content
                    if calls:
                        body["message"]["tool_calls"] = calls
                        body["finish_reason"] = "tool_calls"
                choices.append(body)
            return web.json_response({**head, "choices": choices,
                                      "usage": api.usage(outs, params.n, self.details)})
        finally:
            stream.close()

    async def _add(self, prompts, params):
        """The engine's stream of the prompts' requests; its refusal as a 400."""
        try:
            return await self.engine.add(prompts, params)
        except ValueError as err:
            raise RequestError(str(err), api.param_of(err)) from None

    def _head(self, chat: bool) -> dict:
        """What every response (and chunk) of one request starts with."""
        return {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
                "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()), "model": self.model_name}

    async def _beam_respond(self, prompts, beam, chat: bool):
        """use_beam_search: each prompt's beams (BeamSearch over the engine, one request
        a live beam a step) as its n choices, best first. With --enable-prompt-tokens-
        details, cached_tokens counts what the prefix cache gave the prompts themselves:
        the first step's requests, one a prompt (the later steps' prompts are beams)."""
        from flashtile.engine.beam_search import BeamSearch
        from flashtile.engine.sampling_params import RequestOutputKind

        search = BeamSearch(prompts, beam, self.llm.scheduler.eos_token_ids,
                            self.max_model_len, RequestOutputKind.FINAL_ONLY)
        cached = 0 if self.details else None
        while batch := search.prompts():
            stream = await self._add(batch, search.step_params)
            try:
                final = {index: out async for index, out in stream}
            finally:
                stream.close()
            outputs = [final[i] for i in range(len(batch))]
            if search.steps == 0 and cached is not None:  # the prompts' own requests
                cached = sum(out.num_cached_tokens for out in outputs)
            search.advance(outputs)
        choices, generated = [], 0
        for prompt, result in zip(prompts, search.results(self.tokenizer)):
            for b in result.sequences:
                ids = b.tokens[len(prompt):]
                generated += len(ids)
                choices.append({**api.choice(chat, len(choices), b.text or "", ids, None, 0,
                                             self.tokenizer),
                                "finish_reason": b.finish_reason})
        return web.json_response({**self._head(chat), "choices": choices,
                                  "usage": api.usage_body(sum(map(len, prompts)), generated,
                                                          cached)})

    async def _stream(self, request, stream, head, chat, usage_flags, logprobs, n,
                      echo=None, parser=None):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
        await resp.prepare(request)
        head = {**head, "object": "chat.completion.chunk" if chat else "text_completion"}
        try:
            try:
                await self._chunks(resp, stream, head, chat, usage_flags, logprobs, n,
                                   echo, parser)
            except ConnectionResetError:
                raise
            except Exception as err:  # headers are sent: report it in the stream
                log.exception("streaming failed")
                await resp.write(api.sse(error_body(f"{type(err).__name__}: {err}",
                                                    "internal_server_error")))
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        except ConnectionResetError:  # the client left: the caller aborts its requests
            pass
        return resp

    async def _chunks(self, resp, stream, head, chat, usage_flags, logprobs, n,
                      echo=None, parser=None):
        """The token chunks: per wake-up one write with one chunk per choice that
        progressed (several steps' tokens in one chunk when the loop fell behind); n
        choices a prompt; with echo, a choice's first chunk starts with its prompt. With
        a tool-call parser, text that may start a call is held back, and a choice whose
        answer holds calls ends with one chunk of them (finish_reason "tool_calls").
        usage_flags: (include_usage: a closing usage chunk, continuous_usage_stats: each
        token chunk with its choice's usage so far)."""
        include_usage, continuous = usage_flags
        calls_of = {}  # choice index -> its ToolCallStream
        usage = {"usage": None} if include_usage else {}  # in each chunk sse() writes
        chunks = api.ChunkFormat(head, chat, include_usage)
        # choice index -> (characters: text_offset's count with completions' logprobs,
        # completion tokens, prompt tokens, prompt tokens from the prefix cache)
        sent = {}
        while stream.pending:
            parts = []
            for index, out in (await stream.next_outputs()).items():
                c = out.outputs[0]
                if chat and index not in sent:  # OpenAI: a choice's role first, alone
                    role = {"index": index, "delta": {"role": "assistant", "content": ""},
                            "logprobs": None, "finish_reason": None}
                    parts.append(api.sse({**head, "choices": [role], **usage}))
                chars, ntok = sent.get(index, (0, 0))[:2]
                text, ids, lps, top = c.text, c.token_ids, c.logprobs, c.top_logprobs
                if echo is not None and index not in sent:
                    text, ids, lps, top = api.echoed(echo[index // n], out, logprobs)
                reason = c.finish_reason if out.finished else None
                calls = None
                if parser is not None:
                    tool_stream = calls_of.get(index)
                    if tool_stream is None:
                        tool_stream = calls_of[index] = parser.stream()
                    text = tool_stream.feed(text)
                    if out.finished:
                        rest, calls = tool_stream.finish()
                        text += rest
                        reason = None if calls else reason
                so_far = api.usage_body(len(out.prompt_token_ids), ntok + len(c.token_ids)) \
                    if continuous else None
                body, after = chunks.chunk(
                    index, text, ids, lps if logprobs else None, chars, reason,
                    self.tokenizer, top if logprobs else None, so_far)
                parts.append(body)
                if calls:
                    parts.append(api.sse({**head, "choices": [{
                        "index": index, "delta": {"tool_calls": [
                            {"index": j, **call} for j, call in enumerate(calls)]},
                        "logprobs": None, "finish_reason": "tool_calls"}],
                        **usage}))
                # The prompt counts once in usage, not once per completion.
                first = index % n == 0
                sent[index] = (after, ntok + len(c.token_ids),
                               len(out.prompt_token_ids) if first else 0,
                               out.num_cached_tokens if first else 0)
            await resp.write(b"".join(parts))
        if include_usage:
            _, completion, prompt, cached = (sum(x) for x in zip(*sent.values()))
            await resp.write(api.sse({**head, "choices": [], "usage": api.usage_body(
                prompt, completion, cached if self.details else None)}))


def freeze_gc_heap():
    """Exempt every object alive now (modules, the model, the engine: ~400k objects) from
    garbage collection. A full collection walks every tracked object with the GIL held:
    ~0.2 s on a 2-core VM with this heap, a stall of every stream and of the engine
    (vLLM's freeze_gc_heap does the same). Call once serving is about to start."""
    gc.collect()
    gc.freeze()


def build_app(engine: AsyncEngine, model_name: str, tool_call_parser=None,
              enable_prompt_tokens_details: bool = False):
    """The aiohttp application; starts the engine loop on startup, stops it on cleanup.
    tool_call_parser: the name of the parser of the models' tool calls (tool_parsers.py),
    or None: requests with tools get a 400. enable_prompt_tokens_details: usage says
    how many prompt tokens came from the prefix cache (vLLM's flag)."""
    server = OpenAIServer(engine, model_name, tool_call_parser,
                          enable_prompt_tokens_details)

    @web.middleware
    async def errors(request, handler):
        try:
            return await handler(request)
        except RequestError as err:
            status, body = err.status, error_body(err.message, err.type, err.param,
                                                  err.code)
        except web.HTTPException as err:  # unknown route, wrong method, body too large
            if err.status < 400:
                raise
            status, body = err.status, error_body(err.reason, "invalid_request_error")
        except Exception as err:
            log.exception("unexpected error serving %s", request.path)
            status, body = 500, error_body(f"{type(err).__name__}: {err}",
                                           "internal_server_error")
        return web.json_response(body, status=status)

    app = web.Application(middlewares=[errors], client_max_size=MAX_BODY_BYTES)
    app.router.add_get("/health", server.health)
    app.router.add_get("/v1/models", server.models)
    app.router.add_get("/metrics", server.metrics)
    app.router.add_post("/v1/completions", server.completions)
    app.router.add_post("/v1/chat/completions", server.chat_completions)
    app.router.add_post("/tokenize", server.tokenize)
    app.router.add_post("/detokenize", server.detokenize)

    async def start(app):
        await engine.start()

    async def stop(app):
        await engine.stop()

    app.on_startup.append(start)
    app.on_cleanup.append(stop)
    return app


# ---- command line ---------------------------------------------------------------------
def size(text: str) -> int:  # named for argparse's "invalid size value" message
    """Bytes from '2147483648', '2GiB', '512MiB' or '1.5e9'."""
    match = re.fullmatch(r"\s*([\d.eE+]+)\s*([KMGT]i?B)?\s*", text)
    units = {None: 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12, "KiB": 2**10,
             "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
    if match is None:
        raise ValueError(text)
    return int(float(match[1]) * units[match[2]])


def add_serve(commands):
    p = commands.add_parser("serve", help="an OpenAI-compatible HTTP server "
                            "(/v1/completions, /v1/chat/completions) over a checkpoint")
    p.add_argument("model", help="Hugging Face checkpoint directory")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", help="the name clients send as 'model' "
                   "(default: MODEL as given)")
    p.add_argument("--dtype", default="auto", help="auto, float32, float16 or bfloat16")
    p.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--kv-cache-memory", type=size, default=None,
                   help="KV pool bytes (e.g. 4GiB); on CUDA instead of the fraction")
    p.add_argument("--attention-backend", default="flashtile",
                   choices=("flashtile", "sdpa", "naive"))
    p.add_argument("--load-format", default="auto", choices=("auto", "dummy"))
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--kv-cache-dtype", default="auto",
                   choices=("auto", "fp8", "fp8_e4m3", "fp8_e5m2"),
                   help="the KV pool's dtype: auto (the model's), fp8 (e4m3) or fp8_e5m2 "
                   "(twice the tokens in the same memory)")
    p.add_argument("--calculate-kv-scales", action="store_true",
                   help="with an FP8 KV cache, each layer's scales from the first step "
                   "(else 1.0)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="processes (GPUs) to split the model over")
    p.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default=None,
                   help="how the model writes tool calls (hermes: Hermes, Qwen2.5, Qwen3); "
                   "without it, chat requests with tools get a 400")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="accepted for vLLM's command lines: --tool-call-parser enables "
                   "tool_choice \"auto\"")
    p.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="usage.prompt_tokens_details.cached_tokens: the prompt tokens "
                   "taken from the prefix cache")
    p.add_argument("--chat-template", default=None,
                   help="a Jinja chat template, or the path of a file holding one, "
                   "instead of the model's")
    p.add_argument("--stream-interval", type=int, default=1,
                   help="tokens per streamed chunk after the first (default 1); more "
                   "cost the server less host time per token")
    p.set_defaults(handler=_serve)


def _serve(args) -> int:
    if web is None:
        print("flashtile serve needs aiohttp: pip install 'flashtile[engine]'",
              file=sys.stderr)
        return 2
    from flashtile.engine.llm import LLM

    kw = dict(dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
              max_num_seqs=args.max_num_seqs, page_size=args.page_size,
              max_num_batched_tokens=args.max_num_batched_tokens,
              gpu_memory_utilization=args.gpu_memory_utilization,
              kv_cache_memory=args.kv_cache_memory, enforce_eager=args.enforce_eager,
              attention_backend=args.attention_backend, load_format=args.load_format,
              seed=args.seed, tensor_parallel_size=args.tensor_parallel_size,
              kv_cache_dtype=args.kv_cache_dtype,
              calculate_kv_scales=args.calculate_kv_scales)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    try:
        template = None if args.chat_template is None \
            else load_chat_template(args.chat_template)
        engine = AsyncEngine(lambda: LLM(args.model, **kw), args.stream_interval)
        if template is not None:
            if engine.llm.tokenizer is None:
                _fail(ValueError, "chat_template", "a model with tokenizer.json beside it",
                      "none")
            engine.llm.tokenizer.chat_template = template
    except ValueError as err:  # a bad checkpoint or engine option: say which
        print(f"flashtile serve: {err}", file=sys.stderr)
        return 2
    name = args.served_model_name or args.model
    freeze_gc_heap()
    print(f"flashtile serve: {name!r} on http://{args.host}:{args.port} "
          f"({engine.llm.runner.num_blocks} KV pages of {engine.llm.config.page_size} "
          f"tokens, max_model_len {engine.llm.config.max_model_len})", flush=True)
    try:
        web.run_app(build_app(engine, name, args.tool_call_parser,
                              args.enable_prompt_tokens_details), host=args.host,
                    port=args.port, handler_cancellation=True, print=None)
    except OSError as err:  # the port is taken, the host is not this machine's
        print(f"flashtile serve: {err}", file=sys.stderr)
        return 1
    return 0
