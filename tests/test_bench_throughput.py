"""flashtile bench throughput's parent side (the providers need a GPU)."""

import argparse
import subprocess

import pytest

from flashtile.bench import throughput


def test_a_timed_out_provider_says_how_far_it_got(monkeypatch, capsys):
    def run(cmd, **kwargs):
        raise subprocess.TimeoutExpired(cmd, kwargs["timeout"], output="", stderr=(
            "PHASE engine built (graphs captured) at 41 s\nnoise\n"
            "PHASE warm-up done at 44 s\n"))

    monkeypatch.setattr(subprocess, "run", run)
    args = argparse.Namespace(timeout=90)
    assert throughput._child(args, [], "engine-sdpa", "/nowhere") is None
    assert ("engine-sdpa: timed out after 90 s; phases reached: engine built (graphs "
            "captured) at 41 s; warm-up done at 44 s") in capsys.readouterr().out


def test_a_provider_timed_out_while_loading(monkeypatch, capsys):
    def run(cmd, **kwargs):
        raise subprocess.TimeoutExpired(cmd, kwargs["timeout"], output=b"", stderr=None)

    monkeypatch.setattr(subprocess, "run", run)
    throughput._child(argparse.Namespace(timeout=5), [], "engine-naive", "/nowhere")
    assert "phases reached: none (still loading)" in capsys.readouterr().out


# ---- --decode-step --kernels: one step kernel by kernel (flashtile/bench/step_kernels.py)

def _cuda_like_session():
    """Two profiled steps of a CUDA-graph decode as profile_events returns them, 100 us
    each: an input copy launched in prepare, the graph's decode and combine kernels
    (linked to no host event; the combine's dependent launch overlaps the decode by
    2 us), then the logits' matmul, the argmax and the copy back, launched after the
    forward. A warm-up step outside any step range and an eager step carry kernels that
    must not count."""
    from flashtile.bench.step_kernels import STEP
    ranges, kernels = [], []
    for base, label in ((-300, None), (0, "4"), (200, "4"), (500, "4-eager")):
        if label:
            ranges.append((STEP + label, base, base + 100))
        ranges += [("flashtile.prepare", base + 1, base + 10),
                   ("flashtile.forward", base + 11, base + 15),
                   ("flashtile.wait", base + 30, base + 99)]
        kernels += [("Memcpy HtoD (Pinned -> Device)", base + 5, base + 7, base + 4, True),
                    ("_decode_kernel", base + 16, base + 40, None, True),
                    ("_combine_kernel", base + 38, base + 45, None, True),
                    ("nvjet_tst_64x8_64x16_4x1_v_bz_TNT", base + 50, base + 80, base + 20,
                     True),
                    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, "
                     "at::native::ArgMaxOps<float>, unsigned int, long, 4> >(int)",
                     base + 81, base + 90, base + 25, True),
                    ("Memcpy DtoH (Device -> Pinned)", base + 91, base + 92, base + 26, True)]
    return ranges, kernels


def test_kernel_breakdown_places_graph_kernels_and_sums_the_step():
    from flashtile.bench.step_kernels import summarize
    b = summarize(*_cuda_like_session(), "4", "CUDA graph replay")
    assert b["steps"] == 2 and b["unlinked"] == 2
    fwd, rest = b["sections"]["forward"], b["sections"]["rest"]
    assert [(r["name"], r["launches"], r["us"]) for r in fwd["kernels"]] == [
        ("_decode_kernel", 1, 24), ("_combine_kernel", 1, 7)]
    assert [r["name"] for r in rest["kernels"]] == [
        "nvjet_tst_64x8_64x16_4x1_v_bz_TNT", "reduce_kernel[ArgMaxOps]",
        "Memcpy HtoD (Pinned -> Device)", "Memcpy DtoH (Device -> Pinned)"]
    assert (fwd["launches"], fwd["us"], rest["launches"], rest["us"]) == (2, 31, 4, 42)
    # The forward's span: decode start to combine end, no gap (the overlap is not idle).
    assert (fwd["span_us"], fwd["idle_us"]) == (29, 0)
    assert abs(fwd["share"] - 31 / 73) < 1e-12 and abs(rest["share"] - 42 / 73) < 1e-12
    assert b["host_us"] == dict(step=100, prepare=9, forward=4, wait=69, rest=18)
    # 5 us before the first copy, 71 us of kernels (the 2 us overlap counted once), 16
    # idle between them, 8 after the last: the step's 100.
    assert b["device_us"] == dict(lead=5, busy=71, idle=16, tail=8)


