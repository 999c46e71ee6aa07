"""flashtile serve: the OpenAI-compatible server over a tiny random checkpoint on CPU,
through a real socket on 127.0.0.1. Endpoint schemas; answers equal LLM.generate/chat;
SSE order and [DONE]; concurrent clients; a client leaving mid-stream frees its pages;
bad requests get OpenAI error bodies and the server keeps answering."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
import torch

from flashtile.engine import SamplingParams
from tests.engine_utils import VOCAB, ServerThread, engine_cpu, tiny_llm

aiohttp = pytest.importorskip("aiohttp")
from flashtile.engine.server import AsyncEngine, build_app  # noqa: E402

__all__ = ["engine_cpu"]  # the autouse fixture, imported to apply here
pytestmark = pytest.mark.timeout(120)
MODEL = "tiny"
MAX_MODEL_LEN = 64


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def llm(tmp_path_factory, request):
    """The engine in both scheduling modes (asynchronous: step() returns each step's
    tokens one call later)."""
    yield from tiny_llm(tmp_path_factory, MAX_MODEL_LEN, async_scheduling=request.param)


@pytest.fixture(scope="module")
def server(llm):
    with ServerThread.over(llm, MODEL) as s:
        yield s


def run(coro, timeout=60):
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def _request(url, body=None, method="POST", data=None):
    """(status, JSON body or None)."""
    async with aiohttp.ClientSession() as session:
        async with session.request(method, url, json=body, data=data) as r:
            text = await r.text()
            return r.status, (json.loads(text) if text else None)


async def _events(url, body):
    """The SSE events of a streamed request: parsed JSON chunks, then "[DONE]"."""
    async with aiohttp.ClientSession() as session:
        async with session.post(url, json=body) as r:
            assert r.status == 200 and r.content_type == "text/event-stream"
            raw = (await r.read()).decode()
    assert raw.endswith("\n\n")
    events = raw[:-2].split("\n\n")
    assert all(e.startswith("data: ") for e in events)
    return [e[6:] if e == "data: [DONE]" else json.loads(e[6:]) for e in events]


def post(server, path, body, **kw):
    return run(_request(server.url + path, body, **kw))


def _greedy(**kw):
    return dict(dict(temperature=0, max_tokens=8, ignore_eos=True), **kw)


def _assert_idle(llm):
    bm = llm.block_manager
    deadline = time.monotonic() + 10
    while (llm.has_unfinished_requests() or bm.num_free_blocks != bm.num_blocks) \
            and time.monotonic() < deadline:
        time.sleep(0.02)
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks and not llm.has_unfinished_requests()


def test_models_and_health(server, llm):
    status, body = run(_request(server.url + "/v1/models", method="GET"))
    assert status == 200 and body["object"] == "list"
    (card,) = body["data"]
    assert card["id"] == MODEL and card["object"] == "model" and card["owned_by"]
    assert isinstance(card["created"], int)
    assert card["max_model_len"] == MAX_MODEL_LEN and card["vocab_size"] == VOCAB
    assert run(_request(server.url + "/health", method="GET")) == (200, None)


def test_completion_equals_generate(server, llm):
    ids = llm.tokenizer.encode("The capital")
    want = llm.generate(["Hello world", ids], SamplingParams(**_greedy(logprobs=0)),
                        use_tqdm=False)
    status, body = post(server, "/v1/completions", dict(
        model=MODEL, prompt=["Hello world", ids], logprobs=0, **_greedy()))
    assert status == 200
    assert set(body) == {"id", "object", "created", "model", "choices", "usage"}
    assert body["object"] == "text_completion" and body["model"] == MODEL
    assert body["id"].startswith("cmpl-") and isinstance(body["created"], int)
    for i, (choice, w) in enumerate(zip(body["choices"], want)):
        c = w.outputs[0]
        assert set(choice) == {"index", "text", "logprobs", "finish_reason"}
        assert choice["index"] == i and choice["text"] == c.text
        assert choice["finish_reason"] == "length"
        lp = choice["logprobs"]
        assert lp["token_logprobs"] == pytest.approx(c.logprobs, abs=1e-5)
        assert lp["tokens"] == [llm.tokenizer.decode([t], False) for t in c.token_ids]
        assert lp["text_offset"][0] == 0 and lp["top_logprobs"] is None
    prompt_tokens = sum(len(w.prompt_token_ids) for w in want)
    assert body["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": 16,
                             "total_tokens": prompt_tokens + 16}
    # One prompt, as a string or a token id list, and a stop string.
    text = want[0].outputs[0].text
    for prompt in ("Hello world", llm.tokenizer.encode("Hello world")):
        _, body = post(server, "/v1/completions", dict(prompt=prompt, **_greedy()))
        assert body["choices"][0]["text"] == text and body["choices"][0]["logprobs"] is None
    stop = text[2:5]
    _, body = post(server, "/v1/completions", dict(prompt="Hello world", stop=stop,
                                                   **_greedy()))
    assert body["choices"][0] == {"index": 0, "text": text[:text.index(stop)],
                                  "logprobs": None, "finish_reason": "stop"}
    _assert_idle(llm)


def test_chat_equals_llm_chat(server, llm):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "How are you?"}]}]
    want = llm.chat([{"role": "system", "content": "Be brief."},
                     {"role": "user", "content": "How are you?"}],
                    SamplingParams(**_greedy(max_tokens=6, logprobs=0)), use_tqdm=False)[0]
    status, body = post(server, "/v1/chat/completions", dict(
        model=MODEL, messages=messages, max_completion_tokens=6, logprobs=True,
        **_greedy(max_tokens=None)))
    assert status == 200 and body["object"] == "chat.completion"
    assert body["id"].startswith("chatcmpl-")
    (choice,) = body["choices"]
    assert choice["message"] == {"role": "assistant", "content": want.outputs[0].text}
    assert choice["finish_reason"] == "length" and choice["index"] == 0
    content = choice["logprobs"]["content"]
    assert [e["logprob"] for e in content] == pytest.approx(want.outputs[0].logprobs,
                                                            abs=1e-5)
    assert all(e["bytes"] == list(e["token"].encode()) and e["top_logprobs"] == []
               for e in content)
    assert body["usage"]["prompt_tokens"] == len(want.prompt_token_ids)
    assert body["usage"]["completion_tokens"] == 6
    # No max_tokens: OpenAI's chat default, up to the context length (not 16).
    _, body = post(server, "/v1/chat/completions", dict(messages=messages, **_greedy(
        max_tokens=None)))
    usage = body["usage"]
    assert usage["total_tokens"] == MAX_MODEL_LEN and usage["completion_tokens"] > 16
    assert body["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_stream_order_and_done(server, llm, chat):
    path = "/v1/chat/completions" if chat else "/v1/completions"
    prompt = {"messages": [{"role": "user", "content": "Hello"}]} if chat \
        else {"prompt": "Hello world"}
    body = dict(prompt, **_greedy(max_tokens=10))
    _, whole = post(server, path, body)
    events = run(_events(server.url + path, dict(body, stream=True,
                                                 stream_options={"include_usage": True})))
    assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
    usage, chunks = events[-2], events[:-2]
    assert usage["choices"] == [] and usage["usage"] == whole["usage"]
    assert len({c["id"] for c in events[:-1]}) == 1
    assert all(c["object"] == ("chat.completion.chunk" if chat else "text_completion")
               and c["usage"] is None for c in chunks)
    if chat:  # the role first, then a chunk per token (or several, if the reader lags)
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        chunks = chunks[1:]
        text = "".join(c["choices"][0]["delta"]["content"] for c in chunks)
        assert text == whole["choices"][0]["message"]["content"]
    else:
        text = "".join(c["choices"][0]["text"] for c in chunks)
        assert text == whole["choices"][0]["text"]
    assert 1 <= len(chunks) <= 10
    reasons = [c["choices"][0]["finish_reason"] for c in chunks]
    assert reasons == [None] * (len(chunks) - 1) + ["length"]
    # Without stream_options: no usage chunk, no usage field.
    events = run(_events(server.url + path, dict(body, stream=True)))
    assert events[-1] == "[DONE]" and 2 + chat <= len(events) <= 11 + chat
    assert all("usage" not in c for c in events[:-1])
    # continuous_usage_stats (vLLM's): each token chunk carries its choice's usage so
    # far, up to the whole response's; the closing usage chunk stays.
    events = run(_events(server.url + path, dict(body, stream=True, stream_options={
        "include_usage": True, "continuous_usage_stats": True})))
    chunks = events[1 + chat:-2]
    so_far = [c["usage"]["completion_tokens"] for c in chunks]
    assert so_far == sorted(so_far) and so_far[-1] == whole["usage"]["completion_tokens"]
    assert all(c["usage"]["prompt_tokens"] == whole["usage"]["prompt_tokens"]
               for c in chunks)
    assert chunks[-1]["usage"] == whole["usage"] == events[-2]["usage"]
    _assert_idle(llm)


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_n_completions_are_choices(server, llm, chat):
    """n = 3 with a seed, two prompts (completions) or one conversation (chat): choice
    i * n + j is LLM.generate's completion j of prompt i, whole and streamed (each
    choice's role first in chat), and usage counts each prompt once."""
    sampled = dict(temperature=1.0, seed=11, max_tokens=6, ignore_eos=True)
    if chat:
        messages = [{"role": "user", "content": "Hello"}]
        want = llm.chat(messages, SamplingParams(n=3, **sampled), use_tqdm=False)
        body = dict(messages=messages, n=3, **sampled)
    else:
        want = llm.generate(["Hello world", "The capital"], SamplingParams(n=3, **sampled),
                            use_tqdm=False)
        body = dict(prompt=["Hello world", "The capital"], n=3, **sampled)
    texts = [c.text for w in want for c in w.outputs]
    assert len(set(texts)) > 1  # seeded seed + j: different draws
    path = "/v1/chat/completions" if chat else "/v1/completions"
    status, whole = post(server, path, body)
    assert status == 200 and [c["index"] for c in whole["choices"]] == list(range(len(texts)))
    got = [c["message"]["content"] if chat else c["text"] for c in whole["choices"]]
    assert got == texts
    prompt_tokens = sum(len(w.prompt_token_ids) for w in want)
    assert whole["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": 6 * len(texts),
                              "total_tokens": prompt_tokens + 6 * len(texts)}
    events = run(_events(server.url + path, dict(body, stream=True,
                                                 stream_options={"include_usage": True})))
    assert events[-1] == "[DONE]" and events[-2]["usage"] == whole["usage"]
    streamed, roles = [""] * len(texts), []
    for e in events[:-2]:
        for c in e["choices"]:
            if chat and "role" in c["delta"]:
                roles.append(c["index"])
                assert not streamed[c["index"]]  # the role before any content
            streamed[c["index"]] += c["delta"]["content"] if chat else c["text"]
    assert streamed == texts and sorted(roles) == (list(range(len(texts))) if chat else [])
    _assert_idle(llm)


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_top_logprobs_in_both_shapes(server, llm, chat):
    """logprobs=k (completions) and top_logprobs=k (chat): OpenAI's shapes of
    LLM.generate's alternatives, whole and streamed, with the token strings."""
    want = llm.generate(["Hello world"], SamplingParams(**_greedy(max_tokens=5,
                                                                  logprobs=3)),
                        use_tqdm=False)[0].outputs[0]
    text = [{llm.tokenizer.decode([t], False): v for t, v in alt.items()}
            for alt in want.top_logprobs]
    if chat:  # the same prompt through /v1/completions' string, so compare the shape
        body = dict(messages=[{"role": "user", "content": "Hello"}], logprobs=True,
                    top_logprobs=3, **_greedy(max_tokens=5))
        _, whole = post(server, "/v1/chat/completions", body)
        content = whole["choices"][0]["logprobs"]["content"]
        assert len(content) == 5
        for entry in content:
            alts = entry["top_logprobs"]
            assert len(alts) == 3 and alts[0]["token"] == entry["token"]
            assert alts[0]["logprob"] == pytest.approx(entry["logprob"], abs=1e-5)
            assert all(a["bytes"] == list(a["token"].encode()) for a in alts)
            assert [a["logprob"] for a in alts] == sorted((a["logprob"] for a in alts),
                                                          reverse=True)
        events = run(_events(server.url + "/v1/chat/completions", dict(body, stream=True)))
        streamed = [e for ev in events[:-1] for c in ev["choices"] if c["logprobs"]
                    for e in c["logprobs"]["content"]]
        assert [e["top_logprobs"] for e in streamed] == [e["top_logprobs"] for e in content]
    else:
        body = dict(prompt="Hello world", logprobs=3, **_greedy(max_tokens=5))
        _, whole = post(server, "/v1/completions", body)
        got = whole["choices"][0]["logprobs"]["top_logprobs"]
        assert [list(a) for a in got] == [list(a) for a in text]
        for g, w in zip(got, text):
            assert list(g.values()) == pytest.approx(list(w.values()), abs=1e-5)
        events = run(_events(server.url + "/v1/completions", dict(body, stream=True)))
        streamed = [a for e in events[:-1] for a in e["choices"][0]["logprobs"]["top_logprobs"]]
        assert streamed == got
    _assert_idle(llm)


