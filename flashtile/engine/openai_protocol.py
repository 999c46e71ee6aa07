"""The OpenAI API's side of ``flashtile serve``: request bodies checked and turned into
prompts and SamplingParams, and the response, chunk, usage, logprobs and error bodies.
No HTTP here (server.py has the aiohttp application).

Beyond OpenAI, vLLM's extensions: ``top_k``, ``min_p``, ``repetition_penalty``,
``stop_token_ids``, ``ignore_eos``, ``skip_special_tokens``, ``min_tokens``,
``include_stop_str_in_output``, ``allowed_token_ids``, ``truncate_prompt_tokens``,
``bad_words``, ``stream_options.continuous_usage_stats``, ``use_beam_search`` (n beams,
``length_penalty``); in chat ``add_generation_prompt``, ``continue_final_message`` and
``chat_template_kwargs``. ``n`` completions of prompt i are choices i * n + j;
``logprobs`` (completions) and ``top_logprobs`` (chat) up to MAX_LOGPROBS alternatives.
``echo`` (completions) puts the prompt before each choice's text and, with ``logprobs``,
the prompt tokens' logprobs before the completion's (the first one null, as OpenAI's),
from the engine's prompt logprobs. Not supported (400): ``echo`` in chat, ``best_of`` >
1, ``suffix``, ``response_format``, ``tool_choice`` "required" or naming a function.
``tools`` with ``tool_choice`` "auto" (chat, a server started with
``--tool-call-parser``): the chat template shows the tools to the model and its calls
come back as ``tool_calls`` (tool_parsers.py); "none" leaves the tools out.
"""

from __future__ import annotations

import json
import re

from flashtile.engine.sampling_params import MAX_LOGPROBS, RequestOutputKind, SamplingParams

MAX_N = 128  # completions a request may ask for (n), as OpenAI's API allows
SAMPLING_FIELDS = ("n", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                   "presence_penalty", "frequency_penalty", "seed", "stop",
                   "stop_token_ids", "ignore_eos", "skip_special_tokens", "min_tokens",
                   "include_stop_str_in_output", "allowed_token_ids",
                   "truncate_prompt_tokens", "bad_words")
# Field -> the values that mean "off"; anything else asks for what the engine lacks.
UNSUPPORTED = {"best_of": (None, 1), "suffix": (None, ""),
               "response_format": (None, {"type": "text"})}


class RequestError(Exception):
    """A request the server refuses: OpenAI's error fields and an HTTP status."""

    def __init__(self, message, param=None, status=400, code=None,
                 type="invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.status, self.code, self.type = (
            message, param, status, code, type)


def param_of(err: Exception):
    """The argument a flashtile error names ("top_p: expected ..." -> "top_p")."""
    match = re.match(r"([A-Za-z_]\w*)(\[\d+\])?: ", str(err))
    return match[1] if match else None


