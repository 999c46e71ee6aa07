"""Sampler: the next token of every row of a batch, drawn on the device without a sync.

Each row (one sequence's last position) goes through vLLM's order: logit bias, the
repetition, frequency and presence penalties, allowed_token_ids, then Hugging Face's
temperature, top-k, top-p, min-p; then one token is drawn by the Gumbel-max
trick, ``argmax(probs / E)`` with E ~ Exp(1) per vocabulary entry, which draws from
``probs`` exactly like ``torch.multinomial`` but as element-wise work and an argmax, so
no value has to reach the host (gpt-fast, nano-vllm). Greedy rows take the argmax of the
penalised logits. The host learns nothing but the sampled ids, when the engine reads them.

Reproducible seeds: a row whose request has a seed draws its E from a generator seeded
by ``step_seed(seed, number of tokens generated so far)``, so its n-th token depends on
the request alone, never on the batch around it, and a preempted request recomputed
later draws the same tokens again. Rows without a seed share one generator (the
Sampler's ``seed``, or torch's default generator when None). Only seeded rows cost a
Python iteration each.

Deviation from the lead's spec: per-row seeds and output positions are not tensors but
``SamplingTensors.seeded_rows``, host pairs (row, step seed), since they seed
torch.Generators on the host; the other per-row values are device tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from flashtile._validate import _fail

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def step_seed(seed: int, step: int) -> int:
    """The generator seed of draw ``step`` of a request seeded ``seed``: scrambled, so
    neighbouring seeds and steps give unrelated streams (seed s step 1 is not seed s+1
    step 0)."""
    return _splitmix64(_splitmix64(seed & _MASK64) ^ step)


_GREEDY: dict = {}  # (rows, device, vocab_size) -> SamplingTensors.plain_greedy's


@dataclass
class SamplingTensors:
    """Per-row sampling parameters of one step (B rows), built once per step.

    temperatures, top_ps, min_ps, repetition_penalties: (B,) float32 on the device;
        greedy rows carry temperature 0 and neutral top-k/top-p/min-p.
    top_ks: (B,) int64, the vocabulary size where top-k is off.
    token_ids: (B, L) int64, each row's prompt and output ids for the repetition penalty,
        padded by repeating the row's first id (a repeat rewrites the same value); None
        when no row has a penalty.
    output_ids, output_weights: (B, L) int64 and float32, each row's output ids so far for
        the frequency and presence penalties, padded with id 0 at weight 0 (their count
        adds nothing); frequency_penalties, presence_penalties: (B,) float32. All four
        None when no row has either penalty.
    bias_ids, bias_values: (B, K) int64 and float32, each row's logit_bias, -inf at its
        stop ids while it has fewer than min_tokens tokens and at the tokens that would
        complete one of its bad words, padded with id 0 at bias 0; None when no row has
        any.
    allowed_ids, restricted: (B, K) int64 and (B,) bool: the ids each row may draw
        (allowed_token_ids), padded by repeating its first, and whether it has such a
        list (a row without one draws from every id); None when no row has one.
    seeded_rows: host pairs (row, step_seed) of the non-greedy seeded rows.
    reads_tail: some row has a bad word of several tokens (its bans read its last
        tokens on the host).
    The do_* / *_greedy flags are host booleans, so that forward skips unused work without
    reading device values; want_logprobs: some row asked for logprobs (else the sampler
    skips the logsumexp over the vocabulary and returns None for them); top_logprobs: the
    most alternatives a row asked for (SamplingParams.logprobs; 0: none).
    """

    temperatures: torch.Tensor
    top_ks: torch.Tensor
    top_ps: torch.Tensor
    min_ps: torch.Tensor
    repetition_penalties: torch.Tensor
    token_ids: torch.Tensor | None
    seeded_rows: list[tuple[int, int]]
    all_greedy: bool
    any_greedy: bool
    do_top_k: bool
    do_top_p: bool
    do_min_p: bool
    want_logprobs: bool = True
    output_ids: torch.Tensor | None = None
    output_weights: torch.Tensor | None = None
    frequency_penalties: torch.Tensor | None = None
    presence_penalties: torch.Tensor | None = None
    bias_ids: torch.Tensor | None = None
    bias_values: torch.Tensor | None = None
    top_logprobs: int = 0
    allowed_ids: torch.Tensor | None = None
    restricted: torch.Tensor | None = None
    # A row's bad word of several tokens: its bans depend on the row's last tokens.
    reads_tail: bool = False

    @property
    def reads_token_ids(self) -> bool:
        """Whether some row's penalty or bad words read the tokens of its sequence (so
        the host must know the token in flight before the next step's tensors are
        built)."""
        return self.token_ids is not None or self.output_ids is not None or self.reads_tail

    @property
    def adjusts_logits(self) -> bool:
        """Whether some row's logits change (a penalty or a bias) before the choice."""
        return self.reads_token_ids or self.bias_ids is not None \
            or self.allowed_ids is not None

    @classmethod
    def plain_greedy(cls, rows: int, device, vocab_size: int, want_logprobs: bool = True,
                     top_logprobs: int = 0) -> SamplingTensors:
        """The tensors of ``rows`` greedy rows without penalties (the common case: offline
        generation, benchmarks), made once per batch size and device: the sampler reads
        nothing of them but the flags, and nothing writes them."""
        key = (rows, torch.device(device), vocab_size, want_logprobs, top_logprobs)
        t = _GREEDY.get(key)
        if t is None:
            zeros = torch.zeros(rows, device=device)
            ones = torch.ones(rows, device=device)
            t = _GREEDY[key] = cls(
                temperatures=zeros, top_ps=ones, min_ps=zeros, repetition_penalties=ones,
                top_ks=torch.full((rows,), vocab_size, dtype=torch.int64, device=device),
                token_ids=None, seeded_rows=[], all_greedy=True, any_greedy=True,
                do_top_k=False, do_top_p=False, do_min_p=False, want_logprobs=want_logprobs,
                top_logprobs=top_logprobs)
        return t

    @classmethod
    def from_seqs(cls, seqs, device, vocab_size: int) -> SamplingTensors:
        """Build the tensors for sequences (in batch row order) on the host and copy them
        to device without blocking (from pinned memory on CUDA)."""
        device = torch.device(device)
        params = [s.sampling_params for s in seqs]
        want_logprobs = any(p.logprobs is not None for p in params)
        top = max(p.logprobs or 0 for p in params)
        if all(p.greedy and not p.adjusts_logits for p in params):
            return cls.plain_greedy(len(seqs), device, vocab_size, want_logprobs, top)
        greedy = [p.greedy for p in params]
        top_ks = [vocab_size if g or not 0 < p.top_k < vocab_size else p.top_k
                  for p, g in zip(params, greedy)]
        top_ps = [1.0 if g else p.top_p for p, g in zip(params, greedy)]
        min_ps = [0.0 if g else p.min_p for p, g in zip(params, greedy)]
        penalties = [p.repetition_penalty for p in params]
        temperatures = [0.0 if g else p.temperature for p, g in zip(params, greedy)]

        def put(values, dtype):
            t = torch.tensor(values, dtype=dtype)
            if device.type == "cuda":
                t = t.pin_memory()
            return t.to(device, non_blocking=True)

        # One copy for the four float rows instead of four.
        floats = put([temperatures, top_ps, min_ps, penalties], torch.float32)
        token_ids = None
        if any(x != 1.0 for x in penalties):
            # Unpenalised rows need no ids: one keeps the tensor as narrow as possible.
            rows = [s.token_ids if x != 1.0 else s.token_ids[:1]
                    for s, x in zip(seqs, penalties)]
            width = max(map(len, rows))
            token_ids = put([r + [r[0]] * (width - len(r)) for r in rows], torch.int64)
        counted = {}
        if any(p.frequency_penalty or p.presence_penalty for p in params):
            # Rows without either penalty count nothing: no ids, one zero-weight pad.
            outs = [s.completion_token_ids if p.frequency_penalty or p.presence_penalty
                    else [] for s, p in zip(seqs, params)]
            width = max(1, max(map(len, outs)))
            counted = dict(
                output_ids=put([o + [0] * (width - len(o)) for o in outs], torch.int64),
                output_weights=put([[1.0] * len(o) + [0.0] * (width - len(o)) for o in outs],
                                   torch.float32),
                frequency_penalties=put([p.frequency_penalty for p in params], torch.float32),
                presence_penalties=put([p.presence_penalty for p in params], torch.float32))
        biased = {}
        # -inf: min_tokens' ids that would end a row until it has that many tokens, and
        # bad_words' tokens that would complete a bad word.
        banned = [[]] * len(params)
        if any(p.min_tokens or p.bad_words for p in params):
            banned = [[*(s.stop_ids if s.num_completion_tokens < p.min_tokens else ()),
                       *bad_word_bans(s.completion_token_ids, s.bad_words_ids)]
                      for s, p in zip(seqs, params)]
        if any(p.logit_bias for p in params) or any(banned):
            biases = [list((p.logit_bias or {}).items())
                      + [(t, float("-inf")) for t in b if t < vocab_size]  # ids it can draw
                      for p, b in zip(params, banned)]
            width = max(map(len, biases))
            pads = [b + [(0, 0.0)] * (width - len(b)) for b in biases]
            biased = dict(bias_ids=put([[t for t, _ in b] for b in pads], torch.int64),
                          bias_values=put([[v for _, v in b] for b in pads], torch.float32))
        if any(p.allowed_token_ids for p in params):
            lists = [p.allowed_token_ids or [0] for p in params]
            width = max(map(len, lists))
            biased["allowed_ids"] = put([a + [a[0]] * (width - len(a)) for a in lists],
                                        torch.int64)
            biased["restricted"] = put([p.allowed_token_ids is not None for p in params],
                                       torch.bool)
        seeded = [(i, step_seed(p.seed, s.num_completion_tokens))
                  for i, (s, p, g) in enumerate(zip(seqs, params, greedy))
                  if p.seed is not None and not g]
        return cls(temperatures=floats[0], top_ps=floats[1], min_ps=floats[2],
                   repetition_penalties=floats[3], top_ks=put(top_ks, torch.int64),
                   token_ids=token_ids, seeded_rows=seeded, all_greedy=all(greedy),
                   reads_tail=any(len(w) > 1 for s in seqs for w in s.bad_words_ids),
                   any_greedy=any(greedy), do_top_k=any(k < vocab_size for k in top_ks),
                   do_top_p=any(p < 1.0 for p in top_ps), do_min_p=any(p > 0 for p in min_ps),
                   want_logprobs=want_logprobs, top_logprobs=top, **counted, **biased)


