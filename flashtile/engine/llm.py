"""LLM: the offline entry point (vLLM's API) and the step loop a server drives.

    from flashtile.engine import LLM, SamplingParams
    llm = LLM(model="path/to/checkpoint", dtype="bfloat16")
    outs = llm.generate(["The capital of France is"], SamplingParams(max_tokens=16))
    print(outs[0].outputs[0].text)

``add_request`` / ``step`` / ``abort_request`` let a server feed requests between steps;
each ``step`` returns the output of every request that received a token (the whole
completion so far, or what is new: SamplingParams.output_kind).

``LLM(model, tensor_parallel_size=N)`` splits the model over N processes: this one is
rank 0 (scheduler, tokenizer, sampler) and starts the other N - 1 (engine/workers.py);
``shutdown()`` stops them (also done at garbage collection and interpreter exit).
"""

from __future__ import annotations

import itertools
import os
import time
from typing import Optional

from flashtile._validate import _fail
from flashtile.engine.block_manager import BlockManager
from flashtile.engine.config import EngineConfig
from flashtile.engine.metrics import EngineStats
from flashtile.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from flashtile.engine.runner import LaunchedStep
from flashtile.engine.sampling_params import RequestOutputKind, SamplingParams
from flashtile.engine.scheduler import ScheduledStep, Scheduler
from flashtile.engine.sequence import Sequence, SequenceStatus
from flashtile.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from flashtile.engine.workers import start_runner


class _Request:
    """A sequence plus what the engine tracks for its output: text and stop strings."""

    def __init__(self, request_id, prompt, seq: Sequence, tokenizer):
        self.request_id, self.prompt, self.seq = request_id, prompt, seq
        params = seq.sampling_params
        self.stops = list(params.stop)
        self.detok = (IncrementalDetokenizer(tokenizer, seq.prompt_token_ids,
                                             params.skip_special_tokens)
                      if tokenizer is not None else None)
        self.text, self.stop_reason = "", None
        # The prompt's ids, copied once: every output of the request refers to this list.
        self.prompt_token_ids = seq.prompt_token_ids
        self.sent_chars = self.sent_tokens = 0  # what delta outputs have carried so far
        self.sent_prompt_logprobs = False

    def add_text(self, new_tokens, final: bool = False) -> Optional[str]:
        """Detokenise the new tokens (final: the last ones); the stop string they
        complete, if any (none before SamplingParams.min_tokens tokens)."""
        if self.detok is None:
            return None
        new = self.detok.add(new_tokens, final)
        if not new:
            return None
        start = len(self.text)
        self.text += new
        seq, params = self.seq, self.seq.sampling_params
        # Tokens known so far (a placeholder of the next step in flight is not one).
        if params.min_tokens and \
                seq.num_completion_tokens - (seq.token_ids[-1] < 0) < params.min_tokens:
            return None
        hits = [(self.text.find(s, max(0, start - len(s) + 1)), s) for s in self.stops]
        hits = [(i, s) for i, s in hits if i >= 0]
        if not hits:
            return None
        end, stop = min(hits)
        # vLLM: the stop string is not part of the text unless asked for.
        self.text = self.text[:end + (len(stop) if params.include_stop_str_in_output else 0)]
        return stop

    def output(self, delta: bool = False) -> RequestOutput:
        """The request's output: the whole completion so far, or (delta) the tokens, text
        and logprobs new since its last delta output (RequestOutputKind.DELTA)."""
        seq = self.seq
        text = self.text
        if not seq.is_finished and self.stops:
            # A streamed prefix must never be taken back: hold back what could still turn
            # out to be the start of a stop string.
            text = text[:max(0, len(text) - max(map(len, self.stops)) + 1)]
        reason = seq.finish_reason
        if reason == "stop" and seq.last_token in seq.sampling_params.stop_token_ids:
            self.stop_reason = seq.last_token  # vLLM: None for end-of-sequence tokens
        start = self.sent_tokens if delta else 0
        token_ids = seq.completion_token_ids_from(start)
        k = seq.sampling_params.logprobs
        logprobs = seq.output_logprobs[start:] if k is not None else None
        top = seq.output_top_logprobs[start:] if k else None
        prompt_logprobs = seq.prompt_logprobs
        if delta:
            text, self.sent_chars = text[self.sent_chars:], len(text)
            self.sent_tokens += len(token_ids)
            if self.sent_prompt_logprobs:
                prompt_logprobs = None
            elif prompt_logprobs is not None:
                self.sent_prompt_logprobs = True
        completion = CompletionOutput(
            index=0, text=text, token_ids=token_ids, finish_reason=reason,
            stop_reason=self.stop_reason, logprobs=logprobs, top_logprobs=top,
            cumulative_logprob=seq.cumulative_logprob if k is not None else None)
        return RequestOutput(
            request_id=self.request_id, prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids, outputs=[completion],
            finished=seq.is_finished,
            metrics=RequestMetrics(seq.arrival_time, seq.first_token_time, seq.finish_time),
            prompt_logprobs=prompt_logprobs, num_cached_tokens=seq.prefix_hit_tokens or 0)