def error_body(message, type, param=None, code=None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# ---- requests -------------------------------------------------------------------------
def first(body, *names, default=None):
    """The first of the fields that is present and not null."""
    return next((body[n] for n in names if body.get(n) is not None), default)


def is_token(t):
    return isinstance(t, int) and not isinstance(t, bool)


def parse_prompts(body) -> list:
    """prompt: a string, a token id list, or a non-empty list of either."""
    p = body.get("prompt")
    if isinstance(p, list) and p and all(map(is_token, p)):
        return [p]
    prompts = p if isinstance(p, list) else [p]
    if not prompts or not all(
            (isinstance(x, str) and x) or (isinstance(x, list) and x and all(map(is_token, x)))
            for x in prompts):
        raise RequestError("prompt: expected a non-empty string, a non-empty list of token "
                           f"ids, or a list of those, got {json.dumps(p)[:80]}", "prompt")
    return prompts


def parse_messages(body) -> list[dict]:
    """messages: [{"role", "content"}], content a string or a list of text parts."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages: expected a non-empty list of {role, content}, got "
                           f"{json.dumps(messages)[:80]}", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise RequestError(f"messages[{i}]: expected an object with a string 'role', "
                               f"got {json.dumps(m)[:80]}", "messages")
        content = m.get("content")
        if isinstance(content, list):  # OpenAI's content parts: text only here
            if not all(isinstance(c, dict) and c.get("type") == "text"
                       and isinstance(c.get("text"), str) for c in content):
                raise RequestError(f"messages[{i}].content: expected text parts "
                                   "({type: text, text}), got other parts", "messages")
            content = "\n".join(c["text"] for c in content)
        elif content is not None and not isinstance(content, str):
            raise RequestError(f"messages[{i}].content: expected a string or a list of "
                               f"text parts, got {json.dumps(content)[:80]}", "messages")
        message = {**m, "content": content}
        if m.get("tool_calls") is not None:
            message["tool_calls"] = _template_tool_calls(m["tool_calls"], i)
        out.append(message)
    return out


# Template variables a request sets through its own fields, not chat_template_kwargs;
# and chat_template, which would replace the server's template (vLLM takes a request's
# only under --trust-request-chat-template).
_TEMPLATE_FIELDS = ("messages", "add_generation_prompt", "continue_final_message", "tools",
                    "chat_template")


def chat_template_args(body) -> dict:
    """vLLM's chat extras: add_generation_prompt (default true), continue_final_message
    (default false; Tokenizer.render_chat refuses it beside add_generation_prompt, a
    400 through the server's _render) and chat_template_kwargs (more template variables,
    e.g. enable_thinking), as Tokenizer.render_chat's keywords."""
    out = {}
    for name, default in (("add_generation_prompt", True), ("continue_final_message", False)):
        value = body.get(name)
        if value is not None and not isinstance(value, bool):
            raise RequestError(f"{name}: expected a bool, got {json.dumps(value)[:80]}", name)
        out[name] = default if value is None else value
    extra = body.get("chat_template_kwargs")
    if extra is not None and (not isinstance(extra, dict)
                              or any(k in _TEMPLATE_FIELDS for k in extra)):
        raise RequestError("chat_template_kwargs: expected an object of template variables "
                           f"other than {', '.join(_TEMPLATE_FIELDS)}, got "
                           f"{json.dumps(extra)[:80]}", "chat_template_kwargs")
    return {**out, **(extra or {})}


def _template_tool_calls(calls, i):
    """An assistant message's tool_calls for the chat template: OpenAI sends each
    call's arguments as a JSON string; templates (Qwen's, Hermes') write them with
    tojson, so they get the object (vLLM does the same)."""
    if not isinstance(calls, list) or not all(
            isinstance(c, dict) and isinstance(c.get("function"), dict) for c in calls):
        raise RequestError(f"messages[{i}].tool_calls: expected a list of {{id, type, "
                           f"function: {{name, arguments}}}}, got {json.dumps(calls)[:80]}",
                           "messages")
    out = []
    for c in calls:
        args = c["function"].get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                raise RequestError(f"messages[{i}].tool_calls: expected arguments as a "
                                   f"JSON object string, got {args[:80]!r}",
                                   "messages") from None
        out.append({**c, "function": {**c["function"], "arguments": args}})
    return out


def parse_tools(body, parser) -> list | None:
    """The request's ``tools`` (OpenAI's [{type: function, function: {name, ...}}]) for
    the chat template, or None: without tools, with tool_choice "none", or (400) where
    the server has no tool-call parser or the choice forces a call."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if choice not in (None, "auto", "none"):
        raise RequestError("tool_choice: expected \"auto\" or \"none\" (flashtile does not "
                           f"force calls), got {json.dumps(choice)[:80]}", "tool_choice")
    if tools is None or choice == "none":
        return None
    if not isinstance(tools, list) or not all(
            isinstance(t, dict) and t.get("type") == "function"
            and isinstance(t.get("function"), dict)
            and isinstance(t["function"].get("name"), str) for t in tools):
        raise RequestError("tools: expected a list of {type: function, function: {name, "
                           f"description, parameters}}, got {json.dumps(tools)[:80]}", "tools")
    if parser is None:
        raise RequestError("tools: expected none (start the server with "
                           "--tool-call-parser hermes to use them), got "
                           f"{len(tools)}", "tools")
    return tools or None


def check_unsupported(body):
    for name, off in UNSUPPORTED.items():
        if body.get(name) not in off:
            raise RequestError(f"{name}: expected {' or '.join(map(json.dumps, off[1:]))} "
                               f"(flashtile does not support it), got "
                               f"{json.dumps(body[name])[:80]}", name)


def stream_flags(body) -> tuple[bool, bool, bool]:
    """(stream, include_usage, continuous_usage_stats) from ``stream`` and
    ``stream_options`` (continuous_usage_stats, vLLM's: every chunk carries its choice's
    usage so far)."""
    stream, options = body.get("stream"), body.get("stream_options")
    if stream is not None and not isinstance(stream, bool):
        raise RequestError(f"stream: expected a bool, got {json.dumps(stream)}", "stream")
    if options is None:
        return bool(stream), False, False
    flags = [options.get(k, False) for k in ("include_usage", "continuous_usage_stats")] \
        if isinstance(options, dict) else [None]
    if not stream or not all(isinstance(f, bool) for f in flags):
        raise RequestError("stream_options: expected {include_usage: bool, "
                           "continuous_usage_stats: bool} with stream=true, got "
                           f"{json.dumps(options)[:80]}", "stream_options")
    return True, *flags


def completion_logprobs(body):
    """/v1/completions' ``logprobs``: null or an int k in [0, MAX_LOGPROBS] (the
    engine's SamplingParams value: the chosen token's logprob and k alternatives)."""
    logprobs = body.get("logprobs")
    if logprobs is not None and (not is_token(logprobs)
                                 or not 0 <= logprobs <= MAX_LOGPROBS):
        raise RequestError(f"logprobs: expected null or an int in [0, {MAX_LOGPROBS}], "
                           f"got {json.dumps(logprobs)}", "logprobs")
    return logprobs


def echo_flag(body, chat: bool) -> bool:
    """``echo``: a bool; completions only."""
    echo = body.get("echo")
    if echo is not None and not isinstance(echo, bool):
        raise RequestError(f"echo: expected a bool, got {json.dumps(echo)[:80]}", "echo")
    if echo and chat:
        raise RequestError("echo: expected false or null in chat completions (flashtile "
                           "echoes prompts in /v1/completions), got true", "echo")
    return bool(echo)


def echoed(prompt_text, out, logprobs: bool):
    """(text, token ids, logprobs, alternatives) of choice ``out`` (a RequestOutput
    whose prompt_logprobs the engine computed when logprobs is true) with the prompt
    before its completion: the prompt's first token has no logprob (None), each later
    one its own and, where the completion has alternatives, those of its position."""
    c = out.outputs[0]
    text, ids = prompt_text + c.text, out.prompt_token_ids + c.token_ids
    if not logprobs:
        return text, ids, None, None
    prompt = out.prompt_logprobs
    lps = [None] + [p[t] for p, t in zip(prompt[1:], out.prompt_token_ids[1:])]
    top = None
    if c.top_logprobs is not None:
        top = [None] + [dict(p) for p in prompt[1:]] + c.top_logprobs
    return text, ids, lps + c.logprobs, top


def chat_logprobs(body):
    """/v1/chat/completions' ``logprobs`` (a bool) and ``top_logprobs`` (null, or an int
    in [0, MAX_LOGPROBS] with logprobs true), as SamplingParams' logprobs."""
    want, top = body.get("logprobs"), body.get("top_logprobs")
    if want is not None and not isinstance(want, bool):
        raise RequestError(f"logprobs: expected a bool, got {json.dumps(want)}", "logprobs")
    if top is not None and (not want or not is_token(top)
                            or not 0 <= top <= MAX_LOGPROBS):
        raise RequestError(f"top_logprobs: expected null, or an int in [0, {MAX_LOGPROBS}] "
                           f"with logprobs true, got {json.dumps(top)}", "top_logprobs")
    return (top or 0) if want else None


