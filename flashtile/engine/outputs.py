"""What LLM.generate and LLM.step return (vLLM's class and field names)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union


@dataclass
class CompletionOutput:
    """One completion of a request.

    text: the detokenised completion ("" without a tokenizer); a stop string and what
        follows it are cut off.
    token_ids: the generated token ids, the one that ended the request included.
    finish_reason: "stop" (end-of-sequence token, stop token or stop string), "length"
        (max_tokens or max_model_len), "abort", or None while running.
    stop_reason: the stop string or stop token id that ended it, else None.
    logprobs: the log-probability of each generated token under the model's raw
        distribution, when SamplingParams.logprobs is not None (vLLM returns a dict per
        token; here the chosen token's value alone).
    top_logprobs: per generated token, {token id: logprob} of the k most likely tokens
        (most likely first) when SamplingParams.logprobs = k > 0, else None.
    cumulative_logprob: the sum of ``logprobs`` (None without them), vLLM's field.
    """

    index: int
    text: str
    token_ids: list
    finish_reason: Optional[str] = None
    stop_reason: Union[str, int, None] = None
    logprobs: Optional[list] = None
    top_logprobs: Optional[list] = None
    cumulative_logprob: Optional[float] = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """time.time() seconds: arrival, first generated token, finish (None until then)."""

    arrival_time: float
    first_token_time: Optional[float] = None
    finish_time: Optional[float] = None


@dataclass
class RequestOutput:
    """One request's output. prompt_logprobs (SamplingParams.prompt_logprobs set): per
    prompt position, None at position 0, then {the prompt token: its logprob, then the k
    most likely tokens: theirs} (vLLM's shape, floats for its Logprob objects); a DELTA
    request carries it in its first output only. num_cached_tokens: the prompt tokens
    its pages took from the prefix cache instead of computing them (vLLM's field)."""

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list
    outputs: list = field(default_factory=list)
    finished: bool = False
    metrics: Optional[RequestMetrics] = None
    prompt_logprobs: Optional[list] = None
    num_cached_tokens: int = 0

    def add(self, next_output: "RequestOutput"):
        """Append the next delta output of the same request (RequestOutputKind.DELTA) to
        this one, in place (vLLM's ``add`` with aggregate=True): one output for several
        steps, for a reader that fell behind."""
        for mine, new in zip(self.outputs, next_output.outputs):
            mine.text += new.text
            mine.token_ids = mine.token_ids + new.token_ids
            if mine.logprobs is not None:
                mine.logprobs = mine.logprobs + new.logprobs
            if mine.top_logprobs is not None:
                mine.top_logprobs = mine.top_logprobs + new.top_logprobs
            if mine.cumulative_logprob is not None:
                mine.cumulative_logprob = new.cumulative_logprob
            mine.finish_reason, mine.stop_reason = new.finish_reason, new.stop_reason
        self.finished, self.metrics = next_output.finished, next_output.metrics
        if self.prompt_logprobs is None:
            self.prompt_logprobs = next_output.prompt_logprobs