def test_kernel_breakdown_falls_back_to_eager_steps_only_without_graph_kernels():
    from flashtile.bench.step_kernels import graph_or_eager, summarize
    ranges, kernels = _cuda_like_session()
    graph = summarize(ranges, kernels, "4", "CUDA graph replay")
    eager = summarize(ranges, kernels, "4-eager", "eager forward")
    assert graph_or_eager(graph, eager) is graph
    blind = summarize(ranges, [k for k in kernels if k[3] is not None], "4",
                      "CUDA graph replay")
    assert blind["sections"]["forward"]["launches"] == 0
    chosen = graph_or_eager(blind, eager)
    assert chosen["sections"] == eager["sections"]
    assert chosen["source"].startswith("eager forward: the profiler saw no kernel")
    assert summarize(ranges, kernels, "8", "CUDA graph replay") is None


def test_kernel_short_names():
    from flashtile.bench.step_kernels import short_name
    assert short_name("void at::native::vectorized_elementwise_kernel<4, at::native::"
                      "FillFunctor<c10::BFloat16>, std::array<char*, 1ul> >(int, at::native"
                      "::FillFunctor<c10::BFloat16>, std::array<char*, 1ul>)") \
        == "vectorized_elementwise_kernel[FillFunctor]"
    assert short_name("void at::native::(anonymous namespace)::indexSelectSmallIndex<c10::"
                      "BFloat16, long, unsigned int, 2, 2, -2>(long)") == "indexSelectSmallIndex"
    assert short_name("void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16"
                      "_16x16_128x2_tn_align8>(cutlass_80_wmma_tensorop_bf16_s161616gemm_"
                      "bf16_16x16_128x2_tn_align8::Params)") \
        == "cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x2_tn_align8"
    for kept in ("_decode_kernel", "Memcpy HtoD (Pinned -> Device)", "aten::mm"):
        assert short_name(kept) == kept


def test_decode_step_kernels_on_a_tiny_model(tmp_path, monkeypatch, on_gpu):
    """--decode-step --kernels end to end on the CPU (torch path, a 2-layer Qwen2 shape
    with dummy weights): each batch's step breakdown is consistent with itself, the
    greedy sampler's argmax and the logits' matmul lie outside the forward, and the
    table shows both sections with at most N kernels each."""
    import json

    import torch

    from flashtile.bench import step_kernels, throughput_runs

    if on_gpu:  # the engine would take the GPU; its breakdown there is engine-kernels'
        pytest.skip("the CPU operator breakdown; the GPU's runs in gpu_session.sh")
    monkeypatch.setenv("FLASHTILE_BACKEND", "torch")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    cfg = dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=64,
               intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=300, tie_word_embeddings=True,
               max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=10000.0,
               hidden_act="silu", torch_dtype="bfloat16")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    args = argparse.Namespace(model_dir=str(tmp_path), decode_batches=[1, 3], context=40,
                              decode_reps=2, copy_gbs=100.0, matmul_tflops=1.0, kernels=3,
                              prefill_seqs=2, profile=str(tmp_path / "host"))
    try:
        rows = throughput_runs._decode_steps(args, cfg)
    finally:
        torch.set_num_threads(threads)
    assert [r["batch"] for r in rows] == [1, 3, "prefill 2x40"]
    assert [r["prefill"] for r in rows] == [False, False, True]
    for batch in ("1", "3", "prefill 2x40"):  # --profile: each row's eager forwards
        text = (tmp_path / f"host-{batch}.txt").read_text()
        assert "5 eager forwards" in text and "model.py" in text
    # The prompt step against the roofline's prompt rule: 2 x parameters FLOPs a token.
    assert rows[2]["kv_gb"] == 0 and rows[2]["floor_ms"] == pytest.approx(
        1e3 * 2 * throughput.param_count(cfg) * 2 * 40 / 1e12)
    for r in rows:
        b = r["kernels"]
        assert b["source"] == "CPU operators (self time)" and r["kernels_eager"] is None
        assert b["steps"] == step_kernels.STEPS
        fwd, rest = b["sections"]["forward"], b["sections"]["rest"]
        names = {s: {k["name"] for k in b["sections"][s]["kernels"]} for s in ("forward",
                                                                                "rest")}
        assert "aten::argmax" in names["rest"] and "aten::argmax" not in names["forward"]
        assert "aten::mm" in names["rest"]  # the logits (tied embeddings, no bias)
        shares = 0.0
        for s in (fwd, rest):
            assert s["launches"] > 0 and all(k["launches"] > 0 for k in s["kernels"])
            assert abs(s["us"] - sum(k["us"] for k in s["kernels"])) < 1e-6
            shares += sum(k["share"] for k in s["kernels"])
            assert s["span_us"] >= s["us"] - s["idle_us"] - 1e-6
        assert 0.999 < shares <= 1.0 + 1e-9
        h, d = b["host_us"], b["device_us"]
        assert min(h["prepare"], h["forward"], h["wait"]) > 0 and h["rest"] >= 0
        assert abs(sum(d.values()) - h["step"]) < 1e-3 * h["step"]
        assert d["busy"] <= h["step"]
    for r in rows:
        r["model"] = "tiny"
    text = throughput.decode_step_markdown([rows[1]], top=3)
    table = [ln for ln in text.splitlines() if ln.startswith("| forward") or
             ln.startswith("| rest")]
    for section in ("forward", "rest"):
        lines = [ln for ln in table if ln.startswith(f"| {section} |")]
        assert lines[-1].startswith(f"| {section} | **all**")
        assert len([ln for ln in lines if "other kernels" not in ln and "**all**" not in ln]) <= 3
    assert (f"**tiny, batch 3, 40 keys**: {step_kernels.STEPS} steps under torch.profiler"
            in text)
    text = throughput.decode_step_markdown(rows[1:], top=3)
    assert "| tiny | prefill 2x40 | 40 |" in text
    assert f"**tiny, a prompt step of 2 x 40 tokens**: {step_kernels.STEPS} steps" in text