def logit_bias(body):
    """``logit_bias``: JSON's {"token id": bias} (keys are strings there) as {int: bias},
    or None."""
    bias = body.get("logit_bias")
    if bias is None:
        return None
    if not isinstance(bias, dict) or not all(
            isinstance(k, str) and k.isdecimal() for k in bias):
        raise RequestError("logit_bias: expected an object mapping token ids (decimal "
                           f"strings) to biases, got {json.dumps(bias)[:80]}", "logit_bias")
    return {int(k): v for k, v in bias.items()}


def sampling_params(body, logprobs, max_tokens, stream: bool,
                    prompt_logprobs=None) -> SamplingParams:
    """The request's SamplingParams; a field sent as null takes its default. The engine
    returns a streamed request's outputs as deltas, a whole one's once at the end."""
    kw = {k: body[k] for k in SAMPLING_FIELDS if body.get(k) is not None}
    n = kw.get("n", 1)
    # OpenAI's own bound. Without one a request's n fans out into that many requests
    # before the engine sees any: n = 1e30 held the server's loop forever (a fuzz,
    # session 36).
    if isinstance(n, int) and not isinstance(n, bool) and n > MAX_N:
        raise RequestError(f"n: expected an int in [1, {MAX_N}], got {n}", "n")
    kw["logit_bias"] = logit_bias(body)
    kind = RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY
    try:
        return SamplingParams(logprobs=logprobs, max_tokens=max_tokens, output_kind=kind,
                              prompt_logprobs=prompt_logprobs, **kw)
    except (TypeError, ValueError) as err:
        raise RequestError(str(err), param_of(err)) from None