def bad_word_bans(completion: list, bad_words_ids) -> list[int]:
    """The last token of each bad word whose other tokens end ``completion`` (vLLM's
    rule; a one-token word: always)."""
    bans = []
    for word in bad_words_ids:
        head = len(word) - 1
        if head == 0 or (len(completion) >= head and tuple(completion[-head:]) == word[:-1]):
            bans.append(word[-1])
    return bans


def apply_repetition_penalty(logits, token_ids, penalties):
    """Divide the positive and multiply the negative logits of each row's seen tokens by
    its penalty (Hugging Face's RepetitionPenaltyLogitsProcessor, vLLM). Out of place."""
    seen = logits.gather(1, token_ids)
    p = penalties[:, None]
    return logits.scatter(1, token_ids, torch.where(seen > 0, seen / p, seen * p))


def apply_frequency_presence_penalties(logits, output_ids, output_weights,
                                       frequency_penalties, presence_penalties):
    """Subtract from each row's logits frequency_penalty x (times the token occurs in the
    output so far) + presence_penalty x (whether it occurs): OpenAI's and vLLM's rule.
    Out of place."""
    counts = torch.zeros_like(logits).scatter_add_(1, output_ids, output_weights)
    return logits - frequency_penalties[:, None] * counts \
        - presence_penalties[:, None] * (counts > 0).to(logits.dtype)


