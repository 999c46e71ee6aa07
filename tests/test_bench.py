"""``flashtile bench`` / ``info`` / ``tune`` on CPU, on tiny shapes.

The speed runs use the tiled PyTorch backend (FLASHTILE_BACKEND=torch) so they stay
fast under TRITON_INTERPRET=1; the cache folder is a tmp_path in every test.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import signal

import pytest
import torch

import flashtile
from flashtile import _cache, cli
from flashtile.bench import accuracy, machine, registry, report, run, tune
from flashtile.bench import commands
from flashtile.bench.commands import seqlen
from flashtile.bench.registry import Provider, Sweep
from flashtile.ops import configs
from flashtile.ops.configs import TileConfig
from tests.utils import assert_close_rule, reference_pair

CPU = torch.device("cpu")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
TINY = Sweep(("flashtile", "sdpa-math", "naive"), head_dims=(16,), seqlens=(32, 48),
             dtype=torch.float32, tokens=96, head_budget=None, nheads=2)


@pytest.fixture(autouse=True)
def _isolated(monkeypatch, tmp_path):
    monkeypatch.setenv("FLASHTILE_BACKEND", "torch")
    monkeypatch.setenv("FLASHTILE_CACHE_DIR", str(tmp_path / "cache"))
    configs.reload_tuned()
    yield
    configs.reload_tuned()  # the next test module reads the real cache folder again


def _raiser(exc):
    def build(cell, device):
        def attn(q, k, v):
            raise exc
        return attn
    return build


def test_attn_flops_is_the_one_count():
    full = registry.attn_flops(2, 3, 128, 128, 64, causal=False, mode="fwd")
    assert full == 4 * 2 * 3 * 128 * 128 * 64
    assert registry.attn_flops(2, 3, 128, 128, 64, True, "fwd") == full / 2
    assert registry.attn_flops(2, 3, 128, 128, 64, True, "fwd_bwd") == full / 2 * 3.5
    with pytest.raises(ValueError, match="mode must be one of"):
        registry.attn_flops(1, 1, 1, 1, 1, False, "bwd")


def test_sweep_cells_and_shapes():
    cells = TINY.cells()
    assert len(cells) == 3 * 1 * 2 * 2 * 2  # providers x dims x causal x modes x seqlens
    assert {(c.batch, c.seqlen) for c in cells} == {(3, 32), (2, 48)}  # 96 tokens
    gpu = registry.GPU_SWEEP
    assert gpu.heads(128) == 16 and gpu.heads(64) == 32  # 2048 / head_dim
    assert {c.batch for c in gpu.cells() if c.seqlen == 65536} == {1}
    with pytest.raises(ValueError, match="unknown provider"):
        dataclasses.replace(TINY, providers=("nope",)).cells()


def test_quick_sweep_json_markdown_plots(tmp_path):
    results = run.run_sweep(TINY, CPU, repeats=1, progress=False)
    assert all(r.status == "ok" for r in results), [r.reason for r in results]
    for r in results:
        assert r.ms > 0 and r.ms_p20 <= r.ms <= r.ms_p80
        assert r.tflops == pytest.approx(r.cell.flops() / r.ms / 1e9)
        assert r.peak_mib is None  # CPU: not measured

    info = machine.machine_info(CPU, "flashtile bench --test")
    paths = report.write_outputs(results, info, TINY.settings(), str(tmp_path / "out"))
    with open(paths["json"]) as f:
        data = json.load(f)
    assert data["schema"] == report.SCHEMA and data["memory_measured"] is False
    for key in ("device", "torch", "triton", "flashtile", "cuda", "cudnn", "date",
                "command", "backend"):
        assert key in data["machine"], key
    assert data["machine"]["command"] == "flashtile bench --test"
    assert data["machine"]["backend"] == "torch"
    assert data["settings"]["seqlens"] == [32, 48]
    assert data["settings"]["dtype"] == "float32"
    assert len(data["results"]) == len(results)
    row = data["results"][0]
    types = dict(provider=str, head_dim=int, causal=bool, mode=str, seqlen=int, batch=int,
                 nheads=int, dtype=str, status=str, ms=float, ms_p20=float, ms_p80=float,
                 tflops=float)
    for key, typ in types.items():
        assert isinstance(row[key], typ), (key, row[key])
    assert row["peak_mib"] is None and row["reason"] is None
    assert len(data["summary"]) == 8  # rows: 2 causal x 2 modes x 2 seqlens
    for s in data["summary"]:
        assert s["best_peer"] in ("sdpa-math", "naive")
        assert s["ratio"] == pytest.approx(s["flashtile_tflops"] / s["best_peer_tflops"])

    text = open(paths["markdown"]).read()
    assert "| head_dim | causal | mode | seqlen | flashtile | sdpa-math | naive |" in text
    assert "flashtile / best peer" in text and "Peak memory: not measured" in text
    assert len(paths["plots"]) == 4  # tflops per (head_dim, causal, mode); no memory
    for p in paths["plots"]:
        with open(p, "rb") as f:
            assert f.read(8) == PNG_MAGIC
        assert os.path.getsize(p) > 1000


def test_oom_and_unsupported_providers_do_not_stop_the_sweep(monkeypatch):
    monkeypatch.setitem(registry.PROVIDERS, "fake-oom", Provider(
        "fake-oom", "bhsd", _raiser(torch.OutOfMemoryError("CUDA out of memory"))))
    monkeypatch.setitem(registry.PROVIDERS, "fake-na", Provider(
        "fake-na", "bshd", _raiser(NotImplementedError("no head_dim 16 here"))))
    sweep = dataclasses.replace(TINY, providers=("fake-oom", "flashtile", "fake-na"),
                                seqlens=(32,), modes=("fwd",))
    results = run.run_sweep(sweep, CPU, repeats=1, progress=False)
    status = {(r.cell.provider, r.cell.causal): r for r in results}
    for causal in (False, True):  # the OOM of the first cell did not end the sweep
        assert status["fake-oom", causal].status == "OOM"
        assert status["flashtile", causal].status == "ok"
        na = status["fake-na", causal]
        assert na.status == "n/a"
        assert na.reason == "NotImplementedError: no head_dim 16 here"
    text = report.markdown(results, machine.machine_info(CPU), sweep.settings())
    assert "| 16 | False | fwd | 32 | OOM |" in text
    assert text.count("| n/a |") >= 2  # fake-na's column; best peer is n/a too
    assert "- fake-oom: OOM (torch.OutOfMemoryError) in 2 cell(s)" in text
    assert all(s["ratio"] is None for s in report.summary(results))


def test_skip_reasons():
    cell = registry.Cell("sdpa-efficient", 64, False, "fwd", 128, 1, 1, torch.float32)
    assert run.run_cell(cell, CPU).reason == "runs on cuda only"
    long = dataclasses.replace(cell, provider="naive", seqlen=4096)
    assert run.run_cell(long, CPU).reason.startswith("seqlen > 2048 on cpu")
    # CPU peers run as they are (issue 13): SDPA's flash backend is PyTorch's fused CPU
    # kernel there, and Flex compiles for CPU (forward only).
    for provider in ("sdpa-flash", "sdpa-math", "flex"):
        assert registry.PROVIDERS[provider].skip_reason(
            dataclasses.replace(cell, provider=provider), CPU) is None
    assert run.run_cell(dataclasses.replace(cell, provider="sdpa-flash"), CPU).status == "ok"


def _cuda_fwd_bwd_provider(cell):
    """cell's provider, after checking that it runs on CUDA only, forward + backward
    only, outside the default GPU sweep."""
    provider = registry.PROVIDERS[cell.provider]
    assert provider.skip_reason(cell, CPU) == "runs on cuda only"
    assert provider.skip_reason(dataclasses.replace(cell, mode="fwd"),
                                torch.device("cuda")) == "fwd_bwd only"
    assert cell.provider not in registry.GPU_SWEEP.providers
    return provider


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="the Triton kernels on CPU need TRITON_INTERPRET=1")
@pytest.mark.parametrize("fault", ["none", "dq", "nan"])
def test_flashtile_fusedbwd_is_validated_before_timing(fault, monkeypatch):
    """The fused-backward provider runs on CUDA, forward + backward only, outside the
    default sweeps; its build compares the fused backward's gradients with the split
    one's on the cell's inputs before anything is timed (a fault injected here), and
    the gradients of what it times meet the accuracy rule."""
    from flashtile.ops import bwd

    cell = registry.Cell("flashtile-fusedbwd", 32, True, "fwd_bwd", 45, 1, 2,
                         torch.float16)
    provider = _cuda_fwd_bwd_provider(cell)
    real = bwd.attn_bwd

    def faulty(*args, fused, **kwargs):
        dq, dk, dv = real(*args, fused=fused, **kwargs)
        if fused and fault == "dq":
            dq = dq + 0.05
        elif fused and fault == "nan":
            dv[0, 3, 1, 0] = float("nan")
        return dq, dk, dv

    monkeypatch.setattr(bwd, "attn_bwd", faulty)
    if fault != "none":
        with pytest.raises(RuntimeError, match="does not match the split backward"):
            provider.build(cell, CPU)
        return
    attn = provider.build(cell, CPU)
    q, k, v, dout = run.make_inputs(cell, "bshd", CPU)[0]
    grads = torch.autograd.grad(attn(q, k, v), (q, k, v), dout)
    (_, _, g64), (_, _, g_pt) = reference_pair(q, k, v, dout, causal=True)
    for name, ours, r64, rpt in zip(("dq", "dk", "dv"), grads, g64, g_pt):
        assert_close_rule(name, ours, r64, rpt)


def _gluon_provider_validation(name, cell, oracle, fault, monkeypatch):
    """Build provider ``name`` with the portable kernel replaced by ``oracle`` and the
    Gluon one by the oracle with ``fault`` ("none", "out", "lse", "nan"): a faulty kernel
    must make the build raise before anything is timed; a correct one gives the attention
    (its output on the cell's inputs is returned)."""
    from flashtile.ops import fwd, fwd_hopper

    def perturbed(q, k, v, **kw):
        out, lse = oracle(q, k, v, **kw)
        if fault == "out":
            out = out + 0.1
        elif fault == "lse":
            lse = lse + 0.01
        elif fault == "nan":
            out[0, 5, 1, 3] = float("nan")
        return out, lse

    monkeypatch.setattr(fwd, "attn_fwd", oracle)
    monkeypatch.setattr(fwd_hopper, "attn_fwd", perturbed)
    provider = registry.PROVIDERS[name]
    if fault != "none":
        with pytest.raises(RuntimeError, match="does not match the portable kernel's"):
            provider.build(cell, CPU)
        return None
    attn = provider.build(cell, CPU)
    inputs = run.make_inputs(cell, "bshd", CPU)[0]
    q, k, v, _ = provider.prepare(*inputs) if provider.prepare else inputs
    return attn(q, k, v)


@pytest.mark.parametrize("fault", ["none", "out", "lse", "nan"])
def test_flashtile_hopper_is_validated_before_timing(fault, monkeypatch):
    """The Gluon provider runs on CUDA, forward only, and its build compares the kernel's
    out and lse with the portable kernel's on the cell's inputs before anything is timed
    (both kernels replaced by the float64 oracle here, the Gluon one perturbed)."""
    pytest.importorskip("flashtile.ops.fwd_hopper")  # Gluon: triton >= 3.6
    from flashtile.reference import attention_naive

    cell = registry.Cell("flashtile-hopper", 64, True, "fwd", 96, 1, 2, torch.bfloat16)
    hopper = registry.PROVIDERS["flashtile-hopper"]
    assert hopper.skip_reason(cell, CPU) == "runs on cuda only"
    bwd = dataclasses.replace(cell, mode="fwd_bwd")
    assert hopper.skip_reason(bwd, torch.device("cuda")) == "fwd only"
    assert "flashtile-hopper" not in registry.GPU_SWEEP.providers

    def oracle(q, k, v, **kw):
        out, lse = attention_naive(q, k, v, causal=True, softmax_scale=kw["softmax_scale"])
        return out.to(q.dtype), lse.float()

    out = _gluon_provider_validation("flashtile-hopper", cell, oracle, fault, monkeypatch)
    assert fault != "none" or out.shape == (1, 96, 2, 64)


@pytest.mark.parametrize("fault", ["none", "out", "lse", "nan"])
def test_flashtile_hopper_fp8_is_validated_before_timing(fault, monkeypatch):
    """The Gluon FP8 provider quantises as flashtile-fp8 does, and its build compares the
    kernel's out and lse with the portable FP8 kernel's, descales and bf16 out passed to
    both (both replaced by the float64 oracle of the dequantised inputs here)."""
    pytest.importorskip("flashtile.ops.fwd_hopper")  # Gluon: triton >= 3.6
    from flashtile.fp8 import dequantize
    from flashtile.reference import attention_naive

    cell = registry.Cell("flashtile-hopper-fp8", 64, False, "fwd", 96, 1, 2,
                         torch.float32)
    provider = registry.PROVIDERS["flashtile-hopper-fp8"]
    assert provider.skip_reason(cell, CPU) == "runs on cuda only"
    assert provider.modes == ("fwd",) and "flashtile-hopper-fp8" not in registry.ALL

    def oracle(q, k, v, *, q_descale, k_descale, v_descale, out_dtype, **kw):
        assert q.dtype == torch.float8_e4m3fn and out_dtype == torch.bfloat16
        deq = [dequantize(x, d).double() for x, d in ((q, q_descale), (k, k_descale),
                                                      (v, v_descale))]
        out, lse = attention_naive(*deq, softmax_scale=kw["softmax_scale"])
        return out.to(out_dtype), lse.float()

    out = _gluon_provider_validation("flashtile-hopper-fp8", cell, oracle, fault,
                                     monkeypatch)
    assert fault != "none" or (out.shape == (1, 96, 2, 64) and out.dtype == torch.bfloat16)


@pytest.mark.parametrize("fault", ["none", "dk", "nan", "declined"])
def test_flashtile_hopper_bwd_is_validated_before_timing(fault, monkeypatch):
    """The Gluon backward's provider runs on CUDA, forward + backward only, outside the
    default sweeps; its build compares the kernel's gradients with the split backward's
    on the cell's inputs before anything is timed, and a call the kernel declines fails
    the build instead of timing the portable backward under its name (the forward and
    both backwards are the torch path's here, the Gluon one perturbed)."""
    bwd_hopper = pytest.importorskip("flashtile.ops.bwd_hopper")  # Gluon: triton >= 3.6
    from flashtile import _torch_backend, custom_ops
    from flashtile.ops import bwd

    cell = registry.Cell("flashtile-hopper-bwd", 64, True, "fwd_bwd", 70, 1, 2,
                         torch.bfloat16)
    provider = _cuda_fwd_bwd_provider(cell)

    def split(dout, q, k, v, out, lse, dlse, *, fused, **kw):
        kw.pop("allow_tf32")
        return _torch_backend.attention_bwd(dout, q, k, v, out, lse, dlse, **kw)

    def gluon(dout, q, k, v, out, lse, dlse, softmax_scale, diag_offset, causal):
        dq, dk, dv = split(dout, q, k, v, out, lse, dlse, fused=True, attn_mask=None,
                           alibi_slopes=None, softmax_scale=softmax_scale,
                           diag_offset=diag_offset, window_left=-1,
                           window_right=0 if causal else -1, softcap=0.0, allow_tf32=False)
        if fault == "dk":
            dk = dk + 0.05
        elif fault == "nan":
            dv[0, 3, 1, 0] = float("nan")
        return dq, dk, dv

    monkeypatch.setattr(custom_ops, "select_backend", lambda *a, **kw: "torch")
    monkeypatch.setattr(bwd, "attn_bwd", split)
    monkeypatch.setattr(bwd_hopper, "backward", gluon)
    monkeypatch.setattr(bwd_hopper, "unsupported",
                        lambda *a, **kw: "a reason" if fault == "declined" else None)
    if fault == "none":
        attn = provider.build(cell, CPU)
        q, k, v, dout = run.make_inputs(cell, "bshd", CPU)[0]
        assert attn(q, k, v).shape == q.shape
    else:
        match = ("cannot run this call: a reason" if fault == "declined"
                 else "does not match the split backward")
        with pytest.raises((RuntimeError, ValueError), match=match):
            provider.build(cell, CPU)


def test_memory_plot_on_a_log_scale(tmp_path):
    """GPU runs measure memory; the plot code is checked here with given values."""
    results = []
    for provider, per_token in (("flashtile", 0.01), ("naive", 1.0)):
        for s in (512, 1024, 2048):
            cell = registry.Cell(provider, 64, True, "fwd", s, 1, 4, torch.bfloat16)
            results.append(run.Result(cell, "ok", ms=1.0, ms_p20=0.9, ms_p80=1.1,
                                      tflops=100.0, peak_mib=per_token * s * s / 512))
    paths = report.plot(results, str(tmp_path))
    memory = [p for p in paths if os.path.basename(p).startswith("memory-")]
    assert [os.path.basename(p) for p in memory] == ["memory-d64-causal-fwd.png"]
    assert open(memory[0], "rb").read(8) == PNG_MAGIC
    assert "Peak memory above the inputs" in report.markdown(
        results, {}, dict(dtype="bfloat16", tokens=16384, head_budget=2048))


def test_bench_tokens_sets_the_batch(tmp_path):
    """--tokens: tokens per batch, batch = tokens // seqlen (at least 1), recorded in
    the run's settings."""
    out = tmp_path / "out"
    assert cli.main(["bench", "--quick", "--device", "cpu", "--seqlens", "32", "48",
                     "--tokens", "64", "--repeats", "1", "--causal", "true", "--modes",
                     "fwd", "--no-progress", "--out", str(out)]) == 0
    data = json.loads((out / "results.json").read_text())
    assert data["settings"]["tokens"] == 64
    assert {(r["seqlen"], r["batch"]) for r in data["results"]} == {(32, 2), (48, 1)}


def test_bench_command_quick(tmp_path, capsys):
    out = tmp_path / "out"
    rc = cli.main(["bench", "--quick", "--device", "cpu", "--seqlens", "32", "--repeats",
                   "1", "--causal", "true", "--no-progress", "--out", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "| 32 | True | fwd | 32 |" in text and "| 32 | True | fwd_bwd | 32 |" in text
    data = json.loads((out / "results.json").read_text())
    assert data["machine"]["command"].startswith("flashtile bench --quick")
    assert {r["status"] for r in data["results"]} == {"ok"}
    assert sorted(p.name for p in out.glob("*.png")) == [
        "tflops-d32-causal-fwd.png", "tflops-d32-causal-fwd_bwd.png"]


def test_bench_append_builds_one_table_from_several_runs(tmp_path, capsys):
    base = ["bench", "--quick", "--device", "cpu", "--repeats", "1", "--causal", "false",
            "--modes", "fwd", "--no-progress", "--out", str(tmp_path)]
    assert cli.main([*base, "--seqlens", "32", "48"]) == 0
    assert cli.main([*base, "--seqlens", "48", "64", "--append"]) == 0
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["settings"]["seqlens"] == [32, 48, 64]
    assert [r["seqlen"] for r in data["results"]] == [32] * 3 + [48] * 3 + [64] * 3
    assert len(data["machine"]["commands"]) == 2
    assert "--append" in data["machine"]["commands"][1]
    capsys.readouterr()
    assert cli.main([*base, "--seqlens", "32", "--append", "--dtype", "bf16"]) == 2
    assert "the folder holds dtype 'float32'" in capsys.readouterr().err


def test_bench_resume_after_a_run_cut_short(tmp_path, capsys, monkeypatch):
    """A sweep killed by a time limit leaves the cells it measured in results.json;
    --resume measures only the rest."""
    from flashtile.bench import run

    base = ["bench", "--quick", "--device", "cpu", "--repeats", "1", "--causal", "false",
            "--modes", "fwd", "--no-progress", "--out", str(tmp_path),
            "--seqlens", "32", "48"]
    real_run_cell, calls = run.run_cell, []

    def dies_on_fifth(cell, device, repeats=5, n_sets=None):
        calls.append(cell)
        if len(calls) == 5:  # what `timeout` does mid-sweep
            os.kill(os.getpid(), signal.SIGTERM)
        return real_run_cell(cell, device, repeats, n_sets)

    monkeypatch.setattr(run, "run_cell", dies_on_fifth)
    assert cli.main(base) == 130
    assert "stopped after 4 of 6 cells" in capsys.readouterr().err
    data = json.loads((tmp_path / "results.json").read_text())
    assert len(data["results"]) == 4
    assert list((tmp_path).glob("*.png"))
    calls.clear()
    monkeypatch.setattr(run, "run_cell", lambda *a, **k: calls.append(a[0]) or
                        real_run_cell(*a, **k))
    assert cli.main([*base, "--resume"]) == 0
    assert len(calls) == 2 and all(c.seqlen == 48 for c in calls)
    data = json.loads((tmp_path / "results.json").read_text())
    assert len(data["results"]) == 6 and {r["status"] for r in data["results"]} == {"ok"}
    assert list((tmp_path).glob("*.png"))


def test_bench_resume_retries_failed_cells_and_a_stop_before_any_cell_writes_nothing(
        tmp_path, capsys, monkeypatch):
    from flashtile.bench import run

    base = ["bench", "--quick", "--device", "cpu", "--repeats", "1", "--causal", "false",
            "--modes", "fwd", "--no-progress", "--out", str(tmp_path), "--seqlens", "32"]
    real_run_cell = run.run_cell

    def naive_fails(cell, device, repeats=5, n_sets=None):
        if cell.provider == "naive":
            return run.Result(cell, "n/a", "RuntimeError: simulated")
        return real_run_cell(cell, device, repeats, n_sets)

    monkeypatch.setattr(run, "run_cell", naive_fails)
    assert cli.main(base) == 0
    before = (tmp_path / "results.json").read_text()
    calls = []
    monkeypatch.setattr(run, "run_cell", lambda *a, **k: calls.append(a[0]) or
                        real_run_cell(*a, **k))
    assert cli.main([*base, "--resume"]) == 0
    assert [c.provider for c in calls] == ["naive"]
    data = json.loads((tmp_path / "results.json").read_text())
    assert {r["status"] for r in data["results"]} == {"ok"} and len(data["results"]) == 3

    def stop(*a, **k):
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(run, "run_cell", stop)
    after_resume = (tmp_path / "results.json").read_text()
    # A fresh run over the folder, stopped before its first cell: --overwrite clears
    # the old run only when it has something to write.
    assert cli.main([*base, "--overwrite"]) == 130
    assert (tmp_path / "results.json").read_text() == after_resume != before


QUICK = ["bench", "--quick", "--device", "cpu", "--repeats", "1", "--modes", "fwd",
         "--providers", "flashtile", "--seqlens", "32", "--no-progress"]


def _results(folder):
    return json.loads((folder / "results.json").read_text())


def test_bench_twice_the_same_day_writes_a_new_folder(tmp_path, monkeypatch, capsys):
    """Regression: a second run overwrote bench-results/<date>-<device>/ and left the
    first run's plots beside its tables. Now each run gets its own folder."""
    monkeypatch.chdir(tmp_path)
    base = tmp_path / commands.default_out(CPU)
    assert cli.main([*QUICK, "--causal", "true"]) == 0
    first = _results(base)
    assert cli.main([*QUICK, "--causal", "false"]) == 0
    assert _results(base) == first
    second = tmp_path / f"{base}-2"
    assert [r["causal"] for r in _results(second)["results"]] == [False]
    assert sorted(p.name for p in second.glob("*.png")) == ["tflops-d32-full-fwd.png"]
    assert f"wrote {os.path.relpath(second, tmp_path)}/results.json" in \
        capsys.readouterr().out
    # --append and --resume go on in the newest of the day's folders.
    assert cli.main([*QUICK, "--causal", "false", "--seqlens", "48", "--append"]) == 0
    assert {r["seqlen"] for r in _results(second)["results"]} == {32, 48}
    assert not os.path.exists(f"{base}-3") and _results(base) == first


def test_bench_overwrite_clears_the_old_run_first(tmp_path, capsys):
    out = tmp_path / "out"
    assert cli.main([*QUICK, "--causal", "true", "--out", str(out)]) == 0
    (out / "notes.txt").write_text("mine")
    capsys.readouterr()
    # An explicit --out holding a run is refused, with the ways on.
    assert cli.main([*QUICK, "--causal", "false", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"flashtile bench: error: --out {out} "
                                                   "already holds an earlier run's files")
    assert "--overwrite" in err and "--append" in err
    assert cli.main([*QUICK, "--causal", "false", "--out", str(out), "--overwrite"]) == 0
    assert [r["causal"] for r in _results(out)["results"]] == [False]
    assert sorted(p.name for p in out.iterdir()) == [
        "notes.txt", "results.json", "results.md", "tflops-d32-full-fwd.png"]


def test_accuracy_twice_writes_a_new_folder(tmp_path, monkeypatch):
    monkeypatch.setattr(accuracy, "CPU_SHAPE", (1, 24, 2, 16))
    monkeypatch.chdir(tmp_path)
    base = commands.default_out(CPU)
    assert cli.main(["bench", "--accuracy", "--device", "cpu"]) == 0
    assert cli.main(["bench", "--accuracy", "--device", "cpu"]) == 0
    assert os.path.exists(os.path.join(base, "accuracy.json"))
    assert os.path.exists(os.path.join(f"{base}-2", "accuracy.json"))


def test_seqlen_argument():
    assert seqlen("4k") == 4096 and seqlen("64K") == 65536 and seqlen("512") == 512
    for bad in ("0", "1.5k", "abc"):
        with pytest.raises(argparse.ArgumentTypeError, match=f"got '{bad}'"):
            seqlen(bad)


def test_accuracy_table(monkeypatch):
    """Every (precision, inputs) row; n/a with a reason where a path cannot run on the
    CPU (TF32, SDPA's efficient backend); the fp32-ieee row runs flashtile with
    FLASHTILE_FP32_PRECISION=ieee and restores the variable after it."""
    from flashtile.ops import configs

    monkeypatch.delenv("FLASHTILE_FP32_PRECISION", raising=False)
    modes = []
    real = accuracy._flashtile

    def recording(q, k, v, causal):
        if q.dtype == torch.float32:
            modes.append(configs.fp32_products())
        return real(q, k, v, causal)

    monkeypatch.setattr(accuracy, "_flashtile", recording)
    rows = accuracy.accuracy_table(CPU, shape=(1, 40, 2, 16), repeats=1)
    assert [(r.precision, r.inputs) for r in rows] == [
        (p, kind) for kind in accuracy.INPUT_KINDS for p, _, _ in accuracy.PRECISIONS]
    # fp32 (tf32x3, the default) then fp32-ieee per input kind (TF32 is skipped on CPU); each row's paths
    # call flashtile twice (the error, then the timing with repeats=1 and its warm-up).
    assert "tf32x3" in modes and "ieee" in modes
    assert modes[0] == "tf32x3" and modes[-1] == "ieee"
    assert "FLASHTILE_FP32_PRECISION" not in os.environ
    for r in rows:
        if r.precision == "tf32":  # CPU: n/a with a reason, not a crash
            assert r.flashtile.max_abs is None and "no TF32" in r.flashtile.reason
            continue
        assert r.sdpa_efficient.max_abs is None and "CUDA only" in r.sdpa_efficient.reason
        for path in (r.flashtile, r.sdpa_math):
            assert path.reason is None and path.ms > 0
            assert 0 <= path.max_abs < 0.1 and 0 <= path.rel < 0.05
        if r.precision.startswith("fp32"):  # fp32 accuracy: near float64
            assert r.flashtile.rel < 1e-5
    text = accuracy.markdown(rows, (1, 40, 2, 16), "CPU")
    assert "| fp32 | outliers |" in text and "no TF32 on CPU" in text
    assert "| fp32-ieee | normal |" in text and "sdpa-efficient ms" in text


def test_accuracy_command(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(accuracy, "CPU_SHAPE", (1, 24, 2, 16))
    assert cli.main(["bench", "--accuracy", "--device", "cpu", "--out",
                     str(tmp_path)]) == 0
    assert "| bf16 | normal |" in capsys.readouterr().out
    data = json.loads((tmp_path / "accuracy.json").read_text())
    assert data["shape"] == [1, 24, 2, 16] and len(data["rows"]) == 14  # 7 precisions


def test_info_prints_versions_and_caches_ceilings(monkeypatch, capsys):
    assert cli.main(["info", "--device", "cpu"]) == 0
    text = capsys.readouterr().out
    for needle in (f"flashtile {flashtile.__version__}", torch.__version__, "triton",
                   "cuDNN", "backend   torch", "FLOP/s", "B/s", "measured now"):
        assert needle in text, needle
    cache = _cache.cache_dir() / machine.CEILINGS_FILE
    entry = json.loads(cache.read_text())[_cache.device_name(CPU)]
    assert entry["matmul_flops_per_s"] > 0 and entry["copy_bytes_per_s"] > 0

    def no_measuring(device):
        raise AssertionError("the second info must read the cache")

    monkeypatch.setattr(machine, "measure_ceilings", no_measuring)
    assert cli.main(["info", "--device", "cpu"]) == 0
    assert "(cached " in capsys.readouterr().out
    with pytest.raises(AssertionError, match="read the cache"):
        cli.main(["info", "--device", "cpu", "--refresh"])


def test_tuned_cache_round_trip_and_pick():
    q = torch.zeros(1, 1000, 2, 64)
    static = configs.fwd_config(q, 64, True)
    tuned = TileConfig(64, 32, 4, 2)
    key = configs.tuned_key(_cache.device_name(CPU), torch.float32, 64, True, 1000, "fwd")
    assert key == f"{_cache.device_name(CPU)}|float32|d64|causal|<=2k|fwd"
    path = configs.save_tuned({key: dict(block_m=64, block_n=32, num_warps=4,
                                         num_stages=2, tflops=1.0)})
    assert os.path.exists(path)
    assert configs.fwd_config(q, 64, True, seqlen=1000) == tuned
    assert configs.fwd_config(q, 60, True, seqlen=2048) == tuned  # head_dim pads to 64
    assert configs.fwd_config(q, 64, True) == static  # caller passes no seqlen
    assert configs.fwd_config(q, 64, True, seqlen=4096) == static  # other class
    assert configs.fwd_config(q, 64, False, seqlen=1000) == static  # not causal
    assert configs.bwd_dq_config(q, 64, True, seqlen=1000) == configs.bwd_dq_config(q, 64)
    configs.set_override("fwd", TileConfig(16, 16))  # the override still wins
    try:
        assert configs.fwd_config(q, 64, True, seqlen=1000) == TileConfig(16, 16)
    finally:
        configs.set_override("fwd", None)
    configs.reload_tuned()  # read again from disk: the same
    assert configs.fwd_config(q, 64, True, seqlen=1000) == tuned
    configs.clear_tuned()
    assert not os.path.exists(path)
    assert configs.fwd_config(q, 64, True, seqlen=1000) == static


def test_tuned_cache_ignores_a_malformed_entry(caplog):
    good = configs.tuned_key(_cache.device_name(CPU), torch.float32, 32, False, 64, "fwd")
    _cache.write_json(configs.TUNED_FILE, {"entries": {
        good: dict(block_m=32, block_n=32, num_warps=4, num_stages=1),
        "bad": dict(block_m="x")}})
    configs.reload_tuned()
    with caplog.at_level(logging.WARNING, logger="flashtile"):
        assert configs.fwd_config(torch.zeros(1), 32, seqlen=64) == TileConfig(32, 32, 4, 1)
    assert "malformed tuned entry 'bad'" in caplog.text


def test_candidates_are_pruned_and_contain_the_defaults():
    for kind, table in (("fwd", configs._FWD_16BIT), ("bwd_dkdv", configs._BWD_DKDV_16BIT),
                        ("bwd_dq", configs._BWD_DQ_16BIT)):
        for d in (64, 128):
            assert table[d] in configs.candidates(kind, d, 2), (kind, d)
    big = TileConfig(128, 128, 8, 4)  # 288 KiB at d128 bf16: over sm90's 227 KiB
    assert big in configs.CANDIDATES["fwd"] and big not in configs.candidates("fwd", 128, 2)
    assert big in configs.candidates("fwd", 128, 2, smem_limit=None)
    with pytest.raises(ValueError, match="kind must be one of"):
        configs.candidates("bwd", 64, 2)


# None of them is a static default, which the other kernels keep during a trial.
BAD, GOOD, NAN = TileConfig(16, 16, 4, 1), TileConfig(32, 32, 4, 1), TileConfig(64, 16)


def _sabotage(monkeypatch):
    """flash_attn_func gives a wrong answer under the BAD forward tile and NaN under the
    NAN dQ tile: the torch backend ignores tiles, so the fault is simulated here."""
    real = flashtile.flash_attn_func

    def faulty(q, k, v, **kwargs):
        out = real(q, k, v, **kwargs)
        if configs._override.get("fwd") == BAD:
            return out * 1.01
        if configs._override.get("bwd_dq") == NAN:
            return out + 0 * q.sum() * float("nan")  # NaN in out and in every gradient
        return out

    monkeypatch.setattr(flashtile, "flash_attn_func", faulty)


def test_tune_rejects_wrong_and_nan_configs(monkeypatch):
    _sabotage(monkeypatch)
    trials, entries = tune.tune(
        CPU, torch.float32, head_dims=(16,), causals=(True,), seqlen=33,
        kinds=("fwd", "bwd_dq"), candidates={"fwd": [BAD, GOOD], "bwd_dq": [NAN, GOOD]},
        timing_shape=(1, 1), repeats=1)
    by = {(t.kind, t.config): t for t in trials}
    assert by["fwd", BAD].status == "rejected" and "out error" in by["fwd", BAD].reason
    assert by["bwd_dq", NAN].status == "rejected" and "NaN" in by["bwd_dq", NAN].reason
    assert by["fwd", GOOD].best and by["bwd_dq", GOOD].best
    assert configs._override == {}  # every trial cleared its override
    name = _cache.device_name(CPU)
    assert set(entries) == {f"{name}|float32|d16|causal|<=2k|fwd",
                            f"{name}|float32|d16|causal|<=2k|bwd_dq"}
    for entry in entries.values():  # only the good tile is cached, never a rejected one
        assert (entry["block_m"], entry["block_n"]) == (32, 32)
    assert "rejected (out error" in tune.format_trial(by["fwd", BAD])


def test_tune_caches_nothing_when_every_config_is_rejected(monkeypatch):
    _sabotage(monkeypatch)
    trials, entries = tune.tune(CPU, torch.float32, (16,), (False,), 20, ("fwd",),
                                candidates={"fwd": [BAD]}, timing_shape=(1, 1), repeats=1)
    assert [t.status for t in trials] == ["rejected"] and entries == {}


def test_tune_rejects_a_tile_that_stepped_down(monkeypatch):
    """configs.launch logs and shrinks a tile that does not fit: it did not run as
    listed, so its time is not that tile's."""
    real = flashtile.flash_attn_func

    def shrinking(q, k, v, **kwargs):
        if configs._override.get("fwd") == BAD:
            logging.getLogger("flashtile").info(
                "flashtile: %s tiles %s do not fit (%s); trying %s", "forward", BAD,
                "out of shared memory", GOOD)
        return real(q, k, v, **kwargs)

    monkeypatch.setattr(flashtile, "flash_attn_func", shrinking)
    trials, _ = tune.tune(CPU, torch.float32, (16,), (False,), 20, ("fwd",),
                          candidates={"fwd": [BAD, GOOD]}, timing_shape=(1, 1), repeats=1)
    assert trials[0].status == "rejected" and "did not fit" in trials[0].reason
    assert trials[1].status == "ok" and trials[1].best


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="the Triton kernels on CPU need TRITON_INTERPRET=1")
def test_tune_through_the_interpreter(monkeypatch):
    """Every kind's trial runs its kernel: the fused kind's with the fused backward
    (FLASHTILE_BWD=fused for its trial only), the others' with the split one."""
    from flashtile import custom_ops

    monkeypatch.setenv("FLASHTILE_BACKEND", "triton")
    FUSED = TileConfig(16, 32, 8)
    paths, real = [], custom_ops.triton_bwd

    def recording(*args, fused, **kwargs):
        paths.append((configs._override.get("bwd_fused") == FUSED, fused))
        return real(*args, fused=fused, **kwargs)

    monkeypatch.setattr(custom_ops, "triton_bwd", recording)
    cands = {"fwd": [TileConfig(16, 16), TileConfig(32, 16)],
             "bwd_dkdv": [TileConfig(16, 32)], "bwd_dq": [TileConfig(32, 16)],
             "bwd_fused": [FUSED]}
    trials, entries = tune.tune(CPU, torch.float32, (16,), (True,), 37,
                                candidates=cands, timing_shape=(1, 1), repeats=1)
    assert [t.status for t in trials] == ["ok"] * 5, [t.reason for t in trials]
    assert len(entries) == 4
    assert (True, True) in paths and all(trial == fused for trial, fused in paths)


def test_tune_command(monkeypatch, capsys):
    assert cli.main(["tune", "--device", "cpu"]) == 2  # the torch backend: nothing to time
    assert "TRITON_INTERPRET=1" in capsys.readouterr().err
    key = configs.tuned_key(_cache.device_name(CPU), torch.float32, 64, False, 64, "fwd")
    path = configs.save_tuned({key: dict(block_m=32, block_n=32, num_warps=4,
                                         num_stages=1)})
    assert cli.main(["tune", "--clear"]) == 0
    assert f"removed {path}" in capsys.readouterr().out and not os.path.exists(path)


def test_decode_bench_needs_cuda(capsys):
    from flashtile.cli import main

    assert main(["bench", "--decode", "--device", "cpu"]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err


def test_decode_markdown_table():
    from flashtile.bench.decode import decode_markdown

    rows = [dict(batch=1, seqlen_k=8192, cache_gb=0.03, copies=6,
                 flashtile=dict(us=12.0, gbps=2800.0),
                 **{"flashtile-paged64": dict(us=13.2, gbps=2545.0),
                    "sdpa-flash": dict(us=20.0, gbps=1600.0),
                    "sdpa-cudnn": dict(error="RuntimeError: no")})]
    text = decode_markdown(rows, copy_gbps=4000.0)
    assert ("| 1 | 8192 | 0.03 | 6 | 12.0 (2800) | 13.2 (2545) | 20.0 (1600) | n/a | 70% | 1.75"
            " | 1.10 |") in text
    header, rule = text.splitlines()[:2]
    assert header.count("|") == rule.count("|")


def test_mla_bench_inputs_and_reference():
    """The MLA decode bench's inputs: a latent pool in random page order whose block
    table recovers each sequence, and a float32 reference the decode meets (here on the
    PyTorch path, the pool as K and its first 512 dims as V)."""
    from flashtile.bench import decode

    q, pool, table, seqlens, ref = decode._mla_inputs(2, 2 * decode.MLA_PAGE, 4, "cpu")
    assert q.shape == (2, 1, 4, decode.MLA_D) and pool.shape[1:] == (decode.MLA_PAGE, 1,
                                                                      decode.MLA_D)
    assert sorted(table.flatten().tolist()) == list(range(4))
    out = flashtile.flash_attn_with_kvcache(q.float(), pool.float(),
                                            pool.float()[..., :decode.MLA_DV],
                                            cache_seqlens=seqlens, block_table=table)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_dropout_providers_run_on_cuda_outside_the_sweeps():
    """The dropout rows are asked for by name (a training-only feature, beside the SDPA
    backends that take dropout_p); on CPU they say why they do not run."""
    for name in ("flashtile-dropout", "sdpa-flash-dropout", "sdpa-cudnn-dropout"):
        assert name not in registry.GPU_SWEEP.providers
        cell = registry.Cell(name, 64, True, "fwd_bwd", 128, 1, 2, torch.float32)
        assert registry.PROVIDERS[name].skip_reason(cell, CPU) == "runs on cuda only"


def test_flashtile_dropout_provider_drops(monkeypatch):
    """What the flashtile-dropout row times: flash_attn_func with DROPOUT_P, the cell's
    causality."""
    seen = {}
    monkeypatch.setattr(flashtile, "flash_attn_func",
                        lambda q, k, v, **kw: seen.update(kw) or q)
    cell = registry.Cell("flashtile-dropout", 64, True, "fwd_bwd", 128, 1, 2, torch.float32)
    registry.PROVIDERS["flashtile-dropout"].build(cell, CPU)(*(torch.zeros(1),) * 3)
    assert seen == {"dropout_p": registry.DROPOUT_P, "causal": True}


def test_flashtile_variants_are_not_its_peers():
    """flashtile / best peer compares flashtile with other libraries only: a timed
    variant of its own (dropout, fused backward, Gluon) is no peer, even when faster."""
    def ok(name, tflops):
        cell = registry.Cell(name, 64, True, "fwd_bwd", 128, 1, 2, torch.float32)
        return name, run.Result(cell, "ok", tflops=tflops)

    by = dict([ok("flashtile", 100.0), ok("flashtile-fusedbwd", 300.0),
               ok("flashtile-dropout", 90.0), ok("sdpa-flash-dropout", 80.0),
               ok("sdpa-cudnn", 120.0)])
    assert report.best_peer(by) == ("sdpa-cudnn", 120.0)
    del by["sdpa-cudnn"], by["sdpa-flash-dropout"]
    assert report.best_peer(by) == (None, None)


def test_engine_decode_rows_inputs_and_table():
    """The engine rows' inputs at the 0.5B shape's heads (14 over 2, d64): a paged pool
    whose block table recovers each sequence's cache, the launch plan read from the
    launcher's own helpers, and one table row per shape."""
    from flashtile.bench import decode

    q, k, v, _ = decode._decode_inputs(3, 128, "cpu", 14, 2, 64)
    pool_k, pool_v, table = decode._paged_pool(k, v, decode.ENGINE_PAGE)
    assert q.shape == (3, 1, 14, 64) and pool_k.shape == (6, decode.ENGINE_PAGE, 2, 64)
    assert torch.equal(pool_k[table.long()].reshape(k.shape), k)
    assert torch.equal(pool_v[table.long()].reshape(v.shape), v)
    cfg, programs, splits = decode._decode_launch(q, pool_k, pool_v, table)
    assert cfg.block_m == 16 and programs == 3 * 2 * splits  # 7 heads a KV head: 16 rows
    row = dict(model="qwen2.5-0.5b", heads=14, kv_heads=2, head_dim=64, batch=1,
               seqlen_k=1024, cache_gb=0.000524, copies=360, tile="16x64,4,3",
               programs=16, splits=8, us=5.0, gbps=105)
    text = decode.engine_decode_markdown([row], copy_gbps=4200.0)
    assert "| qwen2.5-0.5b | 14 / 2, 64 | 1 | 1024 | 0.001 | 360 | 16x64,4,3 | 16 (8) | 2 " \
        "| 5.0 | 105 | 2% |" in text
    header, rule = text.splitlines()[:2]
    assert header.count("|") == rule.count("|")
