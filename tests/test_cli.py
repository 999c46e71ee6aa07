"""``python -m flashtile demo`` on tiny shapes: rows, table, exit code."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch

import flashtile
from flashtile import cli

# Odd lengths so the tiles are partial; under TRITON_INTERPRET=1 this is the Triton path.
TINY = [cli.Shape(1, 2, 17, 16, causal=False), cli.Shape(2, 2, 33, 16, causal=True)]


def test_run_demo_rows():
    rows = cli.run_demo(shapes=TINY, device="cpu", repeats=1)
    assert [r.shape for r in rows] == TINY
    for r in rows:
        assert r.ok, cli.format_row(r)
        assert 0 <= r.out_err <= r.out_tol and 0 <= r.dq_err <= r.dq_tol
        assert r.flash_ms > 0 and r.naive_ms > 0
        assert not r.memory_measured  # CPU: computed sizes
        # flashtile's extra memory is O(S) per row, the naive score matrix O(S^2).
        s = r.shape
        assert r.naive_mib == pytest.approx(s.batch * s.nheads * s.seqlen**2 * 4 / 2**20)
        line = cli.format_row(r)
        assert line.startswith(f"| {s.label()} | float32 | {s.causal} |")
        assert line.endswith("| yes |")
        assert line.count("|") == cli.TABLE_HEADER.splitlines()[0].count("|")


def test_demo_command_prints_table(monkeypatch, capsys):
    monkeypatch.setattr(cli, "CPU_SHAPES", TINY[:1])
    assert cli.main(["demo", "--device", "cpu", "--repeats", "1"]) == 0
    text = capsys.readouterr().out
    assert cli.TABLE_HEADER in text
    assert f"| {TINY[0].label()} | float32 | False |" in text
    assert "Memory (computed, not measured)" in text
    assert "OK: all 1 shapes within tolerance." in text


def test_demo_fails_on_wrong_output(monkeypatch, capsys):
    """The exit code is the point of a self-check: a wrong kernel must give 1."""
    real = flashtile.flash_attn_func

    def off_by_a_little(q, k, v, **kwargs):
        return real(q, k, v, **kwargs) * (1 + 1e-3)

    monkeypatch.setattr(flashtile, "flash_attn_func", off_by_a_little)
    monkeypatch.setattr(cli, "CPU_SHAPES", TINY[:1])
    assert cli.main(["demo", "--device", "cpu", "--repeats", "1"]) == 1
    assert "| NO |" in capsys.readouterr().out


def test_no_command_prints_help(capsys):
    assert cli.main([]) == 2
    assert "demo" in capsys.readouterr().out


def test_tolerance_rule():
    """2 x torch's own error + floor * max(1, |ref|); the generous fallback without it."""
    s = cli.Shape(1, 1, 8, 16, causal=False, dtype=torch.bfloat16)
    ref = torch.tensor([0.5, -3.0])
    assert cli._tolerance(s, 0.01, ref) == pytest.approx(2 * 0.01 + 1e-3 * 3.0)
    assert cli._tolerance(s, None, ref) == pytest.approx(2e-2 * 3.0)
    assert math.isfinite(cli._tolerance(cli.Shape(1, 1, 8, 16, False), 0.0, ref))


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
    (["tune", "--headdim", "512"], "argument --headdim: expected a head_dim from 1 to 256"),
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
                          capture_output=True, text=True, timeout=120,
                          cwd=os.path.dirname(os.path.dirname(__file__)))
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == ("flashtile demo: error: argument --repeats: expected a positive "
                           "int, got '0'; see flashtile demo --help\n")