@pytest.mark.parametrize("logprobs", [None, 0, 2], ids=["text", "lp0", "lp2"])
def test_echo_puts_the_prompt_first(server, llm, logprobs):
    """echo=true (completions): each choice's text is its prompt (a string as sent,
    token ids decoded) then the completion; with logprobs, the prompt tokens' logprobs
    (the engine's prompt_logprobs: the first null) then the completion's, and their
    alternatives where asked; whole and streamed; n choices each echo their prompt."""
    prompts = ["Hello world", [5, 9, 14, 3]]
    sp = SamplingParams(**_greedy(max_tokens=4, logprobs=logprobs,
                                  prompt_logprobs=logprobs))
    want = llm.generate(prompts, sp, use_tqdm=False)
    texts = ["Hello world", llm.tokenizer.decode(prompts[1], skip_special_tokens=False)]
    body = dict(prompt=prompts, echo=True, n=2, **_greedy(max_tokens=4))
    if logprobs is not None:
        body["logprobs"] = logprobs
    _, whole = post(server, "/v1/completions", body)
    events = run(_events(server.url + "/v1/completions", dict(body, stream=True)))
    streamed = {}
    for ev in events[:-1]:
        for c in ev["choices"]:
            streamed.setdefault(c["index"], []).append(c)
    assert sorted(streamed) == [0, 1, 2, 3]
    for c in whole["choices"]:
        i, out = c["index"] // 2, want[c["index"] // 2]
        ids = out.prompt_token_ids + out.outputs[0].token_ids
        assert c["text"] == texts[i] + out.outputs[0].text
        assert "".join(x["text"] for x in streamed[c["index"]]) == c["text"]
        if logprobs is None:
            assert c["logprobs"] is None
            continue
        lp = c["logprobs"]
        assert lp["tokens"] == [llm.tokenizer.decode([t], False) for t in ids]
        assert lp["token_logprobs"][0] is None
        wanted = [out.prompt_logprobs[j][t] for j, t in
                  enumerate(out.prompt_token_ids) if j] + out.outputs[0].logprobs
        assert lp["token_logprobs"][1:] == pytest.approx(wanted, abs=1e-5)
        assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
        if logprobs:
            top = lp["top_logprobs"]
            assert top[0] is None and len(top) == len(ids)
            for j, t in enumerate(out.prompt_token_ids[1:], 1):
                assert llm.tokenizer.decode([t], False) in top[j]
                assert logprobs <= len(top[j]) <= logprobs + 1
        else:
            assert lp["top_logprobs"] is None
        flat = {k: [v for x in streamed[c["index"]] for v in x["logprobs"][k]]
                for k in ("tokens", "text_offset")}
        assert flat == {k: lp[k] for k in flat}
    assert whole["usage"]["prompt_tokens"] == sum(len(o.prompt_token_ids) for o in want)
    _assert_idle(llm)