def beam_search_params(body, params, stream: bool, echo: bool, longest_prompt: int,
                       max_model_len: int):
    """vLLM's ``use_beam_search`` (with ``length_penalty``): the BeamSearchParams of the
    request's n beams a prompt, its max_tokens (null: up to max_model_len), ignore_eos
    and temperature; None without it. Refused beside it, rather than ignored: stream,
    logprobs and echo (the beams are known at the end, without their logprobs), stop
    strings and ids, penalties and other logit changes (the search ranks raw logprobs)."""
    from flashtile.engine.beam_search import BeamSearchParams

    flag = body.get("use_beam_search")
    if flag is not None and not isinstance(flag, bool):
        raise RequestError(f"use_beam_search: expected a bool, got {json.dumps(flag)[:80]}",
                           "use_beam_search")
    if not flag:
        return None
    if stream or echo or params.logprobs is not None or params.stop \
            or params.stop_token_ids or params.adjusts_logits:
        raise RequestError("use_beam_search: expected a request without stream, echo, "
                           "logprobs, stop, stop_token_ids, penalties, logit_bias, "
                           "min_tokens, allowed_token_ids or bad_words beside it",
                           "use_beam_search")
    penalty = body.get("length_penalty", 1.0)
    if isinstance(penalty, bool) or not isinstance(penalty, (int, float)):
        raise RequestError(f"length_penalty: expected a number, got "
                           f"{json.dumps(penalty)[:80]}", "length_penalty")
    if params.n > MAX_LOGPROBS // 2:
        raise RequestError(f"n: expected an int in [1, {MAX_LOGPROBS // 2}] with "
                           f"use_beam_search (the beams of a prompt), got {params.n}", "n")
    return BeamSearchParams(beam_width=params.n,
                            max_tokens=params.max_tokens or max_model_len - longest_prompt,
                            ignore_eos=params.ignore_eos, temperature=params.temperature,
                            length_penalty=float(penalty))


def check_fits(prompt, params, param, limit):
    """The prompt plus max_tokens within the context length ``limit``."""
    n, m = len(prompt), params.max_tokens
    if n >= limit or (m is not None and n + m > limit):
        raise RequestError(
            f"This model's maximum context length is {limit} tokens. However, you "
            f"requested {n + (m or 1)} tokens ({n} in the {param}, {m or 1} in the "
            f"completion). Please reduce the length of the {param} or max_tokens.",
            "max_tokens" if n < limit else param, code="context_length_exceeded")


# ---- responses ------------------------------------------------------------------------
def choice(chat, index, text, token_ids, logprobs, offset, tokenizer, delta=False,
           top=None) -> dict:
    """One entry of ``choices`` without its finish_reason: the text (a message, or a
    delta when streamed) of the tokens ``token_ids`` and, when ``logprobs`` is not None,
    their logprobs (``top``: each position's alternatives, or None); ``offset``: the
    characters of the completion before ``text``."""
    lp = None
    if logprobs is not None:
        lp = logprobs_body(chat, token_ids, logprobs, offset, tokenizer, top)
    if chat:
        key = "delta" if delta else "message"
        message = {"content": text} if delta else {"role": "assistant", "content": text}
        return {"index": index, key: message, "logprobs": lp}
    return {"index": index, "text": text, "logprobs": lp}


def _token_str(t, tokenizer) -> str:
    return tokenizer.decode([t], skip_special_tokens=False) if tokenizer is not None \
        else f"token_id:{t}"