# ---- --tensor-parallel-size: the engine's providers over N GPUs

def test_tensor_parallel_rows_count_every_gpu_in_the_roofline(monkeypatch, tmp_path):
    """The child gets the flag (argv is passed on); the row names the split and its
    roofline is the workload's on two devices' bandwidth and matrix rate."""
    import json

    seen = []

    def child(args, argv, provider, model_dir):
        seen.append(argv)
        return dict(wall_s=10.0, output_tokens=5000, input_tokens=4000, requests=8,
                    peak_gib=1.0)

    monkeypatch.setattr(throughput, "_child", child)
    out = tmp_path / "tp.json"
    argv = ["--models", "qwen2.5-0.5b", "--providers", "engine-flashtile-graphs",
            "--num-requests", "8", "--tensor-parallel-size", "2", "--out", str(out)]
    assert throughput.main(argv) == 0
    assert seen == [argv]
    (row,) = json.loads(out.read_text())["rows"]
    assert row["provider"] == "engine-flashtile-graphs (tp 2)"
    assert row["tensor_parallel_size"] == 2
    cfg = throughput.PRESETS["qwen2.5-0.5b"]
    requests = throughput.workload(8, 100, 1024, cfg["vocab_size"], 0)
    two = throughput.roofline_seconds(cfg, requests, 2 * 4239.0, 2 * 786.0, 256)
    one = throughput.roofline_seconds(cfg, requests, 4239.0, 786.0, 256)
    assert two < one
    assert row["roofline_frac"] == pytest.approx(two / 10.0)


@pytest.mark.parametrize("extra", [["--providers", "hf-generate", "engine-sdpa"],
                                   ["--decode-step"], ["--tensor-parallel-size", "0"]])
def test_tensor_parallel_size_is_refused_where_it_does_not_apply(extra, capsys):
    argv = ["--tensor-parallel-size", "2"] + extra
    with pytest.raises(SystemExit):
        throughput.main(argv)
    err = capsys.readouterr().err
    if extra[0] == "--tensor-parallel-size":
        assert "--tensor-parallel-size: expected an integer >= 1, got 0" in err
    else:
        assert "--tensor-parallel-size 2: the engine's providers only" in err


def test_roofline_counts_an_fp8_pool_in_fp8_bytes():
    """engine-flashtile-fp8kv's roofline: the weights as before, the KV cache's time in
    proportion to its element size (FP8: half the bf16 pool's)."""
    from flashtile.bench.throughput import PRESETS, roofline_seconds, workload

    cfg = PRESETS["qwen2.5-0.5b"]
    requests = workload(32, 100, 300, cfg["vocab_size"])
    r1, r2, r4 = (roofline_seconds(cfg, requests, 4000, 800, 16, kv_dtype_bytes=n)
                  for n in (1, 2, 4))
    assert r1 < r2 == roofline_seconds(cfg, requests, 4000, 800, 16)
    assert abs((r4 - r2) - 2 * (r2 - r1)) < 1e-9 * r4


def test_rows_show_the_kv_pool():
    """The table's KV pool column: the engine's pool in tokens, "-" for transformers."""
    from flashtile.bench.throughput import _row, markdown

    res = dict(output_tokens=1000, input_tokens=500, wall_s=2.0, peak_gib=3.0, requests=4)
    engine = _row("m", "engine-flashtile-fp8kv", dict(res, kv_pool_tokens=123456,
                                                     preemptions=0), 1.0)
    hf = _row("m", "hf-generate", res, 0)
    text = markdown([engine, hf])
    assert "| 3.0 | 123,456 | - | 50% |" in text and "| 3.0 | - | - | - |" in text