def test_tokenize_and_detokenize(server, llm):
    """vLLM's /tokenize (a prompt, with or without special tokens, or messages through
    the chat template) and /detokenize give the tokenizer's own answers."""
    tok = llm.tokenizer
    status, out = post(server, "/tokenize", {"prompt": "Hello world"})
    assert status == 200
    assert out == {"count": len(out["tokens"]), "max_model_len": MAX_MODEL_LEN,
                   "tokens": tok.encode("Hello world")}
    _, plain = post(server, "/tokenize", {"prompt": "Hello world",
                                          "add_special_tokens": False})
    assert plain["tokens"] == tok.encode("Hello world", add_special_tokens=False)
    assert plain["tokens"] != out["tokens"]  # the template's tokenizer adds <s>
    messages = [{"role": "user", "content": "Hello"}]
    for flag in (True, False):
        _, chat = post(server, "/tokenize", {"messages": messages,
                                             "add_generation_prompt": flag})
        assert chat["tokens"] == tok.apply_chat_template(messages, flag)
    status, back = post(server, "/detokenize", {"tokens": out["tokens"]})
    assert status == 200 and back == {"prompt": tok.decode(out["tokens"])}


def test_truncate_prompt_tokens(server, llm):
    """truncate_prompt_tokens (vLLM's field): a prompt longer than the context keeps its
    last k tokens and is answered as those alone would be; echo shows the kept text;
    in chat the rendered conversation is cut the same way."""
    g = torch.Generator().manual_seed(11)
    long = torch.randint(3, VOCAB, (MAX_MODEL_LEN + 20,), generator=g).tolist()
    status, out = post(server, "/v1/completions", dict(
        prompt=long, truncate_prompt_tokens=10, echo=True, **_greedy(max_tokens=4)))
    assert status == 200, out
    want = llm.generate([long[-10:]], SamplingParams(**_greedy(max_tokens=4)),
                        use_tqdm=False)[0]
    kept = llm.tokenizer.decode(long[-10:], skip_special_tokens=False)
    assert out["choices"][0]["text"] == kept + want.outputs[0].text
    assert out["usage"]["prompt_tokens"] == 10
    messages = [{"role": "user", "content": "The capital of France?"}]
    status, chat = post(server, "/v1/chat/completions", dict(
        messages=messages, truncate_prompt_tokens=5, **_greedy(max_tokens=3)))
    assert status == 200 and chat["usage"]["prompt_tokens"] == 5
    want = llm.generate([llm.tokenizer.apply_chat_template(messages)[-5:]],
                        SamplingParams(**_greedy(max_tokens=3)), use_tqdm=False)[0]
    assert chat["choices"][0]["message"]["content"] == want.outputs[0].text


