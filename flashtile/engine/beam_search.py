"""Beam search over an LLM, as vLLM's ``LLM.beam_search`` does it: no engine change, one
batch of one-token requests a step (``generate`` offline, the asynchronous engine in the
server's ``use_beam_search``). Every live beam asks for one token with the 2 x beam_width
most likely next tokens' logprobs (the raw distribution's); each becomes a candidate
beam, a candidate ending in an end-of-sequence token is finished, and the beam_width
best of the others go on. The prefix cache makes a step cost little more than the new
token of each beam: their prompts share every full page with the step before.

Ranking is vLLM's: cumulative logprob over ``len(tokens) ** length_penalty``, the
prompt's tokens counted (an end-of-sequence token not); beams of one step have one
length, so they are ranked by their cumulative logprob, as transformers' running beams
are.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from flashtile._validate import _fail
from flashtile.engine.sampling_params import MAX_LOGPROBS, SamplingParams, _check_int


@dataclass
class BeamSearchParams:
    """vLLM's BeamSearchParams: beam_width beams, at most max_tokens new tokens each;
    ignore_eos: an end-of-sequence token does not end a beam; length_penalty: the
    exponent of the length that divides a beam's cumulative logprob when finished beams
    are ranked; temperature: vLLM's field, kept for its callers (the candidates come from
    the raw distribution whatever it is)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0

    def __post_init__(self):
        _check_int("beam_width", self.beam_width)
        if not 1 <= self.beam_width <= MAX_LOGPROBS // 2:
            _fail(ValueError, "beam_width", f"an int in [1, {MAX_LOGPROBS // 2}] (each beam "
                  f"reads 2 x beam_width logprobs, at most {MAX_LOGPROBS})", self.beam_width)
        _check_int("max_tokens", self.max_tokens)
        if self.max_tokens < 1:
            _fail(ValueError, "max_tokens", "an int >= 1", self.max_tokens)
        if not isinstance(self.ignore_eos, bool):
            _fail(TypeError, "ignore_eos", "a bool", repr(self.ignore_eos))


@dataclass
class BeamSearchSequence:
    """A beam: its tokens (the prompt's, then the generated ones), the logprobs of the
    candidates at each generated position ({token id: logprob}), their sum for the
    chosen tokens, the generated text and why it ended ("stop": an end-of-sequence
    token, "length": max_tokens or max_model_len)."""

    tokens: list
    logprobs: list = field(default_factory=list)
    cum_logprob: float = 0.0
    text: Optional[str] = None
    finish_reason: Optional[str] = None


@dataclass
class BeamSearchOutput:
    """The beam_width best beams of one prompt, best first."""

    sequences: list


def score(beam: BeamSearchSequence, eos_token_ids, length_penalty: float) -> float:
    """vLLM's get_beam_search_score: the cumulative logprob over the length (prompt
    included, an end-of-sequence token not) to the length_penalty."""
    n = len(beam.tokens) - (beam.tokens[-1] in eos_token_ids)
    return beam.cum_logprob / n ** length_penalty


class BeamSearch:
    """The beams of a batch of prompts (token id lists) between steps: ``prompts()`` are
    the live beams to extend by one token (with ``step_params``), ``advance(outputs)``
    takes their RequestOutputs, ``results()`` the best beams once no beam is live or
    max_tokens steps have run. LLM.beam_search drives it with ``generate``, the server
    with the asynchronous engine."""

    def __init__(self, prompts, params: BeamSearchParams, eos_token_ids, max_model_len,
                 output_kind=None):
        if not isinstance(params, BeamSearchParams):
            _fail(TypeError, "params", "a BeamSearchParams", type(params).__name__)
        self.params, self.limit = params, max_model_len
        self.eos = frozenset() if params.ignore_eos else frozenset(eos_token_ids)
        kind = {} if output_kind is None else {"output_kind": output_kind}
        self.step_params = SamplingParams(max_tokens=1, logprobs=2 * params.beam_width,
                                          temperature=params.temperature, ignore_eos=True,
                                          **kind)
        self.starts = [list(p) for p in prompts]
        self.live = [[BeamSearchSequence(p)] for p in self.starts]
        self.done = [[] for _ in self.starts]
        self.steps = 0
        self._flat = []

    def prompts(self) -> list:
        """The live beams' tokens, to extend by one token; [] when the search is over."""
        self._flat = [(i, b) for i, beams in enumerate(self.live) for b in beams] \
            if self.steps < self.params.max_tokens else []
        return [b.tokens for _, b in self._flat]

    def advance(self, outputs):
        """The outputs of ``prompts()``' requests, in order: every beam's 2 x beam_width
        candidates; an end-of-sequence one is finished, the beam_width best of the
        others go on (those at max_model_len finished too)."""
        self.steps += 1
        width = self.params.beam_width
        candidates = [[] for _ in self.live]
        for (i, beam), out in zip(self._flat, outputs):
            top = out.outputs[0].top_logprobs[0]
            for token, logprob in top.items():
                child = BeamSearchSequence(beam.tokens + [token], beam.logprobs + [top],
                                           beam.cum_logprob + logprob)
                if token in self.eos:
                    child.finish_reason = "stop"
                    self.done[i].append(child)
                else:
                    candidates[i].append(child)
        for i, cands in enumerate(candidates):
            cands.sort(key=lambda b: b.cum_logprob, reverse=True)  # one length: raw order
            self.live[i] = [b for b in cands[:width] if len(b.tokens) < self.limit]
            self.done[i] += [b for b in cands[:width] if len(b.tokens) >= self.limit]

    def results(self, tokenizer=None) -> list[BeamSearchOutput]:
        """Each prompt's beam_width best beams, best first, their text decoded."""
        out = []
        for beams, finished, prompt in zip(self.live, self.done, self.starts):
            best = sorted(finished + beams, reverse=True,
                          key=lambda b: score(b, self.eos, self.params.length_penalty))
            best = best[:self.params.beam_width]
            for b in best:
                b.finish_reason = b.finish_reason or "length"
                if tokenizer is not None:
                    b.text = tokenizer.decode(b.tokens[len(prompt):])
            out.append(BeamSearchOutput(best))
        return out


def beam_search(llm, prompts, params: BeamSearchParams) -> list[BeamSearchOutput]:
    """The beams of each prompt (a string, token ids, or vLLM's prompt dicts)."""
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, (list, tuple)) and prompts
                                            and isinstance(prompts[0], int)):
        prompts = [prompts]
    search = BeamSearch([_token_ids(llm, p) for p in prompts], params,
                        llm.scheduler.eos_token_ids, llm.config.max_model_len)
    while batch := search.prompts():  # the first step checks the prompts
        search.advance(llm.generate(batch, search.step_params, use_tqdm=False))
    return search.results(llm.tokenizer)


def _token_ids(llm, prompt) -> list:
    from flashtile.engine.llm import _prompt_of

    if isinstance(prompt, dict):
        prompt = _prompt_of(prompt)[0]
    if isinstance(prompt, str):
        if llm.tokenizer is None:
            _fail(ValueError, "prompt", "token ids (the model has no tokenizer.json)",
                  "a string")
        return llm.tokenizer.encode(prompt)
    return list(prompt)
