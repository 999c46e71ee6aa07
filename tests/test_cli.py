"""``python -m flashtile demo`` on tiny shapes: rows, table, exit code."""

from __future__ import annotations

import math

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