async def _metrics(url) -> tuple[str, dict]:
    """/metrics' content type and samples: {name{labels}: value}."""
    async with aiohttp.ClientSession() as session:
        async with session.get(url + "/metrics") as r:
            assert r.status == 200
            ctype, text = r.headers["Content-Type"], await r.text()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return ctype, samples


def test_metrics(server, llm):
    """vLLM's /metrics under its names: token and request counters grow by what the
    requests sent in between used (usage's figures), each histogram counts them once
    (the +Inf bucket equal to _count, buckets non-decreasing), the gauges read an idle
    engine; Prometheus' text content type."""
    lab = f'model_name="{MODEL}"'
    ctype, before = run(_metrics(server.url))
    assert ctype.startswith("text/plain; version=0.0.4")
    outs = [post(server, "/v1/completions", dict(prompt=p, **_greedy(max_tokens=m)))[1]
            for p, m in (("Hello world", 5), ("The capital of France", 3))]
    _assert_idle(llm)
    _, after = run(_metrics(server.url))

    def grew(name):
        return after[f"vllm:{name}{{{lab}}}"] - before.get(f"vllm:{name}{{{lab}}}", 0)

    assert grew("prompt_tokens_total") == sum(o["usage"]["prompt_tokens"] for o in outs)
    assert grew("generation_tokens_total") == 8
    key = f'vllm:request_success_total{{finished_reason="length",{lab}}}'
    assert after[key] - before.get(key, 0) == 2
    for h in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
              "request_time_per_output_token_seconds", "request_prompt_tokens",
              "request_generation_tokens"):
        assert grew(f"{h}_count") == 2, h
        buckets = [v for k, v in after.items() if k.startswith(f"vllm:{h}_bucket")]
        assert buckets == sorted(buckets) and buckets[-1] == after[f"vllm:{h}_count{{{lab}}}"]
    assert grew("request_generation_tokens_sum") == 8
    assert after[f"vllm:num_requests_running{{{lab}}}"] == 0
    assert after[f"vllm:num_requests_waiting{{{lab}}}"] == 0
    assert after[f"vllm:kv_cache_usage_perc{{{lab}}}"] == 0
    assert grew("prefix_cache_queries_total") >= grew("prefix_cache_hits_total") >= 0


def test_prompt_tokens_details(server, llm):
    """--enable-prompt-tokens-details (vLLM's flag): usage.prompt_tokens_details.
    cached_tokens is what the prefix cache gave: nothing to a new prompt, its two full
    pages (32 tokens) to one sharing them, whole, in a stream's usage chunk and to beam
    search's prompts; without the flag usage has no such field."""
    g = torch.Generator().manual_seed(5)
    shared = torch.randint(3, VOCAB, (40,), generator=g).tolist()
    with ServerThread(build_app(AsyncEngine(lambda: llm), MODEL, None, True)) as s:
        status, first = run(_request(s.url + "/v1/completions",
                                     dict(prompt=shared, **_greedy(max_tokens=3))))
        assert status == 200
        assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
        _, again = run(_request(s.url + "/v1/completions",
                                dict(prompt=shared[:-1] + [7], **_greedy(max_tokens=3))))
        assert again["usage"]["prompt_tokens_details"] == {"cached_tokens": 32}
        events = run(_events(s.url + "/v1/completions", dict(
            prompt=shared[:-2] + [8], stream=True, stream_options={"include_usage": True},
            **_greedy(max_tokens=3))))
        assert events[-2]["usage"]["prompt_tokens_details"] == {"cached_tokens": 32}
        # use_beam_search: what the cache gave the prompts (their first step), here two
        # prompts sharing the two pages (the first step's requests run as one batch).
        _, beams = run(_request(s.url + "/v1/completions", dict(
            prompt=[shared[:-3] + [9], shared[:-4] + [10, 11]], use_beam_search=True, n=2,
            max_tokens=2)))
        assert beams["usage"]["prompt_tokens_details"] == {"cached_tokens": 64}
    _, plain = post(server, "/v1/completions", dict(prompt=shared, **_greedy()))
    assert "prompt_tokens_details" not in plain["usage"]
    _assert_idle(llm)


def test_metrics_escape_the_model_name():
    """A label value keeps its quotes, backslashes and newlines escaped; token buckets
    go 1, 2, 5, 10, ... up to max_model_len."""
    from flashtile.engine import metrics

    assert metrics._label('a "b"\\c\nd') == 'a \\"b\\"\\\\c\\nd'
    assert metrics.token_buckets(64) == (1, 2, 5, 10, 20, 50)
    h = metrics.Histogram((1.0, 2.0))
    for x in (0.5, 1.0, 1.5, 9.0):
        h.observe(x)
    assert h.counts == [2, 1, 1] and h.sum == 12.0


