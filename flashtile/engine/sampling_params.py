"""SamplingParams: how one request is decoded (vLLM's names and defaults).

Beyond the lead's spec, in vLLM's sense: ``max_tokens=None`` means "until the sequence
reaches max_model_len" (the OpenAI endpoints send no limit by default), ``stop`` /
``stop_token_ids`` are normalised to lists (``[]`` when None), and ``output_kind`` says
what ``LLM.step`` returns for the request (RequestOutputKind).
"""

from __future__ import annotations

import dataclasses
import enum
import math
import numbers
from dataclasses import dataclass

from flashtile._validate import _fail

# Below this temperature sampling is greedy, as in vLLM: dividing logits by a tinier
# temperature overflows float32 (a logit of 40 / 1e-38 is inf) and the draw would be an
# argmax anyway.
GREEDY_TEMPERATURE = 1e-5
# The most alternatives SamplingParams.logprobs may ask for at each position (vLLM's
# default max_logprobs, OpenAI chat's top_logprobs bound).
MAX_LOGPROBS = 20


def _check_int(name, value, allow_none=False):
    if value is None and allow_none:
        return
    # bool is an int subclass; True as a count or seed is almost surely a mistake.
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        _fail(TypeError, name, "an int" + (" or None" if allow_none else ""),
              f"{type(value).__name__} {value!r}")


def _check_float(name, value):
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        _fail(TypeError, name, "a float", f"{type(value).__name__} {value!r}")
    if not math.isfinite(value):
        _fail(ValueError, name, "a finite number", value)
    return float(value)


class RequestOutputKind(enum.Enum):
    """What LLM.step returns for a request (vLLM's enum). A server streaming to many
    clients asks for DELTA (each output carries only what is new) or FINAL_ONLY: copying
    every token list at every step costs host time that grows with the output."""

    CUMULATIVE = 0  # every output carries all of the completion so far
    DELTA = 1       # the tokens, text and logprobs new since the request's last output
    FINAL_ONLY = 2  # one output, the whole completion, when the request finishes


