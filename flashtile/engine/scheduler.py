"""Scheduler: continuous batching with a token budget (vLLM v1's scheme).

There are no prefill and decode phases. Each sequence has ``num_computed_tokens`` (its
tokens whose KV is in the pool, or being written by a launched step) and each step hands
out ``max_num_batched_tokens`` tokens: first to the running sequences, in admission
order, so each catches up (one token for a decoding sequence, the next chunk of a long
prompt), then to waiting ones, admitted while the budget, ``max_num_seqs`` and the pool
allow. A prompt longer than the budget is prefilled over several steps (chunked
prefill) while the others keep decoding.

When the pool cannot give a running sequence the pages for its tokens, the newest running
sequence is preempted: its pages are freed and it goes back to the front of the waiting
queue, to be recomputed (prompt and output so far) when it is admitted again; nothing new
is admitted in that step. The pool holds at least one max_model_len sequence, so a
sequence left alone always fits.

A step is recorded twice: ``launched`` when the runner has queued it (computed tokens,
placeholders for the tokens being sampled) and ``completed`` when its sampled tokens are
on the host. With asynchronous scheduling the next step is scheduled in between, so a
sequence that ends at an end-of-sequence or stop token may be in that next step too; its
token there is discarded. Ends by length are known at launch and never cost a step.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from flashtile._validate import _fail
from flashtile.engine.block_manager import BlockManager
from flashtile.engine.config import EngineConfig
from flashtile.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledStep:
    """A launched step, as ``Scheduler.completed`` needs it."""

    scheduled: list  # (sequence, tokens computed) pairs
    filled: list     # (sequence, its computed tokens) for each sequence that filled a page
    sampled: list    # (sequence, index of its placeholder in token_ids) per sampled row


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager, eos_token_ids):
        self.max_model_len = config.max_model_len
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.block_manager = block_manager
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def check(self, seq: Sequence):
        """Refuse a prompt the engine cannot run (ValueError)."""
        if seq.num_tokens > self.max_model_len:
            _fail(ValueError, "prompt length", f"at most max_model_len={self.max_model_len}"
                  " tokens", f"{seq.num_tokens} tokens",
                  "Shorten the prompt or raise max_model_len")

    def add(self, seq: Sequence):
        self.check(seq)
        params = seq.sampling_params
        limit = self.max_model_len
        if params.max_tokens is not None:
            limit = min(limit, seq.num_prompt_tokens + params.max_tokens)
        seq.max_num_tokens = limit
        eos = frozenset() if params.ignore_eos else self.eos_token_ids
        seq.stop_ids = eos | frozenset(params.stop_token_ids)
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[tuple[Sequence, int]]:
        """The step's (sequence, tokens to compute) pairs; may be empty after preemption."""
        budget, ps = self.max_num_batched_tokens, self.block_manager.page_size
        scheduled = []
        num_preemptions = self.num_preemptions
        # Preemption pops from the end of the list being iterated, which ends the loop
        # before the popped sequences.
        for seq in self.running:
            if budget <= 0:
                break
            computed = seq.num_computed_tokens
            n = len(seq.token_ids) - computed
            if n > budget:
                n = budget
            # Most decode steps fit in the last page: no call for them.
            if computed + n > len(seq.block_table) * ps and not self._ensure_slots(seq, n):
                break  # seq preempted itself: it was the last running sequence
            scheduled.append((seq, n))
            budget -= n
        preempted = self.num_preemptions > num_preemptions
        while not preempted and self.waiting and budget > 0 \
                and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not self.block_manager.allocate(seq):
                break
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled.append((seq, n))
            budget -= n
        return scheduled

    def _ensure_slots(self, seq: Sequence, n: int) -> bool:
        """Pages for seq's next n tokens, preempting the newest running sequences while the
        pool is short of them; False when that preempted seq itself."""
        while not self.block_manager.ensure_slots(seq, n):
            victim = self.running.pop()  # the newest (admission order)
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence):
        self.block_manager.free(seq)  # also resets num_computed_tokens: recompute
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def launched(self, scheduled, sampled_seqs) -> ScheduledStep:
        """Record a step the runner has just launched: its tokens count as computed, and
        each sampling sequence gets a placeholder for the token in flight (see
        sequence.py), so that the next step can be scheduled before this one's tokens
        are known. A sequence whose placeholder reaches its length limit leaves the
        running list now (its end is known; it keeps its pages until ``completed``)."""
        ps, filled = self.block_manager.page_size, []
        for seq, n in scheduled:
            start = seq.num_computed_tokens
            seq.num_computed_tokens = end = start + n
            if end // ps != start // ps:
                filled.append((seq, end))
        sampled, ending = [], set()
        for row, seq in enumerate(sampled_seqs):
            tokens = seq.token_ids
            index = len(tokens)
            sampled.append((seq, index))
            tokens.append(-1 - row)
            if index >= seq.max_num_tokens - 1:
                ending.add(seq)
        if ending:
            self.running = [s for s in self.running if s not in ending]
        return ScheduledStep(scheduled, filled, sampled)

    def completed(self, step: ScheduledStep, token_ids, logprobs
                  ) -> list[tuple[Sequence, int]]:
        """Record a launched step's results once they are on the host: register the pages
        it filled (their tokens are known now), put the sampled tokens in place of the
        placeholders, finish sequences at an end-of-sequence or stop token, max_tokens or
        max_model_len. A sequence finished (or aborted) while the step ran gets nothing:
        its token is discarded. Returns (sequence, token) for each token received."""
        for seq, end in step.filled:
            # Preempted or finished while the step ran: its pages are gone.
            if seq.status is SequenceStatus.RUNNING:
                self.block_manager.commit(seq, end)
        got = []
        for (seq, index), token, logprob in zip(step.sampled, token_ids, logprobs):
            if seq.status is SequenceStatus.FINISHED:  # seq.is_finished, without a call
                continue
            if logprob is not None and seq.sampling_params.logprobs is None:
                logprob = None  # computed for another row of the step
            seq.resolve(index, token, logprob)
            got.append((seq, token))
            if token in seq.stop_ids \
                    and index - seq.num_prompt_tokens >= seq.sampling_params.min_tokens:
                self.finish(seq, "stop")
            elif index + 1 >= seq.max_num_tokens:
                self.finish(seq, "length")
        return got

    def finish(self, seq: Sequence, reason: str):
        """End seq ("stop", "length" or "abort") and give its pages back.

        Also while a launched step may still write them: every device operation is
        queued on one stream, so a later step that gets these pages writes them after
        the running one is done with them, and ``completed`` registers no page of a
        finished sequence."""
        if seq.is_finished:
            return
        if seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        elif seq in self.running:  # else its length limit took it off already
            self.running.remove(seq)
        self.block_manager.free(seq)
        seq.finish(reason)