def test_beam_search_requests(server, llm):
    """vLLM's use_beam_search: n beams a prompt come back as its n choices, best first,
    the LLM's own beam search's (a batch of two prompts in completions, a conversation
    in chat); usage counts every returned beam's tokens."""
    from flashtile.engine import BeamSearchParams

    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (5, 9)]
    status, out = post(server, "/v1/completions", dict(
        prompt=prompts, use_beam_search=True, n=3, max_tokens=4, ignore_eos=True,
        length_penalty=0.5))
    assert status == 200, out
    want = llm.beam_search([{"prompt_token_ids": p} for p in prompts], BeamSearchParams(
        beam_width=3, max_tokens=4, ignore_eos=True, length_penalty=0.5))
    assert [c["text"] for c in out["choices"]] == [b.text for r in want for b in r.sequences]
    assert [c["index"] for c in out["choices"]] == list(range(6))
    assert out["usage"]["completion_tokens"] == 6 * 4
    messages = [{"role": "user", "content": "The capital of France?"}]
    status, chat = post(server, "/v1/chat/completions", dict(
        messages=messages, use_beam_search=True, n=2, max_tokens=3))
    assert status == 200, chat
    want = llm.beam_search({"prompt_token_ids": llm.tokenizer.apply_chat_template(messages)},
                           BeamSearchParams(beam_width=2, max_tokens=3))[0]
    assert [c["message"]["content"] for c in chat["choices"]] == \
        [b.text for b in want.sequences]
    _assert_idle(llm)


def test_chat_template_extras(server, llm):
    """vLLM's chat extras: continue_final_message (the last message left open for the
    model to continue, add_generation_prompt false beside it) and chat_template_kwargs
    (template variables: here the bos_token the template writes) reach the template, in
    /tokenize and in chat completions, whose answer continues that prompt."""
    tok = llm.tokenizer
    messages = [{"role": "user", "content": "The capital of France?"},
                {"role": "assistant", "content": "The capital is "}]
    extras = dict(add_generation_prompt=False, continue_final_message=True)
    _, out = post(server, "/tokenize", {"messages": messages, **extras})
    want = tok.apply_chat_template(messages, **extras)
    assert out["tokens"] == want
    assert tok.decode(want, skip_special_tokens=False).endswith("The capital is")
    _, swapped = post(server, "/tokenize", {"messages": messages[:1],
                                            "chat_template_kwargs": {"bos_token": "Hey"}})
    assert swapped["tokens"] == tok.apply_chat_template(messages[:1], bos_token="Hey")
    assert swapped["tokens"] != tok.apply_chat_template(messages[:1])
    status, chat = post(server, "/v1/chat/completions",
                        dict(messages=messages, **extras, **_greedy(max_tokens=5)))
    assert status == 200, chat
    expected = llm.generate([want], SamplingParams(**_greedy(max_tokens=5)),
                            use_tqdm=False)[0]
    assert chat["choices"][0]["message"]["content"] == expected.outputs[0].text
    assert chat["usage"]["prompt_tokens"] == len(want)


def test_concurrent_clients_get_their_own_answers(server, llm):
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist()
               for n in (3, 17, 9, 30, 5, 22, 12, 40)]
    params = [SamplingParams(**_greedy(max_tokens=6 + i)) for i in range(8)]
    want = [llm.generate([p], sp, use_tqdm=False)[0].outputs[0].text
            for p, sp in zip(prompts, params)]

    async def one(i):
        body = dict(prompt=prompts[i], **_greedy(max_tokens=6 + i))
        if i % 2:  # half of them streamed
            events = await _events(server.url + "/v1/completions", dict(body, stream=True))
            return "".join(e["choices"][0]["text"] for e in events[:-1])
        status, out = await _request(server.url + "/v1/completions", body)
        return out["choices"][0]["text"]

    async def all_at_once():
        return await asyncio.gather(*(one(i) for i in range(8)))

    assert run(all_at_once()) == want
    _assert_idle(llm)


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
def test_client_leaving_frees_its_pages(server, llm, monkeypatch, stream):
    bm = llm.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    step, abort, aborted = llm.step, llm.abort_request, []

    def slow_step():  # 20 ms a step: the request is far from done when the client leaves
        time.sleep(0.02)
        return step()

    def spy_abort(request_id):
        aborted.append(request_id)
        abort(request_id)

    monkeypatch.setattr(llm, "step", slow_step)
    monkeypatch.setattr(llm, "abort_request", spy_abort)

    async def leave_midway():
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        body = json.dumps(dict(prompt=list(range(3, 33)), stream=stream,
                               **_greedy(max_tokens=30))).encode()
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        await writer.drain()
        if stream:  # two tokens streamed
            seen = b""
            while seen.count(b"data: ") < 2:
                seen += await reader.read(4096)
        else:  # the request is running
            while bm.num_free_blocks == bm.num_blocks:
                await asyncio.sleep(0.005)
        in_use = bm.num_blocks - bm.num_free_blocks
        writer.close()
        return in_use

    assert run(leave_midway()) >= 2  # 30 prompt tokens and more, in pages of 16
    _assert_idle(llm)
    assert len(aborted) == 1


def test_health_fails_when_the_engine_loop_is_gone(llm):
    engine = AsyncEngine(lambda: llm)
    with ServerThread(build_app(engine, MODEL)) as s:
        assert run(_request(s.url + "/health", method="GET"))[0] == 200
        s.loop.call_soon_threadsafe(engine._task.cancel)
        status, out = run(_request(s.url + "/health", method="GET"))
        assert status == 503 and out["error"]["type"] == "internal_server_error"
        status, out = run(_request(s.url + "/v1/completions", dict(prompt="Hi")))
        assert status == 500 and "engine loop is not running" in out["error"]["message"]