@dataclass
class SamplingParams:
    """Decoding options of one request.

    n: completions per prompt (LLM.generate, LLM.chat and the server; add_request takes
        1): each its own request (``completions``), seeded seed + i when seed is given.
    temperature: 0 (below 1e-5) is greedy; higher flattens the distribution.
    top_p: keep the smallest set of most likely tokens whose probability reaches top_p,
        in (0, 1]; 1 keeps all.
    top_k: keep the k most likely tokens; 0 or -1 keeps all.
    min_p: drop tokens whose probability is below min_p times the top token's, in [0, 1].
    repetition_penalty: > 0; divides positive logits and multiplies negative ones of every
        token in the prompt or the output so far (Hugging Face / vLLM meaning); 1 is off.
    presence_penalty: in [-2, 2]; subtracted from the logit of every token the output so
        far contains (OpenAI / vLLM meaning: the prompt does not count); 0 is off.
    frequency_penalty: in [-2, 2]; subtracted from a token's logit once per time the output
        so far contains it; 0 is off.
    logit_bias: {token id: bias in [-100, 100]} added to those logits before any other
        processing (OpenAI's meaning; -100 all but bans a token, 100 all but forces it).
    seed: makes this request's draws reproducible whatever batch it runs in.
    stop: strings that end the completion (not included in the text).
    stop_token_ids: token ids that end the completion.
    max_tokens: most tokens to generate (>= 1); None: until max_model_len.
    min_tokens: tokens generated before the end-of-sequence token, stop_token_ids or a
        stop string may end the completion (vLLM's meaning: until then those tokens are
        never drawn and stop strings are not looked for); at most max_tokens.
    include_stop_str_in_output: keep the stop string that ended the completion at the
        end of its text.
    allowed_token_ids: only these ids may be drawn (vLLM's meaning; after the bias and
        penalties, before temperature and the truncations); None: any.
    ignore_eos: keep generating past the end-of-sequence token.
    logprobs: None: no log-probabilities; an int k in [0, MAX_LOGPROBS]: return the
        log-probability of each chosen token (the raw model distribution's, vLLM's
        default) and, for k > 0, those of the k most likely tokens at each position.
    prompt_logprobs: None, or an int k in [0, MAX_LOGPROBS]: the log-probability of each
        prompt token given the tokens before it (RequestOutput.prompt_logprobs; vLLM's
        meaning), with the k most likely tokens at each position. Such a request takes
        no prefix-cache hit until its prompt's logprobs are computed.
    skip_special_tokens: leave special tokens out of the detokenised text.
    bad_words: words never to be generated (vLLM's meaning): each is tokenised, also
        with a leading space where that gives other ids of the same length, and a
        word's last token is barred where the tokens before it end the completion (a
        one-token word: always). Needs the model's tokenizer.
    truncate_prompt_tokens: None, or keep only the prompt's last k tokens (vLLM's left
        truncation; -1: max_model_len). RequestOutput.prompt is then the kept tokens'
        text.
    output_kind: what LLM.step returns for the request (RequestOutputKind): CUMULATIVE
        (default), DELTA or FINAL_ONLY. LLM.generate returns whole completions whatever
        it is.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    max_tokens: int | None = 16
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    prompt_logprobs: int | None = None
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    allowed_token_ids: list[int] | None = None
    truncate_prompt_tokens: int | None = None
    bad_words: list[str] | None = None

    def __post_init__(self):
        _check_int("n", self.n)
        if self.n < 1:
            _fail(ValueError, "n", "an int >= 1 (completions per prompt)", self.n)
        self.temperature = _check_float("temperature", self.temperature)
        if self.temperature < 0:
            _fail(ValueError, "temperature", "a number >= 0 (0 is greedy)", self.temperature)
        self.top_p = _check_float("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            _fail(ValueError, "top_p", "a number in (0, 1] (1 keeps every token)", self.top_p)
        _check_int("top_k", self.top_k)
        if self.top_k < -1:
            _fail(ValueError, "top_k", "an int >= 1, or 0 or -1 to keep every token",
                  self.top_k)
        self.min_p = _check_float("min_p", self.min_p)
        if not 0 <= self.min_p <= 1:
            _fail(ValueError, "min_p", "a number in [0, 1] (0 is off)", self.min_p)
        self.repetition_penalty = _check_float("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            _fail(ValueError, "repetition_penalty", "a number > 0 (1 is off)",
                  self.repetition_penalty)
        for name in ("presence_penalty", "frequency_penalty"):
            value = _check_float(name, getattr(self, name))
            if not -2 <= value <= 2:
                _fail(ValueError, name, "a number in [-2, 2] (0 is off)", value)
            setattr(self, name, value)
        self.logit_bias = self._bias_dict(self.logit_bias)
        _check_int("seed", self.seed, allow_none=True)
        self.stop = self._str_list("stop", self.stop)
        self.bad_words = self._str_list("bad_words", self.bad_words) or None
        self.stop_token_ids = self._token_id_list(self.stop_token_ids, "stop_token_ids")
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = self._token_id_list(self.allowed_token_ids,
                                                         "allowed_token_ids")
            if not self.allowed_token_ids:
                _fail(ValueError, "allowed_token_ids", "a non-empty list of token ids or "
                      "None", "[]")
        _check_int("max_tokens", self.max_tokens, allow_none=True)
        if self.max_tokens is not None and self.max_tokens < 1:
            _fail(ValueError, "max_tokens", "an int >= 1 (or None: up to max_model_len)",
                  self.max_tokens)
        _check_int("min_tokens", self.min_tokens)
        if self.min_tokens < 0 or (self.max_tokens is not None
                                   and self.min_tokens > self.max_tokens):
            _fail(ValueError, "min_tokens", f"an int in [0, max_tokens={self.max_tokens}]",
                  self.min_tokens)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check_int(name, value, allow_none=True)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                _fail(ValueError, name, f"None or an int in [0, {MAX_LOGPROBS}]", value)
        k = self.truncate_prompt_tokens
        _check_int("truncate_prompt_tokens", k, allow_none=True)
        if k is not None and k != -1 and k < 1:
            _fail(ValueError, "truncate_prompt_tokens", "None, -1 (max_model_len) or an "
                  "int >= 1", k)
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                _fail(TypeError, name, "a bool", repr(getattr(self, name)))
        if not isinstance(self.output_kind, RequestOutputKind):
            _fail(TypeError, "output_kind", "a RequestOutputKind", repr(self.output_kind))

    def truncate(self, token_ids: list, max_model_len: int) -> list:
        """The prompt ids the request keeps: the last truncate_prompt_tokens of them
        (-1: max_model_len), or all."""
        k = self.truncate_prompt_tokens
        if k is None:
            return token_ids
        k = max_model_len if k == -1 else k
        return token_ids[-k:] if len(token_ids) > k else token_ids

    @staticmethod
    def _str_list(name, value):
        """stop or bad_words: a string or a list of non-empty strings, as a list."""
        if value is not None and not isinstance(value, (str, list, tuple)):
            _fail(TypeError, name, "a str, a list of str or None",
                  f"{type(value).__name__} {value!r}"[:80])
        items = [value] if isinstance(value, str) else list(value or [])
        for i, s in enumerate(items):
            if not isinstance(s, str):
                _fail(TypeError, f"{name}[{i}]", "a str", f"{type(s).__name__} {s!r}")
            # "" occurs at every position: a stop would end the completion before it
            # starts, and a bad word of no tokens bars nothing.
            if not s:
                _fail(ValueError, f"{name}[{i}]", "a non-empty string", repr(s))
        return items

    @staticmethod
    def _bias_dict(bias):
        """logit_bias as {int token id >= 0: float bias in [-100, 100]}; None or {}: None.
        (The model's vocabulary bounds the ids: LLM checks them when the request comes.)"""
        if bias is None:
            return None
        if not isinstance(bias, dict):
            _fail(TypeError, "logit_bias", "a dict {token id: bias} or None", repr(bias)[:80])
        out = {}
        for token, value in bias.items():
            _check_int("logit_bias", token)
            if token < 0:
                _fail(ValueError, "logit_bias", "token ids >= 0", token)
            value = _check_float(f"logit_bias[{token}]", value)
            if not -100 <= value <= 100:
                _fail(ValueError, f"logit_bias[{token}]", "a bias in [-100, 100]", value)
            out[int(token)] = value
        return out or None

    def completions(self) -> list[SamplingParams]:
        """The parameters of each of the n completions of a prompt, one request each
        (vLLM's fan-out): n = 1, and seed + i where a seed is given, so the draws differ
        and each is reproducible alone."""
        if self.n == 1:
            return [self]
        return [dataclasses.replace(self, n=1, seed=None if self.seed is None else
                                    self.seed + i) for i in range(self.n)]

    @property
    def adjusts_logits(self) -> bool:
        """Whether a penalty, a bias, min_tokens, allowed_token_ids or bad_words changes
        the logits before the token is chosen."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 \
            or self.frequency_penalty != 0.0 or self.logit_bias is not None \
            or self.min_tokens > 0 or self.allowed_token_ids is not None \
            or self.bad_words is not None

    @staticmethod
    def _token_id_list(ids, name):
        if isinstance(ids, (str, bytes)) or (ids is not None and not hasattr(ids, "__iter__")):
            _fail(TypeError, name, "a list of ints or None", repr(ids))
        ids = list(ids or [])
        for i, t in enumerate(ids):
            _check_int(f"{name}[{i}]", t)
            if t < 0:
                _fail(ValueError, f"{name}[{i}]", "a token id >= 0", t)
        return [int(t) for t in ids]

    @property
    def greedy(self) -> bool:
        """True when the request takes the most likely token at every step."""
        return self.temperature < GREEDY_TEMPERATURE
