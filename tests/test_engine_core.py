"""The engine's host-side core: SamplingParams, Sequence, BlockManager, Sampler.

All CPU and fast: these are Python and plain torch, no Triton.
"""

import math

import pytest

from flashtile.engine.sampling_params import SamplingParams
from flashtile.engine.sequence import Sequence, SequenceStatus


# ---------------------------------------------------------------- SamplingParams

@pytest.mark.parametrize("kwargs, exc, words", [
    (dict(n=2), ValueError, "n: expected 1"),
    (dict(temperature=-0.5), ValueError, "temperature"),
    (dict(temperature=math.nan), ValueError, "temperature: expected a finite"),
    (dict(temperature=math.inf), ValueError, "temperature: expected a finite"),
    (dict(temperature="hot"), TypeError, "temperature: expected a float"),
    (dict(top_p=0.0), ValueError, "top_p: expected a number in (0, 1]"),
    (dict(top_p=1.5), ValueError, "top_p"),
    (dict(top_p=math.nan), ValueError, "top_p"),
    (dict(top_k=-2), ValueError, "top_k"),
    (dict(top_k=2.5), TypeError, "top_k: expected an int"),
    (dict(min_p=-0.1), ValueError, "min_p"),
    (dict(min_p=1.1), ValueError, "min_p"),
    (dict(repetition_penalty=0.0), ValueError, "repetition_penalty"),
    (dict(seed=True), TypeError, "seed: expected an int or None"),
    (dict(seed="1"), TypeError, "seed"),
    (dict(stop=[""]), ValueError, "stop[0]"),
    (dict(stop=["a", 3]), TypeError, "stop[1]"),
    (dict(stop_token_ids=[1, -1]), ValueError, "stop_token_ids[1]"),
    (dict(stop_token_ids="2"), TypeError, "stop_token_ids"),
    (dict(max_tokens=0), ValueError, "max_tokens: expected an int >= 1"),
    (dict(max_tokens=1.0), TypeError, "max_tokens"),
    (dict(logprobs=-1), ValueError, "logprobs"),
    (dict(ignore_eos=1), TypeError, "ignore_eos: expected a bool"),
], ids=lambda x: x if isinstance(x, str) else None)
def test_sampling_params_rejects(kwargs, exc, words):
    with pytest.raises(exc) as info:
        SamplingParams(**kwargs)
    assert words in str(info.value)
    # the message names what was given too
    assert "got" in str(info.value)


def test_sampling_params_defaults_and_normalisation():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p, p.max_tokens) == \
        (1, 1.0, 1.0, -1, 0.0, 16)
    assert p.stop == [] and p.stop_token_ids == [] and not p.greedy
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop_token_ids=(2, 7)).stop_token_ids == [2, 7]
    assert SamplingParams(temperature=0).greedy
    assert isinstance(SamplingParams(temperature=1).temperature, float)
    assert SamplingParams(max_tokens=None, top_k=0, logprobs=0).max_tokens is None


# ---------------------------------------------------------------- Sequence

def test_sequence_accounting():
    p = SamplingParams(max_tokens=4)
    a, b = Sequence([5, 6, 7], p, arrival_time=1.0), Sequence([1])
    assert b.seq_id > a.seq_id  # arrival order, used to pick whom to preempt
    assert a.status is SequenceStatus.WAITING and a.sampling_params is p
    assert (a.num_tokens, a.num_prompt_tokens, a.num_computed_tokens) == (3, 3, 0)
    assert a.num_blocks(2) == 2 and a.num_blocks(3) == 1 and a.num_blocks(16) == 1
    assert a.first_token_time is None
    a.append_token(9, logprob=-0.5)
    a.append_token(4)
    assert a.token_ids == [5, 6, 7, 9, 4] and a.last_token == 4 and len(a) == 5
    assert a.prompt_token_ids == [5, 6, 7] and a.completion_token_ids == [9, 4]
    assert a.num_completion_tokens == 2 and a.output_logprobs == [-0.5]
    assert a.first_token_time >= a.arrival_time
    a.finish("length")
    assert a.is_finished and a.finish_reason == "length" and a.finish_time is not None
    with pytest.raises(ValueError, match="reason"):
        a.finish("done")
    with pytest.raises(ValueError, match="token_ids: expected a non-empty prompt"):
        Sequence([])