def apply_top_k_top_p(logits, top_ks=None, top_ps=None):
    """Set to -inf the logits outside each row's top k, then outside its top-p nucleus:
    the most likely tokens whose probabilities (after top-k) sum to at least top_p.
    Hugging Face's rules: a token tied with the k-th is kept, the top token always is.
    One ascending sort serves both. Out of place."""
    sorted_logits, order = logits.sort(dim=-1)
    if top_ks is not None:
        kth = sorted_logits.gather(1, (logits.shape[-1] - top_ks)[:, None])
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if top_ps is not None:
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cum <= (1 - top_ps)[:, None]
        drop[:, -1] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def apply_min_p(logits, min_ps):
    """Set to -inf the logits of tokens less likely than min_p times the top token:
    p_i < min_p * p_max  <=>  logit_i < logit_max + log(min_p), so no softmax is needed
    (min_p = 0 gives log 0 = -inf: nothing dropped). Out of place."""
    threshold = logits.amax(dim=-1, keepdim=True) + min_ps.log()[:, None]
    return logits.masked_fill(logits < threshold, float("-inf"))


class Sampler(nn.Module):
    """forward(logits (B, V), SamplingTensors) -> (token_ids (B,) int64, logprobs (B,)
    float32), both on logits' device. logprobs are log_softmax of the raw logits at the
    chosen tokens (vLLM's default: the model's distribution, before any processing).

    seed: seeds the generator of the rows without a seed of their own; None: torch's
    default generator (so torch.manual_seed governs them).
    """

    def __init__(self, seed: int | None = None):
        super().__init__()
        self.seed = seed
        self._shared: dict[torch.device, torch.Generator] = {}
        self._scratch: dict[torch.device, torch.Generator] = {}  # reseeded per seeded row

    @staticmethod
    def _generator(cache, device, seed=None):
        """The cache's generator for device, made (and seeded, if seed) on first use."""
        gen = cache.get(device)
        if gen is None:
            gen = cache[device] = torch.Generator(device=device)
            if seed is not None:
                gen.manual_seed(seed)
        return gen

    @torch.no_grad()
    def forward(self, logits: torch.Tensor, t: SamplingTensors):
        if logits.dim() != 2 or logits.shape[0] != t.temperatures.shape[0]:
            _fail(ValueError, "logits", f"shape ({t.temperatures.shape[0]}, vocab_size), one "
                  "row per SamplingTensors row", f"shape {tuple(logits.shape)}")
        if t.all_greedy and not t.adjusts_logits and not t.want_logprobs:
            # fp32 holds every 16-bit logit exactly: the argmax of the raw logits is the
            # same, without writing and reading an fp32 copy of (B, vocab).
            return logits.argmax(dim=-1), None
        raw = logits.float()
        x = raw
        if t.bias_ids is not None:
            x = x.scatter_add(1, t.bias_ids, t.bias_values)
        if t.token_ids is not None:
            x = apply_repetition_penalty(x, t.token_ids, t.repetition_penalties)
        if t.output_ids is not None:
            x = apply_frequency_presence_penalties(
                x, t.output_ids, t.output_weights, t.frequency_penalties,
                t.presence_penalties)
        if t.allowed_ids is not None:
            keep = torch.zeros_like(x, dtype=torch.bool).scatter_(1, t.allowed_ids, True)
            x = x.masked_fill(~keep & t.restricted[:, None], float("-inf"))
        if t.all_greedy:
            tokens = x.argmax(dim=-1)
        else:
            tokens = self._sample(x, t)
            if t.any_greedy:
                tokens = torch.where(t.temperatures == 0, x.argmax(dim=-1), tokens)
        if not t.want_logprobs:
            return tokens, None
        logprobs = raw.gather(1, tokens[:, None]).squeeze(1) - raw.logsumexp(dim=-1)
        return tokens, logprobs

    def _sample(self, x, t: SamplingTensors):
        # Greedy rows divide by 1 here; their draw is discarded by forward.
        x = x / torch.where(t.temperatures == 0, 1.0, t.temperatures)[:, None]
        if t.do_top_k or t.do_top_p:
            x = apply_top_k_top_p(x, t.top_ks if t.do_top_k else None,
                                  t.top_ps if t.do_top_p else None)
        if t.do_min_p:
            x = apply_min_p(x, t.min_ps)
        probs = x.softmax(dim=-1)
        exp = torch.empty_like(probs)
        if len(t.seeded_rows) < probs.shape[0]:  # some rows use the shared generator
            shared = None if self.seed is None else \
                self._generator(self._shared, x.device, self.seed)
            exp.exponential_(generator=shared)
        for row, seed in t.seeded_rows:
            # Reseeding one generator is host work only: each launch takes its state then.
            gen = self._generator(self._scratch, x.device)
            gen.manual_seed(seed)
            exp[row].exponential_(generator=gen)
        # A zero draw would make 0/0 = nan at a masked token, and argmax picks nan.
        return probs.div_(exp.clamp_min_(torch.finfo(exp.dtype).tiny)).argmax(dim=-1)
