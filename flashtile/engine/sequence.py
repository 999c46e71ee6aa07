"""Sequence: one request's tokens, its place in the KV pool and its progress.

Token accounting follows vLLM v1: ``num_computed_tokens`` counts the tokens whose keys
and values are in the pool. A step computes ``token_ids[num_computed_tokens:...]``; a
prompt may take several steps (chunked prefill); a decode step computes the one token
sampled last. There are no separate prefill and decode states: a sequence is waiting
(not holding blocks), running (holding blocks) or finished.

Beyond the lead's spec: ``finish(reason)`` sets the status, reason and time together,
and ``num_completion_tokens`` / ``is_finished`` are spelled out for the scheduler.
Times are ``time.time()`` seconds, as vLLM's request metrics.

A token still being sampled on the device (asynchronous scheduling: the next step is
launched before this one's tokens reach the host) is a placeholder ``-(row + 1)``, its
row in the last launched step's sampled tokens. It counts in ``num_tokens`` (so the next
step computes it, reading its value on the device) but not in ``completion_token_ids``.
A sequence has at most one, its last token.
"""

from __future__ import annotations

import enum
import itertools
import time

from flashtile._validate import _fail
from flashtile.engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED = enum.auto()


FINISH_REASONS = ("stop", "length", "abort")


class Sequence:
    """One request: prompt + generated token ids and its block table.

    token_ids: the prompt's token ids (non-empty); generated ids are appended.
    sampling_params: how to decode it (default SamplingParams()).
    arrival_time: when the request arrived (default: now).
    """

    # One counter for the process: ids order requests by arrival, which the scheduler
    # uses to pick the newest request to preempt.
    _ids = itertools.count()

    def __init__(self, token_ids, sampling_params: SamplingParams | None = None,
                 arrival_time: float | None = None):
        token_ids = list(token_ids)
        if not token_ids:
            _fail(ValueError, "token_ids", "a non-empty prompt", "[]")
        self.seq_id = next(Sequence._ids)
        self.status = SequenceStatus.WAITING
        self.token_ids: list[int] = token_ids
        self.num_prompt_tokens = len(token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        # The tokens its first allocation took from the prefix cache (None before it;
        # RequestOutput.num_cached_tokens, as vLLM reports it: kept through preemption
        # and the freeing at the end, which reset num_cached_tokens).
        self.prefix_hit_tokens: int | None = None
        self.block_table: list[int] = []
        # Its row of BlockManager.tables, while it holds pages.
        self.table_row: int | None = None
        self.sampling_params = sampling_params if sampling_params is not None \
            else SamplingParams()
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        self.finish_reason: str | None = None
        self.output_logprobs: list[float] = []
        self.cumulative_logprob = 0.0  # their sum
        # Per generated token, {token id: logprob} of the SamplingParams.logprobs most
        # likely tokens (only when that is > 0).
        self.output_top_logprobs: list[dict[int, float]] = []
        # SamplingParams.prompt_logprobs: per prompt position, {its token: logprob, then
        # the k most likely tokens: logprob} (None at position 0, which nothing
        # predicts). Filled in position order; recomputing after a preemption writes the
        # same values again.
        self.prompt_logprobs: list | None = None
        if self.sampling_params.prompt_logprobs is not None:
            self.prompt_logprobs = [None] * len(token_ids)
        # Set by Scheduler.add: the token count at which the sequence ends (max_tokens or
        # max_model_len) and the ids that end it (end-of-sequence unless ignore_eos, and
        # stop_token_ids), so that a step checks one int and one set per sequence.
        self.max_num_tokens: int | None = None
        self.stop_ids: frozenset[int] = frozenset()
        # SamplingParams.bad_words as token id tuples (set by LLM, which has the
        # tokenizer).
        self.bad_words_ids: list[tuple[int, ...]] = []

    def __len__(self):
        return len(self.token_ids)

    def __repr__(self):
        return (f"Sequence(seq_id={self.seq_id}, status={self.status.name}, "
                f"tokens={self.num_prompt_tokens}+{self.num_completion_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={len(self.block_table)})")

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def completion_token_ids(self) -> list[int]:
        """The generated ids known on the host (without a token in flight)."""
        return self.completion_token_ids_from(0)

    def completion_token_ids_from(self, start: int) -> list[int]:
        """completion_token_ids[start:], without copying the ids before start."""
        end = len(self.token_ids) - (self.token_ids[-1] < 0)
        return self.token_ids[self.num_prompt_tokens + start:end]

    @property
    def last_token(self) -> int:
        return self.token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def num_blocks(self, page_size: int) -> int:
        """Pages needed to hold the KV of every token so far."""
        return -(-len(self.token_ids) // page_size)

    def append_token(self, token_id: int, logprob: float | None = None):
        """Add a sampled token (its KV is computed by the next step).

        logprob is stored when given (requests with SamplingParams.logprobs set).
        """
        if self.first_token_time is None:
            self.first_token_time = time.time()
        self.token_ids.append(int(token_id))
        if logprob is not None:
            self._keep_logprobs(logprob)

    def resolve(self, index: int, token_id: int, logprob: float | None = None):
        """Put the value of the placeholder at token_ids[index] (see the module's doc)."""
        if self.first_token_time is None:
            self.first_token_time = time.time()
        self.token_ids[index] = token_id
        if logprob is not None:
            self._keep_logprobs(logprob)

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Whether some prompt position still lacks its logprobs (the steps computing
        them must run, not come from the prefix cache)."""
        # Positions fill in order: the last prompt position is filled last.
        return self.prompt_logprobs is not None and self.num_prompt_tokens > 1 \
            and self.prompt_logprobs[self.num_prompt_tokens - 1] is None

    def keep_prompt_logprobs(self, start: int, logprobs, ids=None, values=None):
        """The logprobs of prompt positions start + 1 ... start + len(logprobs) (each
        predicted by the position before it), with their k alternatives (ids, values
        per position, most likely first) when asked for."""
        k = self.sampling_params.prompt_logprobs
        for j, lp in enumerate(logprobs):
            pos = start + 1 + j
            entry = {self.token_ids[pos]: lp}
            if k:
                for t, v in zip(ids[j][:k], values[j][:k]):
                    entry.setdefault(t, v)
            self.prompt_logprobs[pos] = entry

    def _keep_logprobs(self, logprob):
        """logprob: the chosen token's, or (it, alternative ids, their logprobs) from a
        step where some request asked for alternatives (ModelRunner.wait)."""
        if isinstance(logprob, tuple):
            logprob, ids, values = logprob
            k = self.sampling_params.logprobs
            if k:
                self.output_top_logprobs.append(dict(zip(ids[:k], values[:k])))
        self.output_logprobs.append(float(logprob))
        self.cumulative_logprob += self.output_logprobs[-1]

    def finish(self, reason: str):
        """Mark the request done: reason "stop", "length" or "abort"."""
        if reason not in FINISH_REASONS:
            _fail(ValueError, "reason", f"one of {FINISH_REASONS}", repr(reason))
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
        self.finish_time = time.time()
        if self.token_ids[-1] < 0:  # a token in flight: whatever it is, it comes after
            self.token_ids.pop()
