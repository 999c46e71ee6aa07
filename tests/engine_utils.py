"""Tiny checkpoints and tokenizers made with transformers' and tokenizers' own classes,
the ground truth of the engine tests."""

from __future__ import annotations

import json
import os

import pytest
import torch

VOCAB = 300
# A ChatML-like template using what transformers passes templates: bos_token,
# add_generation_prompt, raise_exception and the loop controls.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}"
    "{% if m['role'] == 'system' and not loop.first %}{% continue %}{% endif %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] | trim }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

# name -> (transformers class names, config overrides, save_pretrained kwargs)
CASES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}, {}),
    "llama3-rope-tied": ("LlamaConfig", "LlamaForCausalLM", dict(
        tie_word_embeddings=True, rope_scaling=dict(
            rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
            original_max_position_embeddings=32)), {}),
    "llama-linear-rope": ("LlamaConfig", "LlamaForCausalLM",
                          dict(rope_scaling=dict(rope_type="linear", factor=4.0)), {}),
    "mistral-window": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=6), {}),
    "qwen2-bias": ("Qwen2Config", "Qwen2ForCausalLM", {}, {}),
    "qwen3-sharded": ("Qwen3Config", "Qwen3ForCausalLM",
                      dict(head_dim=24, tie_word_embeddings=True),
                      dict(max_shard_size="60KB")),
}


def hf_config(case: str, **overrides):
    import transformers
    config_cls, _, extra, _ = CASES[case]
    kw = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, intermediate_size=96, vocab_size=VOCAB,
              max_position_embeddings=256, eos_token_id=2, bos_token_id=1)
    return getattr(transformers, config_cls)(**{**kw, **extra, **overrides})


def make_checkpoint(path, case: str, seed: int = 0, **overrides):
    """Save a random-initialised transformers model of the case's architecture into path;
    returns the model (fp32, eval). Weights are redrawn larger than transformers' init
    (std 0.02) so that logits are far from ties and every bias and norm weight counts."""
    import transformers
    _, model_cls, _, save_kw = CASES[case]
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(hf_config(case, **overrides)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(1.0, 0.1)
            else:
                p.normal_(0.0, 0.08)
    model.save_pretrained(str(path), safe_serialization=True, **save_kw)
    return model


def make_tokenizer(path):
    """A byte-level BPE tokenizer trained on a few sentences, with a chat template and
    special tokens, saved as tokenizer.json + tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["The capital of France is Paris. Hello world, how are you today?",
              "héllo wörld, ünïcode 日本語 and an emoji 🙂 or two 🙂🙂"] * 10
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["<unk>", "<s>", "</s>", "<|im_start|>",
                                          "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A",
                                                       special_tokens=[("<s>", 1)])
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
                   "chat_template": CHAT_TEMPLATE,
                   "tokenizer_class": "PreTrainedTokenizerFast"}, f)


def hf_greedy(model, prompt, max_new_tokens):
    """transformers' greedy continuation of one prompt (ending at its eos token too)."""
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                         max_new_tokens=max_new_tokens, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(autouse=True)
def engine_cpu(monkeypatch):
    """flashtile's torch path on CPU (not the Triton interpreter, far too slow for a
    whole model), one thread: tiny matmuls on a shared machine lose 10x to contention."""
    monkeypatch.setenv("FLASHTILE_BACKEND", "torch")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_llm(tmp_path_factory, max_model_len=64, **kw):
    """For module fixtures (``yield from``): an LLM over a tiny llama checkpoint with a
    tokenizer, fp32 on flashtile's torch path, pages of 16 tokens; kw: more of
    EngineConfig's."""
    from flashtile.engine import LLM

    path = tmp_path_factory.mktemp("llama")
    make_checkpoint(path, "llama")
    make_tokenizer(path)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FLASHTILE_BACKEND", "torch")
        yield LLM(str(path), dtype="float32", device="cpu", max_model_len=max_model_len,
                  page_size=16, **kw)


class ServerThread:
    """An aiohttp application served on 127.0.0.1 (a free port) by a thread running its
    own event loop, so that tests and synchronous clients (``flashtile bench serve``) talk
    to it over a real socket. ``with ServerThread(app) as server: server.url``."""

    def __init__(self, app):
        import asyncio
        import threading
        self.app, self.loop = app, asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.ready, self.error, self.port = threading.Event(), None, None

    @classmethod
    def over(cls, llm, model_name):
        """flashtile serve's application over an existing LLM."""
        from flashtile.engine.server import AsyncEngine, build_app
        return cls(build_app(AsyncEngine(lambda: llm), model_name))

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _run(self):
        from aiohttp import web

        async def start():
            # handler_cancellation as `flashtile serve` runs it: a client that goes away
            # cancels its handler.
            self.runner = web.AppRunner(self.app, handler_cancellation=True)
            await self.runner.setup()
            await web.TCPSite(self.runner, "127.0.0.1", 0).start()
            self.port = self.runner.addresses[0][1]

        try:
            self.loop.run_until_complete(start())
        except Exception as err:  # reported by __enter__
            self.error = err
            self.ready.set()
            return
        self.ready.set()
        self.loop.run_forever()
        self.loop.run_until_complete(self.runner.cleanup())
        self.loop.close()

    def __enter__(self):
        self.thread.start()
        if not self.ready.wait(60) or self.error is not None:
            raise RuntimeError(f"the test server did not start: {self.error!r}")
        return self

    def __exit__(self, *exc):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(60)