class LLM:
    """An engine over one checkpoint directory; keyword arguments are EngineConfig's."""

    def __init__(self, model: str, **kwargs):
        self.config = EngineConfig(model=model, **kwargs)
        has_tokenizer = os.path.isfile(os.path.join(model, "tokenizer.json"))
        self.tokenizer = Tokenizer(model) if has_tokenizer else None
        eos = set(self.config.model_config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.runner = start_runner(self.config)
        self.block_manager = BlockManager(self.runner.num_blocks, self.config.page_size,
                                          self.config.enable_prefix_caching)
        self.runner.block_manager = self.block_manager
        self.scheduler = Scheduler(self.config, self.block_manager, eos)
        self.stats = EngineStats(self.config.max_model_len)  # serve's /metrics
        # The launched step whose tokens are not read yet (asynchronous scheduling): the
        # runner's LaunchedStep and the scheduler's ScheduledStep.
        self._in_flight: Optional[tuple[LaunchedStep, ScheduledStep]] = None
        self._requests: dict[str, _Request] = {}
        self._by_seq: dict[int, _Request] = {}
        self._ids = itertools.count()

    def get_tokenizer(self):
        """The model's Tokenizer (vLLM's method), or None without tokenizer.json."""
        return self.tokenizer

    def shutdown(self):
        """Stop the worker processes of a tensor-parallel engine, destroy its process group
        and free its shared memory (nothing to do in one process). The engine cannot run
        afterwards. Also done when the LLM is garbage collected or the interpreter exits."""
        self.runner.shutdown()

    # ---- requests ---------------------------------------------------------------------
    def _make_request(self, prompt, params, request_id=None, prompt_text=None) -> _Request:
        if params is None:
            params = SamplingParams()
        if not isinstance(params, SamplingParams):
            _fail(TypeError, "sampling_params", "a SamplingParams", type(params).__name__)
        if params.n != 1:
            _fail(ValueError, "n", "1 for one request (SamplingParams.completions splits "
                  "n > 1; LLM.generate and LLM.chat take it)", params.n)
        if isinstance(prompt, dict):  # vLLM's TextPrompt / TokensPrompt
            prompt, prompt_text = _prompt_of(prompt)
        if isinstance(prompt, str):
            if not prompt:
                _fail(ValueError, "prompt", "a non-empty string or token id list", "''")
            if self.tokenizer is None:
                _fail(ValueError, "prompt", "token ids (the model has no tokenizer.json)",
                      "a string")
            prompt_text, token_ids = prompt, self.tokenizer.encode(prompt)
        else:
            token_ids = list(prompt)
        kept = params.truncate(token_ids, self.config.max_model_len)
        if len(kept) < len(token_ids):
            token_ids = kept
            if self.tokenizer is not None:  # the text of what the model sees
                prompt_text = self.tokenizer.decode(kept, skip_special_tokens=False)
        vocab = self.config.model_config.vocab_size
        if not token_ids or not all(isinstance(t, int) and 0 <= t < vocab
                                    for t in token_ids):
            _fail(ValueError, "prompt", f"a non-empty list of token ids in [0, {vocab})",
                  repr(token_ids[:8]) + ("..." if len(token_ids) > 8 else ""))
        for name in ("logit_bias", "allowed_token_ids"):  # SamplingParams checked >= 0
            ids = getattr(params, name)
            if ids and max(ids) >= vocab:
                _fail(ValueError, name, f"token ids in [0, {vocab})", max(ids))
        for name in ("stop", "bad_words"):
            if getattr(params, name) and self.tokenizer is None:
                _fail(ValueError, name, f"no {name} (the model has no tokenizer.json)",
                      getattr(params, name))
        seq = Sequence(token_ids, params)
        if params.bad_words:
            seq.bad_words_ids = self.tokenizer.bad_words_ids(params.bad_words)
        self.scheduler.check(seq)  # before queueing anything of a batch
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        if request_id in self._requests:
            _fail(ValueError, "request_id", "an id not already running", repr(request_id))
        return _Request(request_id, prompt_text, seq, self.tokenizer)

    def _add(self, request: _Request) -> str:
        self.scheduler.add(request.seq)
        self._requests[request.request_id] = request
        self._by_seq[request.seq.seq_id] = request
        return request.request_id

    def add_request(self, prompt, sampling_params: Optional[SamplingParams] = None,
                    request_id=None) -> str:
        """Queue one prompt (text or token ids); returns its request id."""
        return self._add(self._make_request(prompt, sampling_params, request_id))

    def abort_request(self, request_id: str):
        """Stop a request (e.g. its client went away) and free its pages."""
        request = self._requests.get(str(request_id))
        if request is not None:
            self.scheduler.finish(request.seq, "abort")
            self._forget(request)

    def _forget(self, request: _Request):
        """A request has finished or was aborted: recorded in stats, dropped here."""
        self.stats.record(request.seq)
        del self._requests[request.request_id]
        del self._by_seq[request.seq.seq_id]

    def has_unfinished_requests(self) -> bool:
        """Whether a request is unfinished (queued, running, or waiting for the step in
        flight to end it by length)."""
        return self.scheduler.has_unfinished() or self._in_flight is not None and any(
            not seq.is_finished for seq in self._in_flight[0].seqs)

    def step(self) -> list[RequestOutput]:
        """Run one engine step; the outputs of the requests that received a token (with
        asynchronous scheduling, the tokens of the step launched by the previous call),
        each as its SamplingParams.output_kind asks: the whole completion so far, what is
        new (DELTA), or nothing until it finishes (FINAL_ONLY)."""
        outputs = []
        for request in self._step():
            kind = request.seq.sampling_params.output_kind
            if kind is RequestOutputKind.DELTA:
                outputs.append(request.output(delta=True))
            elif kind is RequestOutputKind.CUMULATIVE or request.seq.is_finished:
                outputs.append(request.output())
        return outputs

    def _step(self) -> list[_Request]:
        """One engine step; the requests that received a token. Building a RequestOutput
        copies the request's token ids, so offline generate() asks only finished ones.

        Asynchronous scheduling: schedule and launch step N+1, then wait for step N's
        tokens and process them while the device runs N+1, so the device never idles
        for the host. Synchronously: launch a step and wait for it."""
        stepped = []
        if self._in_flight is not None and self._in_flight[0].host_needs_tokens:
            stepped = self._complete()
        scheduled = self.scheduler.schedule()
        launched = None
        if scheduled:
            step = self.runner.launch(scheduled)
            launched = step, self.scheduler.launched(scheduled, step.seqs)
        waited = self._in_flight is not None
        if waited:
            stepped += self._complete()
        self._in_flight = launched
        if launched is not None and not self.config.async_scheduling:
            stepped += self._complete()
        if not scheduled and not waited and not self.scheduler.running \
                and self.scheduler.waiting:
            raise RuntimeError("the KV pool cannot hold the next waiting request")
        return stepped

    def _complete(self) -> list[_Request]:
        """Wait for the step in flight and record its tokens; its requests that received
        one (a request finished or aborted since its launch gets none)."""
        step, scheduled = self._in_flight
        self._in_flight = None
        token_ids, logprobs = self.runner.wait(step)
        got = self.scheduler.completed(scheduled, token_ids, logprobs)
        by_seq = self._by_seq
        stepped = [by_seq[seq.seq_id] for seq, _ in got]
        if self.tokenizer is not None:  # else there is no text, nor stop strings
            for request, (seq, token) in zip(stepped, got):
                stop = request.add_text([token], final=seq.is_finished)
                if stop is not None:
                    request.stop_reason = stop
                    if seq.is_finished:  # a stop string outranks the length limit (vLLM)
                        seq.finish_reason = "stop"
                    else:
                        self.scheduler.finish(seq, "stop")
        finished = SequenceStatus.FINISHED  # r.seq.is_finished, without 256 calls
        for request in [r for r in stepped if r.seq.status is finished]:
            self._forget(request)
        return stepped

    # ---- offline API ------------------------------------------------------------------
    def generate(self, prompts, sampling_params=None, use_tqdm: bool = True,
                 ) -> list[RequestOutput]:
        """Complete prompts: a string, a token id list, vLLM's {"prompt": text} or
        {"prompt_token_ids": ids} (with an optional "prompt", its text), or a list of
        those. One SamplingParams for all, or a list with one per prompt. Outputs in
        prompt order."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, (list, tuple))
                                                and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        return self._run([(p, None) for p in prompts], sampling_params, use_tqdm)

    def beam_search(self, prompts, params):
        """vLLM's beam search (flashtile.engine.beam_search): a BeamSearchOutput per
        prompt (a string, token ids or a prompt dict), its beam_width best beams."""
        from flashtile.engine.beam_search import beam_search

        return beam_search(self, prompts, params)

    def chat(self, messages, sampling_params=None, use_tqdm: bool = True,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             tools=None, chat_template_kwargs: dict | None = None,
             chat_template: str | None = None, **template_kwargs) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of {"role", "content"}) or a list
        of conversations, through the model's chat template. vLLM's arguments:
        continue_final_message (the last message is continued: with
        add_generation_prompt=False), tools (OpenAI's tool schemas, for the template),
        chat_template_kwargs (more template variables, e.g. Qwen3's enable_thinking),
        chat_template (a Jinja template to use instead of the model's); other keywords
        are template variables too."""
        if self.tokenizer is None:
            _fail(ValueError, "chat", "a model directory with tokenizer.json", "none")
        if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
            _fail(TypeError, "chat_template_kwargs", "a dict of template variables or None",
                  type(chat_template_kwargs).__name__)
        variables = {**(chat_template_kwargs or {}), **template_kwargs}
        if tools is not None:
            variables["tools"] = tools
        conversations = messages if messages and isinstance(messages[0], (list, tuple)) \
            else [messages]
        items = []
        for conv in conversations:
            text = self.tokenizer.render_chat(conv, add_generation_prompt,
                                              continue_final_message, chat_template,
                                              **variables)
            items.append((self.tokenizer.encode(text, add_special_tokens=False), text))
        return self._run(items, sampling_params, use_tqdm)

    def _run(self, items, sampling_params, use_tqdm) -> list[RequestOutput]:
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != len(items):
                _fail(ValueError, "sampling_params", f"one per prompt ({len(items)})",
                      f"{len(sampling_params)}")
            params = list(sampling_params)
        else:
            params = [sampling_params] * len(items)
        # n > 1: one request per completion (SamplingParams.completions), merged below.
        groups, requests = [], []
        for (p, text), sp in zip(items, params):
            children = [sp] if sp is None else sp.completions()
            groups.append(range(len(requests), len(requests) + len(children)))
            requests += [self._make_request(p, c, prompt_text=text) for c in children]
        ids = [self._add(r) for r in requests]
        wanted = set(ids)
        done: dict[str, RequestOutput] = {}
        bar = _progress(len(ids)) if use_tqdm else None
        start, generated = time.perf_counter(), 0
        while len(done) < len(ids):
            stepped = self._step()
            generated += len(stepped)
            for request in stepped:
                if request.seq.is_finished and request.request_id in wanted:
                    done[request.request_id] = request.output()
                    if bar is not None:
                        bar.update(1)
            if bar is not None:
                bar.set_postfix_str(
                    f"output {generated / (time.perf_counter() - start):.0f} tok/s",
                    refresh=False)
        if self._in_flight is not None:  # a step launched before the last tokens came
            self._complete()
        if bar is not None:
            bar.close()
        return [_merged([done[ids[i]] for i in group]) for group in groups]


def _merged(outputs: list[RequestOutput]) -> RequestOutput:
    """The n completions of one prompt (one request each) as one RequestOutput: the
    first request's, its outputs indexed 0..n-1, its metrics spanning them all."""
    if len(outputs) == 1:
        return outputs[0]
    first = outputs[0]
    for i, out in enumerate(outputs):
        out.outputs[0].index = i
    metrics = [o.metrics for o in outputs]
    first_tokens = [m.first_token_time for m in metrics if m.first_token_time is not None]
    first.outputs = [o.outputs[0] for o in outputs]
    first.metrics = RequestMetrics(min(m.arrival_time for m in metrics),
                                   min(first_tokens, default=None),
                                   max(m.finish_time for m in metrics))
    return first


def _prompt_of(prompt: dict):
    """vLLM's prompt dicts: (the token ids, the text given beside them) of a TokensPrompt
    {"prompt_token_ids", optional "prompt"}, (the text, None) of a TextPrompt
    {"prompt"}; other keys (multi-modal data, ...) are refused."""
    other = sorted(set(prompt) - {"prompt", "prompt_token_ids"})
    if other or not prompt:
        _fail(ValueError, "prompt", "a dict with 'prompt' (text) or 'prompt_token_ids' "
              "(and optionally the text)", f"keys {sorted(prompt)}")
    if "prompt_token_ids" in prompt:
        return prompt["prompt_token_ids"], prompt.get("prompt")
    return prompt["prompt"], None


def _progress(total):
    from tqdm.auto import tqdm
    return tqdm(total=total, desc="Processed prompts", dynamic_ncols=True)
