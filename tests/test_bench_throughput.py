"""flashtile bench throughput's parent side (the providers need a GPU)."""

import argparse
import subprocess

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