BAD = [  # (path, body (dict, or raw bytes), status, param, code)
    ("/v1/completions", b"{not json", 400, None, None),
    ("/v1/completions", b"[1, 2]", 400, None, None),
    ("/v1/completions", dict(model="gpt-4", prompt="Hi"), 404, "model", "model_not_found"),
    ("/v1/chat/completions", dict(model="gpt-4", messages=[]), 404, "model",
     "model_not_found"),
    ("/v1/completions", dict(prompt="Hi", max_tokens=MAX_MODEL_LEN), 400, "max_tokens",
     "context_length_exceeded"),
    ("/v1/completions", dict(prompt=[5] * MAX_MODEL_LEN), 400, "prompt",
     "context_length_exceeded"),
    ("/v1/chat/completions", dict(messages=[{"role": "user", "content": "Hi"}],
                                  max_completion_tokens=1000), 400, "max_tokens",
     "context_length_exceeded"),
    ("/v1/completions", dict(prompt="Hi", temperature=-1), 400, "temperature", None),
    ("/v1/completions", dict(prompt="Hi", temperature="hot"), 400, "temperature", None),
    ("/v1/completions", dict(prompt="Hi", top_p=0), 400, "top_p", None),
    ("/v1/completions", dict(prompt="Hi", max_tokens=0), 400, "max_tokens", None),
    ("/v1/completions", dict(prompt="Hi", n=0), 400, "n", None),
    ("/v1/completions", dict(prompt="Hi", n=10**30), 400, "n", None),  # held the loop
    ("/v1/chat/completions", dict(messages=[{"role": "user", "content": "Hi"}], n=129),
     400, "n", None),
    ("/v1/completions", dict(prompt="Hi", stop=[""]), 400, "stop", None),
    ("/v1/completions", dict(prompt="Hi", echo="yes"), 400, "echo", None),
    ("/v1/chat/completions", dict(messages=[{"role": "user", "content": "Hi"}], echo=True),
     400, "echo", None),
    ("/v1/completions", dict(prompt="Hi", best_of=2), 400, "best_of", None),
    ("/v1/completions", dict(prompt="Hi", max_tokens=2, min_tokens=3), 400, "min_tokens",
     None),
    ("/v1/completions", dict(prompt="Hi", include_stop_str_in_output=1), 400,
     "include_stop_str_in_output", None),
    ("/v1/completions", dict(prompt="Hi", allowed_token_ids=[]), 400, "allowed_token_ids",
     None),
    ("/tokenize", dict(prompt=3), 400, "prompt", None),
    ("/tokenize", dict(prompt="Hi", add_special_tokens="no"), 400, "add_special_tokens",
     None),
    ("/tokenize", dict(messages=[{"role": "user", "content": "Hi"}],
                       add_generation_prompt=1), 400, "add_generation_prompt", None),
    ("/tokenize", dict(messages=[{"role": "user", "content": "Hi"}],
                       continue_final_message=True), 400, "continue_final_message", None),
    ("/v1/chat/completions", dict(messages=[{"role": "user", "content": "Hi"}],
                                  continue_final_message="yes"), 400,
     "continue_final_message", None),
    ("/v1/chat/completions", dict(messages=[{"role": "assistant", "content": None}],
                                  add_generation_prompt=False,
                                  continue_final_message=True), 400,
     "continue_final_message", None),
    ("/v1/chat/completions", dict(messages=[{"role": "user", "content": "Hi"}],
                                  chat_template_kwargs=["x"]), 400, "chat_template_kwargs",
     None),
    ("/v1/chat/completions", dict(messages=[{"role": "user", "content": "Hi"}],
                                  chat_template_kwargs={"add_generation_prompt": False}),
     400, "chat_template_kwargs", None),
    ("/v1/chat/completions", dict(messages=[{"role": "user", "content": "Hi"}],
                                  chat_template_kwargs={"chat_template": "{{ 7 }}"}),
     400, "chat_template_kwargs", None),
    ("/v1/completions", dict(prompt="Hi", truncate_prompt_tokens=0), 400,
     "truncate_prompt_tokens", None),
    ("/v1/completions", dict(prompt="Hi", bad_words=["x", ""]), 400, "bad_words", None),
    ("/v1/completions", dict(prompt="Hi", use_beam_search="yes"), 400, "use_beam_search",
     None),
    ("/v1/completions", dict(prompt="Hi", use_beam_search=True, stream=True), 400,
     "use_beam_search", None),
    ("/v1/completions", dict(prompt="Hi", use_beam_search=True, logprobs=1), 400,
     "use_beam_search", None),
    ("/v1/completions", dict(prompt="Hi", use_beam_search=True, stop=["x"]), 400,
     "use_beam_search", None),
    ("/v1/completions", dict(prompt="Hi", use_beam_search=True, n=11), 400, "n", None),
    ("/v1/completions", dict(prompt="Hi", use_beam_search=True, length_penalty="x"), 400,
     "length_penalty", None),
    ("/detokenize", dict(tokens=[1, VOCAB]), 400, "tokens", None),
    ("/detokenize", dict(tokens="Hi"), 400, "tokens", None),
    ("/v1/completions", dict(prompt="Hi", allowed_token_ids=[VOCAB]), 400,
     "allowed_token_ids", None),
    ("/v1/completions", dict(prompt="Hi", suffix="!"), 400, "suffix", None),
    ("/v1/completions", dict(prompt="Hi", presence_penalty=3), 400, "presence_penalty",
     None),
    ("/v1/completions", dict(prompt="Hi", frequency_penalty="x"), 400, "frequency_penalty",
     None),
    ("/v1/completions", dict(prompt="Hi", logit_bias={"a": 1}), 400, "logit_bias", None),
    ("/v1/completions", dict(prompt="Hi", logit_bias={"1": 101}), 400, "logit_bias", None),
    ("/v1/completions", dict(prompt="Hi", logit_bias={str(VOCAB): 1}), 400, "logit_bias",
     None),
    ("/v1/completions", dict(prompt="Hi", logprobs=-1), 400, "logprobs", None),
    ("/v1/completions", dict(prompt="Hi", logprobs=21), 400, "logprobs", None),
    ("/v1/chat/completions", dict(messages=[{"role": "user", "content": "Hi"}],
                                  logprobs=True, top_logprobs=21), 400, "top_logprobs",
     None),
    ("/v1/completions", dict(prompt="Hi", stream="yes"), 400, "stream", None),
    ("/v1/completions", dict(prompt="Hi", stream=True,
                             stream_options={"continuous_usage_stats": "yes"}), 400,
     "stream_options", None),
    ("/v1/completions", dict(prompt="Hi", stream_options={"include_usage": True}), 400,
     "stream_options", None),
    ("/v1/completions", dict(prompt=""), 400, "prompt", None),
    ("/v1/completions", dict(max_tokens=3), 400, "prompt", None),
    ("/v1/completions", dict(prompt=[1, True]), 400, "prompt", None),
    ("/v1/completions", dict(prompt=[1, VOCAB]), 400, "prompt", None),
    ("/v1/chat/completions", dict(messages="Hi"), 400, "messages", None),
    ("/v1/chat/completions", dict(messages=[{"role": "robot", "content": "Hi"}]), 400,
     "messages", None),
    ("/v1/chat/completions", dict(messages=[{"role": "user", "content": "Hi"}],
                                  top_logprobs=3), 400, "top_logprobs", None),
]


