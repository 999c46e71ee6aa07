"""Tool calls: the hermes parser on whole and streamed text, and flashtile serve's chat
endpoint with tools (the tiny model's answer replaced by a scripted one, so that a call
comes back): tools shown to the chat template, tool_calls whole and streamed, earlier
calls and tool results in the conversation, and the 400s."""

from __future__ import annotations

import json

import pytest

from flashtile.engine.tool_parsers import HermesToolParser, get_parser
from tests.engine_utils import ServerThread, engine_cpu, tiny_llm

aiohttp = pytest.importorskip("aiohttp")
from flashtile.engine.server import AsyncEngine, build_app  # noqa: E402
from tests.test_engine_server import _events, post, run  # noqa: E402

__all__ = ["engine_cpu"]  # the autouse fixture, imported to apply here
pytestmark = pytest.mark.timeout(120)
MODEL = "tiny"
# A Qwen-style template: the tools as JSON in a system turn, earlier calls as hermes
# blocks, tool results as their own turns.
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    "<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] %}{{ m['content'] }}{% endif %}"
    "{% for c in m.get('tool_calls', []) %}<tool_call>{{ {'name': c['function']['name'], "
    "'arguments': c['function']['arguments']} | tojson }}</tool_call>{% endfor %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% endif %}")
CALL = {"name": "get_weather", "arguments": {"city": "Paris"}}
ANSWER = f"Let me look.\n<tool_call>\n{json.dumps(CALL)}\n</tool_call>"
# Short: the tiny tokenizer spends a token on most characters of JSON.
TOOLS = [{"type": "function", "function": {"name": "get_weather",
                                           "parameters": {"type": "object"}}}]
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]


def test_hermes_parse():
    p = HermesToolParser()
    content, calls = p.parse(ANSWER + "<tool_call>" + json.dumps(
        {"name": "f", "arguments": {"t": "°C"}}, ensure_ascii=False) + "</tool_call>")
    assert content == "Let me look."
    assert [(c["type"], c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in calls] == [("function", "get_weather", CALL["arguments"]),
                                ("function", "f", {"t": "°C"})]
    assert "°C" in calls[1]["function"]["arguments"]  # as sent, not escaped
    assert calls[0]["id"] != calls[1]["id"] and calls[0]["id"].startswith("chatcmpl-tool-")
    assert p.parse(f"<tool_call>{json.dumps(CALL)}</tool_call>")[0] is None
    for text in ("no call here", "<tool_call>{not json}</tool_call>", "<tool_call>[1]",
                 '<tool_call>{"name": 3}</tool_call>'):
        assert p.parse(text) == (text, [])
    with pytest.raises(ValueError, match="tool_call_parser: expected one of"):
        get_parser("mistral")


@pytest.mark.parametrize("text", [ANSWER, "a <tool x> b <", "plain text"],
                         ids=["call", "almost", "plain"])
def test_tool_call_stream_holds_back_only_what_may_start_a_call(text):
    """Fed a character at a time, the stream never sends a piece of the start tag, and
    what it sends plus finish's rest is the parser's content."""
    stream = HermesToolParser().stream()
    sent = "".join(stream.feed(ch) for ch in text)
    assert "<tool_call>"[:2] not in sent or text != ANSWER
    rest, calls = stream.finish()
    content, want = HermesToolParser().parse(text)
    assert (sent + rest).strip() == (content or "").strip()
    assert [c["function"] for c in calls] == [c["function"] for c in want]


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    for engine in tiny_llm(tmp_path_factory, 256):
        engine.tokenizer.chat_template = TOOLS_TEMPLATE
        yield engine


class Scripted:
    """The LLM with every answer's text replaced by ``text``: three characters a step
    for streamed (DELTA) requests, the rest with the last output; whole for the others."""

    def __init__(self, llm, text):
        self.llm, self.text, self.sent = llm, text, {}

    def __getattr__(self, name):
        return getattr(self.llm, name)

    def step(self):
        outputs = self.llm.step()
        for out in outputs:
            at = self.sent.get(out.request_id, 0)
            end = len(self.text) if out.finished else at + 3
            out.outputs[0].text = self.text[at:end]
            self.sent[out.request_id] = end
        return outputs


@pytest.fixture(scope="module")
def server(llm):
    with ServerThread(build_app(AsyncEngine(lambda: Scripted(llm, ANSWER)), MODEL,
                                "hermes")) as s:
        yield s


def _chat(**kw):
    return dict(messages=MESSAGES, temperature=0, max_tokens=6, ignore_eos=True, **kw)


def test_tool_calls_whole_and_streamed(server, llm):
    """The answer's call as OpenAI's tool_calls (arguments a JSON string), the text
    before it as content, finish_reason "tool_calls"; streamed: the content in chunks
    that never show the call's text, then one chunk of the calls; the tools reach the
    prompt through the chat template."""
    status, whole = post(server, "/v1/chat/completions", _chat(tools=TOOLS))
    assert status == 200, whole
    choice = whole["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Let me look."
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == CALL["arguments"]
    prompt = llm.tokenizer.apply_chat_template(MESSAGES, tools=TOOLS)
    assert whole["usage"]["prompt_tokens"] == len(prompt)
    assert len(prompt) > len(llm.tokenizer.apply_chat_template(MESSAGES))

    events = run(_events(server.url + "/v1/chat/completions", _chat(tools=TOOLS,
                                                                   stream=True)))
    assert events[-1] == "[DONE]"
    deltas = [c for e in events[:-1] for c in e["choices"]]
    text = "".join(c["delta"].get("content") or "" for c in deltas)
    assert text.strip() == "Let me look." and "<" not in text
    last = deltas[-1]
    assert last["finish_reason"] == "tool_calls"
    assert [c["finish_reason"] for c in deltas[:-1]] == [None] * (len(deltas) - 1)
    (streamed,) = last["delta"]["tool_calls"]
    assert streamed["index"] == 0 and streamed["function"] == call["function"]


def test_conversation_with_calls_and_results(server, llm):
    """An earlier assistant call (arguments a JSON string, as OpenAI clients send it)
    and the tool's result render through the template (arguments as an object)."""
    messages = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {
                "name": "get_weather", "arguments": json.dumps(CALL["arguments"])}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees"}]
    status, out = post(server, "/v1/chat/completions", dict(_chat(tools=TOOLS),
                                                           messages=messages))
    assert status == 200, out
    rendered = llm.tokenizer.render_chat(
        [{**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": CALL[
            "arguments"]}} for c in m["tool_calls"]]} if m.get("tool_calls") else m
         for m in messages], tools=TOOLS)
    assert json.dumps(CALL["arguments"]) in rendered
    assert out["usage"]["prompt_tokens"] == len(llm.tokenizer.encode(
        rendered, add_special_tokens=False))


