"""``python -m flashtile``: the demo (check, memory table, exit code, the Makefile's
``make demo`` being the same command) and the one-line errors of every command."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys

import pytest
import torch

import flashtile
from flashtile import cli, demo
from flashtile.reference import error_bound

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Odd lengths so the tiles are partial; under TRITON_INTERPRET=1 this is the Triton path.
TINY = [demo.Shape(1, 2, 17, 16, causal=False), demo.Shape(2, 2, 33, 16, causal=True)]
TINY_SCALING = demo.Scaling((32, 64), batch=1, nheads=2, head_dim=16, dtype=torch.float32)


def test_run_check_rows():
    rows = demo.run_check(shapes=TINY, device="cpu")
    assert [r.shape for r in rows] == TINY
    for r in rows:
        assert r.ok, demo.format_row(r)
        assert 0 <= r.out_err <= r.out_tol and 0 <= r.dq_err <= r.dq_tol
        assert r.out_tol >= error_bound(0.0, torch.zeros(1), torch.float32)
        line = demo.format_row(r)
        assert line.startswith(f"| {r.shape.label()} | float32 | {r.shape.causal} |")
        assert line.endswith("| yes |")
        assert line.count("|") == demo.CHECK_HEADER.splitlines()[0].count("|")


def test_run_scaling_measures_both_paths(monkeypatch):
    points = demo.run_scaling(TINY_SCALING, device="cpu", repeats=2)
    assert [n for n, _, _ in points] == [32, 64]
    for _, flash, naive in points:
        assert flash.ms > 0 and naive.ms > 0 and naive.skipped is None
        if sys.platform == "linux":  # peak resident memory is read from /proc
            assert flash.mib is not None and naive.mib is not None
    # Naive is skipped, saying why, where its score matrices would not fit.
    monkeypatch.setattr(demo, "_free_bytes", lambda device: 10**4)
    scaling = dataclasses.replace(TINY_SCALING, seqlens=(256,))
    [(_, flash, naive)] = demo.run_scaling(scaling, device="cpu")
    assert flash.ms > 0 and naive.skipped == "needs ~2 MiB" and naive.ms is None
    assert demo.format_point(256, flash, naive).endswith(
        f"| needs ~2 MiB | {flash.ms:.0f} | skipped |")
    with pytest.raises(ValueError, match="repeats: expected an int >= 1, got 0"):
        demo.run_scaling(TINY_SCALING, device="cpu", repeats=0)


@pytest.mark.gpu
def test_demo_parts_on_cuda():
    shapes = [dataclasses.replace(s, dtype=torch.bfloat16) for s in TINY]
    assert all(r.ok for r in demo.run_check(shapes, device="cuda"))
    scaling = dataclasses.replace(TINY_SCALING, seqlens=(256, 512), dtype=torch.bfloat16)
    for _, flash, naive in demo.run_scaling(scaling, device="cuda", repeats=3):
        assert flash.ms > 0 and naive.ms > 0
        assert flash.mib > 0 and naive.mib > 0  # measured: max_memory_allocated


def test_growth_line_comes_from_the_numbers():
    P = demo.Point
    points = [(1024, P(1, 10.0), P(1, 40.0)), (2048, P(1, 20.0), P(1, 160.0)),
              (4096, P(1, 41.0), P(skipped="needs ~9 GiB"))]
    assert demo.growth(points) == (
        "From seqlen 1024 to 2048 (x2) flashtile's memory grew x2.0, naive attention's "
        "x4.0: at 2048 flashtile needs 20 MiB, naive 160 MiB.")
    assert demo.growth(points[:1]) == ""


def test_demo_command_prints_both_tables(monkeypatch, capsys):
    monkeypatch.setattr(demo, "CPU_SHAPES", TINY[:1])
    monkeypatch.setattr(demo, "CPU_SCALING", TINY_SCALING)
    assert cli.main(["demo", "--device", "cpu"]) == 0
    text = capsys.readouterr().out
    assert demo.CHECK_HEADER in text and demo.SCALING_HEADER in text
    assert f"| {TINY[0].label()} | float32 | False |" in text
    assert re.search(r"^\| 32 \| .* \|$", text, re.M) and "Time: one call." in text
    assert "OK: all 1 checks within tolerance." in text
    assert text.rstrip().splitlines()[-1].startswith("Next: `make bench`")


def test_demo_fails_on_wrong_output(monkeypatch, capsys):
    """The exit code is the point of a self-check: a wrong kernel must give 1."""
    real = flashtile.flash_attn_func

    def off_by_a_little(q, k, v, **kwargs):
        return real(q, k, v, **kwargs) * (1 + 1e-3)

    monkeypatch.setattr(flashtile, "flash_attn_func", off_by_a_little)
    monkeypatch.setattr(demo, "CPU_SHAPES", TINY[:1])
    assert cli.main(["demo", "--device", "cpu"]) == 1
    assert "| NO |" in capsys.readouterr().out


def test_make_demo_is_flashtile_demo_and_make_bench_the_sweep():
    """Regression: `make demo` ran the six-minute `flashtile bench`, while `python -m
    flashtile demo` was an eight-second self-check."""
    with open(os.path.join(ROOT, "Makefile")) as f:
        makefile = f.read()

    def recipe(target):
        return re.search(rf"^{target}:.*\n((?:\t.*\n)+)", makefile, re.M)[1].strip()

    assert recipe("demo") == "$(VPY) -m flashtile demo"
    assert recipe("bench") == "$(VPY) -m flashtile bench"


def test_no_command_prints_help(capsys):
    assert cli.main([]) == 2
    assert "demo" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------
# Mistakes on the command line: one line on stderr, exit status 2, no traceback

@pytest.mark.parametrize("argv, message", [
    (["info", "--device", "cuda"], "flashtile info: error: argument --device: cuda is not "
                                   "available here"),
    (["demo", "--device", "cuda"], "flashtile demo: error: argument --device: cuda is not "
                                   "available here"),
    (["bench", "--device", "cuda"], "flashtile bench: error: argument --device: cuda is "
                                    "not available here"),
    (["tune", "--device", "gpu"], "flashtile tune: error: argument --device: expected "
                                  "auto, cpu or cuda, got 'gpu'"),
    (["demo", "--repeats", "0"], "flashtile demo: error: argument --repeats: expected a "
                                 "positive int, got '0'"),
    (["bench", "--repeats", "-2"], "argument --repeats: expected a positive int, got '-2'"),
    (["tune", "--repeats", "x"], "argument --repeats: expected a positive int, got 'x'"),
    (["bench", "--headdim", "64", "0"], "argument --headdim: expected a positive int"),
    (["tune", "--headdim", "513"], "argument --headdim: expected a head_dim from 1 to 512"),
    (["bench", "--seqlens", "1.5k"], "argument --seqlens: expected a positive length"),
    (["bench", "--providers", "flashattn9"], "argument --providers: invalid choice: "
                                             "'flashattn9'"),
    (["benchmark"], "flashtile: error: argument command: invalid choice: 'benchmark'"),
    (["bench", "--overwrite", "--resume"], "flashtile bench: error: --overwrite replaces "
                                           "the folder's run"),
    (["bench", "--decode", "--device", "cpu"], "flashtile bench: error: --decode times "
                                               "replayed CUDA graphs and needs a CUDA"),
    (["bench", "--out", __file__], "flashtile bench: error: --out"),
], ids=lambda x: "-".join(x) if isinstance(x, list) else None)
def test_mistakes_print_one_line_and_exit_2(argv, message, monkeypatch, capsys):
    """Regression: --device cuda without CUDA raised AssertionError ("Torch not compiled
    with CUDA enabled") and demo --repeats 0 a StatisticsError, both as tracebacks."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("FLASHTILE_BACKEND", "torch")
    with pytest.raises(SystemExit) as exit_info:
        sys.exit(cli.main(argv))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
    assert err.startswith("flashtile")


def test_a_mistake_from_the_shell():
    """The real process: exit status 2 and one line, as a user sees it."""
    done = subprocess.run([sys.executable, "-m", "flashtile", "demo", "--repeats", "0"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == ("flashtile demo: error: argument --repeats: expected a positive "
                           "int, got '0'; see flashtile demo --help\n")