def logprobs_body(chat, token_ids, logprobs, offset, tokenizer, top=None) -> dict:
    """OpenAI's shapes: chat {"content": [{token, logprob, bytes, top_logprobs}]},
    completions {tokens, token_logprobs, top_logprobs, text_offset}; ``top``: per
    position {token id: logprob} of the alternatives, or None."""
    tokens = [_token_str(t, tokenizer) for t in token_ids]
    alternatives = [None if alt is None else [(_token_str(t, tokenizer), v)
                                              for t, v in alt.items()] for alt in top] \
        if top is not None else None
    if chat:
        return {"content": [
            {"token": s, "logprob": lp, "bytes": list(s.encode()), "top_logprobs": [
                {"token": a, "logprob": v, "bytes": list(a.encode())}
                for a, v in (alternatives[i] if alternatives else [])]}
            for i, (s, lp) in enumerate(zip(tokens, logprobs))]}
    offsets = []
    for s in tokens:
        offsets.append(offset)
        offset += len(s)
    # OpenAI's legacy shape: a {token string: logprob} object per position.
    return {"tokens": tokens, "token_logprobs": list(logprobs),
            "top_logprobs": [None if a is None else dict(a) for a in alternatives]
            if alternatives else None,
            "text_offset": offsets}


def usage(outputs, n: int = 1, details: bool = False) -> dict:
    """usage over the whole RequestOutputs of a request's prompts, n completions each
    (in a row: a prompt counts once); details: with prompt_tokens_details."""
    cached = sum(o.num_cached_tokens for o in outputs[::n]) if details else None
    return usage_body(sum(len(o.prompt_token_ids) for o in outputs[::n]),
                      sum(len(o.outputs[0].token_ids) for o in outputs), cached)


def usage_body(prompt_tokens: int, completion_tokens: int, cached_tokens=None) -> dict:
    """OpenAI's usage; cached_tokens (not None: --enable-prompt-tokens-details, vLLM's
    flag): the prompt tokens taken from the prefix cache, as prompt_tokens_details."""
    body = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:
        body["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return body


def sse(data) -> bytes:
    """One server-sent event carrying data as JSON."""
    return b"data: " + json.dumps(data, ensure_ascii=False).encode() + b"\n\n"


class ChunkFormat:
    """The token chunks of one streamed response: ``chunk(...)`` is byte for byte
    ``sse({**head, "choices": [choice(..., delta=True) + finish_reason], "usage": null})``
    (usage only with include_usage), with what is the same in every chunk (id, object,
    created, model, usage) encoded once: a busy server writes one chunk per step for
    each of hundreds of streams, and json.dumps of the whole dict costs more than the
    rest of a chunk's way to the socket."""

    def __init__(self, head: dict, chat: bool, include_usage: bool):
        opening = json.dumps({**head, "choices": None}, ensure_ascii=False)
        self.start = "data: " + opening[:-len("null}")] + "["  # ..., "choices": [
        self.end = ('], "usage": null}' if include_usage else "]}") + "\n\n"
        content = '"delta": {"content": %s}' if chat else '"text": %s'
        self.choice = '{"index": %d, ' + content + ', "logprobs": %s, "finish_reason": %s}'
        self.chat = chat

    def chunk(self, index, text, token_ids, logprobs, offset, finish_reason,
              tokenizer, top=None, usage=None) -> tuple[bytes, int]:
        """The chunk of choice ``index``'s new ``text`` and ``token_ids`` (their
        ``logprobs`` or None, ``top`` their alternatives or None; ``offset``: the
        characters streamed before; ``usage``: a usage body for this chunk, else null
        with include_usage), and the offset the choice's next chunk starts at.
        With completions' logprobs that counts each token's own string, as text_offset
        does (so a stream's offsets equal the whole response's), else the text's."""
        lp, after = "null", offset + len(text)
        if logprobs is not None:
            body = logprobs_body(self.chat, token_ids, logprobs, offset, tokenizer, top)
            lp = json.dumps(body, ensure_ascii=False)
            if not self.chat:
                after = offset + sum(map(len, body["tokens"]))
        reason = "null" if finish_reason is None else _json_str(finish_reason)
        end = self.end if usage is None else f'], "usage": {json.dumps(usage)}}}\n\n'
        return (self.start + self.choice % (index, _json_str(text), lp, reason)
                + end).encode(), after


# json.dumps(s, ensure_ascii=False) of a str s, without JSONEncoder's dispatch.
_json_str = json.encoder.encode_basestring