def test_tool_choice_none_leaves_the_tools_out(server, llm):
    status, out = post(server, "/v1/chat/completions", _chat(tools=TOOLS,
                                                            tool_choice="none"))
    assert status == 200 and out["choices"][0]["message"]["content"] == ANSWER
    assert "tool_calls" not in out["choices"][0]["message"]
    assert out["usage"]["prompt_tokens"] == len(llm.tokenizer.apply_chat_template(MESSAGES))


BAD = [(dict(tool_choice="required"), "tool_choice"),
       (dict(tool_choice={"type": "function", "function": {"name": "f"}}), "tool_choice"),
       (dict(tools=[{"type": "function"}]), "tools"),
       (dict(tools="get_weather"), "tools"),
       (dict(messages=[{"role": "assistant", "content": None, "tool_calls": [
           {"id": "c", "type": "function", "function": {"name": "f",
                                                        "arguments": "{oops"}}]}]),
        "messages")]


@pytest.mark.parametrize("extra,param", BAD, ids=[f"{i}-{b[1]}" for i, b in enumerate(BAD)])
def test_bad_tool_requests(server, extra, param):
    status, out = post(server, "/v1/chat/completions", {**_chat(tools=TOOLS), **extra})
    assert status == 400 and out["error"]["param"] == param


def test_a_server_without_a_parser_refuses_tools(llm):
    with ServerThread.over(llm, MODEL) as s:
        status, out = post(s, "/v1/chat/completions", _chat(tools=TOOLS))
        assert status == 400 and out["error"]["param"] == "tools"
        assert "--tool-call-parser hermes" in out["error"]["message"]
        assert post(s, "/v1/chat/completions", _chat(tools=TOOLS, tool_choice="none"))[0] \
            == 200