@pytest.mark.parametrize("path,body,status,param,code", BAD,
                         ids=[f"{i}-{b[3]}-{b[2]}" for i, b in enumerate(BAD)])
def test_bad_request_gets_an_openai_error(server, llm, path, body, status, param, code):
    raw = body if isinstance(body, bytes) else None
    got, out = post(server, path, None if raw else body, data=raw)
    assert got == status
    err = out["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == "invalid_request_error"
    assert (err["param"], err["code"]) == (param, code)
    assert run(_request(server.url + "/health", method="GET"))[0] == 200


def test_unknown_route_and_method_are_json_errors(server):
    assert post(server, "/v1/nothing", {})[0] == 404
    status, out = run(_request(server.url + "/v1/completions", method="GET"))
    assert status == 405 and out["error"]["type"] == "invalid_request_error"


def test_engine_failure_is_a_500_and_the_server_goes_on(server, llm, monkeypatch):
    step = llm.step

    def failing_step():
        monkeypatch.setattr(llm, "step", step)  # fail once
        raise RuntimeError("boom")

    monkeypatch.setattr(llm, "step", failing_step)
    status, out = post(server, "/v1/completions", dict(prompt="Hi", **_greedy()))
    assert status == 500 and out["error"]["type"] == "internal_server_error"
    assert "boom" in out["error"]["message"]
    monkeypatch.setattr(llm, "step", failing_step)
    events = run(_events(server.url + "/v1/completions",
                         dict(prompt="Hi", stream=True, **_greedy())))
    assert "boom" in events[0]["error"]["message"] and events[1:] == ["[DONE]"]
    _assert_idle(llm)
    status, out = post(server, "/v1/completions", dict(prompt="Hi", **_greedy()))
    assert status == 200 and out["usage"]["completion_tokens"] == 8


def test_serve_command(llm, monkeypatch, capsys, tmp_path):
    from flashtile.cli import main
    from flashtile.engine import server as server_module

    calls, engines = [], []
    monkeypatch.setattr(server_module.web, "run_app",
                        lambda app, **kw: calls.append((app, kw)))
    monkeypatch.setattr(server_module, "AsyncEngine",
                        lambda *a: engines.append(AsyncEngine(*a)) or engines[-1])
    frozen = []  # the startup heap is frozen before serving (not this test's, though)
    monkeypatch.setattr(server_module.gc, "freeze", lambda: frozen.append(True))
    assert main(["serve", llm.config.model, "--port", "8123", "--served-model-name", "tiny",
                 "--dtype", "float32", "--device", "cpu", "--max-model-len", "48",
                 "--page-size", "16", "--kv-cache-memory", "64KiB",
                 "--stream-interval", "3"]) == 0
    (app, kw), = calls
    assert engines[0].stream_interval == 3 and frozen == [True]
    assert kw == dict(host="127.0.0.1", port=8123, handler_cancellation=True, print=None)
    # 64 KiB / (2 x 2 layers x 2 heads x 16 x 4 bytes a token) = 128 tokens = 8 pages.
    assert "'tiny' on http://127.0.0.1:8123 (8 KV pages of 16 tokens, max_model_len 48)" \
        in capsys.readouterr().out
    assert main(["serve", str(tmp_path), "--device", "cpu"]) == 2
    assert "model: expected a directory with config.json" in capsys.readouterr().err
    assert main(["serve", llm.config.model, "--stream-interval", "0"]) == 2
    assert "stream_interval: expected an int >= 1, got 0" in capsys.readouterr().err
    # --chat-template: a file's template (or the text itself) replaces the model's.
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    assert main(["serve", llm.config.model, "--device", "cpu", "--dtype", "float32",
                 "--max-model-len", "48", "--page-size", "16", "--kv-cache-memory", "64KiB",
                 "--chat-template", str(template)]) == 0
    assert engines[-1].llm.tokenizer.render_chat([{"role": "user", "content": "Hi"}]) \
        == "[Hi]"
    assert main(["serve", llm.config.model, "--chat-template", "no/such/file"]) == 2
    assert "chat_template: expected a Jinja template or the path of a file holding " \
        "one, got 'no/such/file'" in capsys.readouterr().err


def test_a_model_without_tokenizer_serves_token_ids(llm, tmp_path):
    """What the GPU serving sweep runs: dummy weights from config.json alone."""
    import shutil

    from flashtile.engine import LLM

    shutil.copy(f"{llm.config.model}/config.json", tmp_path)
    dummy = LLM(str(tmp_path), dtype="float32", device="cpu", max_model_len=32,
                page_size=16, load_format="dummy")
    with ServerThread.over(dummy, MODEL) as s:
        events = run(_events(s.url + "/v1/completions", dict(
            prompt=[5, 6, 7], stream=True, logprobs=0, **_greedy(max_tokens=4))))
        assert [e["choices"][0]["text"] for e in events[:-1]] == [""] * 4
        tokens = [e["choices"][0]["logprobs"]["tokens"][0] for e in events[:-1]]
        assert all(t.startswith("token_id:") for t in tokens)
        status, out = post(s, "/v1/completions", dict(prompt="Hi"))
        assert status == 400 and out["error"]["param"] == "prompt"
        status, out = post(s, "/v1/chat/completions",
                           dict(messages=[{"role": "user", "content": "Hi"}]))
        assert status == 400 and out["error"]["param"] == "messages"


@pytest.mark.parametrize("kind", ["CUMULATIVE", "DELTA"])
def test_a_lagging_stream_reader_gets_one_output_for_several_steps(kind):
    """A reader that fell behind takes one output per prompt for all the steps it missed
    (one SSE chunk for several tokens): the newest of cumulative outputs, the deltas added
    up; the stream ends once every prompt's final output is read."""
    from types import SimpleNamespace as NS

    from flashtile.engine.async_engine import RequestStream
    from flashtile.engine.outputs import CompletionOutput, RequestOutput
    from flashtile.engine.sampling_params import RequestOutputKind

    delta = kind == "DELTA"

    def out(rid, tokens, done):  # the output after `tokens` tokens, as the engine gives
        new = tokens[-1:] if delta else tokens
        c = CompletionOutput(0, "".join(map(str, new)), new, "length" if done else None,
                             logprobs=[-float(t) for t in new])
        return RequestOutput(rid, None, [1, 2], [c], finished=done)

    stream = RequestStream(NS(_streams={}), ["a", "b"], RequestOutputKind[kind])
    for rid, tokens, done in [("a", [5], False), ("b", [7], False), ("a", [5, 6], False),
                              ("a", [5, 6, 8], True)]:
        stream.put((0 if rid == "a" else 1, out(rid, tokens, done)))
    first = run(stream.next_outputs())
    a, b = first[0].outputs[0], first[1].outputs[0]
    assert (a.text, a.token_ids, a.logprobs, a.finish_reason) == ("568", [5, 6, 8],
                                                                 [-5, -6, -8], "length")
    assert first[0].finished and (b.token_ids, b.finish_reason) == ([7], None)
    assert stream.pending == {"b"}
    stream.put((1, out("b", [7, 9], True)))
    assert run(stream.next_outputs())[1].outputs[0].token_ids == ([9] if delta else [7, 9])
    assert not stream.pending
    with pytest.raises(StopAsyncIteration):
        run(stream.next_outputs())


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize("include_usage", [False, True], ids=["", "usage"])
def test_chunk_format_is_json_dumps_of_the_chunk(llm, chat, include_usage):
    """The preformatted chunk is byte for byte the JSON of the chunk's dict: special
    characters, non-ASCII text, logprobs (token strings and offsets), finish reasons."""
    from flashtile.engine import openai_protocol as api

    head = {"id": "chatcmpl-1f" if chat else "cmpl-1f",
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": 1764583200, "model": 'dir/ü "tiny"'}
    extra = {"usage": None} if include_usage else {}
    fmt = api.ChunkFormat(head, chat, include_usage)
    cases = [(0, "", [], None, 0, None, None),
             (0, " Paris", [17], [-0.25], 3, None, llm.tokenizer),
             (1, 'a "q" \\ ü 日本 🙂\n\t\x01\u2028', [40, 41, 42], [-1.5, -2e-9, -30.0], 12,
              "stop", llm.tokenizer),
             (2, "x", [7], [-1.0], 0, "length", None)]
    for index, text, ids, logprobs, offset, reason, tokenizer in cases:
        choice = api.choice(chat, index, text, ids, logprobs, offset, tokenizer, delta=True)
        want = api.sse({**head, "choices": [{**choice, "finish_reason": reason}], **extra})
        body, after = fmt.chunk(index, text, ids, logprobs, offset, reason, tokenizer)
        assert body == want
        # The next chunk's offset: completions' logprobs count the token strings.
        lp = choice["logprobs"]
        assert after == (lp["text_offset"][-1] + len(lp["tokens"][-1])
                         if lp and not chat and ids else offset + len(text))


def test_stream_interval_sends_fewer_larger_chunks(llm):
    """stream_interval=4: the first token alone (time to first token), then chunks of at
    least 4 tokens (more if the reader lags), the last one when the request ends; the
    text is the same as a whole response's."""
    body = dict(prompt="Hello world", logprobs=0, **_greedy(max_tokens=11))
    with ServerThread(build_app(AsyncEngine(lambda: llm, stream_interval=4), MODEL)) as s:
        events = run(_events(s.url + "/v1/completions", dict(body, stream=True)))
        _, whole = post(s, "/v1/completions", body)
    sizes = [len(e["choices"][0]["logprobs"]["tokens"]) for e in events[:-1]]
    assert sizes[0] == 1 and all(n >= 4 for n in sizes[1:-1]) and sum(sizes) == 11
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == \
        whole["choices"][0]["text"]
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    _assert_idle(llm)


def test_stream_reader_wakes_at_the_interval():
    """RequestStream(interval=3) of two prompts: each prompt's first output and last
    output wake the reader, otherwise 3 waiting tokens of one prompt do."""
    from types import SimpleNamespace as NS

    from flashtile.engine.async_engine import RequestStream
    from flashtile.engine.outputs import CompletionOutput, RequestOutput
    from flashtile.engine.sampling_params import RequestOutputKind

    def out(rid, n, done=False):
        return RequestOutput(rid, None, [1], [CompletionOutput(0, "", [5] * n)],
                             finished=done)

    stream = RequestStream(NS(_streams={}), ["a", "b"], RequestOutputKind.DELTA, 3)
    steps = [[(0, out("a", 1))], [(0, out("a", 1))], [(0, out("a", 1)), (1, out("b", 1))],
             [(0, out("a", 1))], [(0, out("a", 2))], [(1, out("b", 1))],
             [(1, out("b", 1, done=True))]]
    woken = []
    for i, items in enumerate(steps):
        for item in items:
            stream.put(item)
        if stream._ready:
            woken.append((i, {k: len(o.outputs[0].token_ids)
                              for k, o in run(stream.next_outputs()).items()}))
    # a's first; b's first (a's 2 waiting come along); a reaching 3; b's last.
    assert woken == [(0, {0: 1}), (2, {0: 2, 1: 1}), (4, {0: 3}), (6, {1: 2})]
    assert stream.pending == {"a"}
    stream.put(RuntimeError("boom"))  # an error wakes the reader at once
    with pytest.raises(RuntimeError, match="boom"):
        run(stream.next_outputs())
