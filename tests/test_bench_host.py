"""flashtile bench host: the host time of eager calls while the GPU is busy (issue 15)."""

import pytest

from flashtile.bench import host
from flashtile.cli import main


def test_needs_cuda(capsys, on_gpu):
    if on_gpu:
        pytest.skip("CPU only: on a GPU the command runs")
    assert main(["bench", "host"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "needs a CUDA device" in err


def test_markdown_marks_synced_and_missing_rows():
    rows = [dict(call="forward", provider="flashtile", host_us=21.04, gpu_busy=True),
            dict(call="forward", provider="flashtile, no plans", host_us=150.0,
                 gpu_busy=False),
            dict(call="forward", provider="sdpa_cudnn", host_us=None, error="x"),
            dict(call="bare Triton launch", provider="triton", host_us=14.2, gpu_busy=True),
            dict(call="piece: torch.empty (one CUDA allocation)", provider="piece",
                 host_us=3.14, gpu_busy=True)]
    text = host.markdown(rows)
    assert "| forward | 21.0 | 150.0 (synced) | n/a |" in text
    assert "launch (Triton's own path, 2 arguments): 14.2 us" in text
    assert text.endswith("| piece of a call | us |\n| --- | ---: |\n"
                         "| torch.empty (one CUDA allocation) | 3.1 |")


@pytest.mark.gpu
def test_no_flashtile_call_waits_for_the_gpu(device, tmp_path, capsys):
    """Every flashtile row keeps the GPU busy through its loop: no call reads a device
    tensor back (the index checks are off by default), plans or not. --profile ROW
    prints cProfile's table of the matching rows' calls."""
    rows = host.run(calls=5, rounds=2, device=device)
    for r in rows:
        if r["provider"].startswith("flashtile"):
            assert r["host_us"] is not None and r["gpu_busy"], r
    assert main(["bench", "host", "--calls", "5", "--rounds", "1", "--out",
                 str(tmp_path), "--profile", "decode, contiguous"]) == 0
    assert (tmp_path / "host.json").exists() and (tmp_path / "host.md").exists()
    printed = capsys.readouterr().out
    assert "decode, contiguous 8k: cProfile of 1 x 5 calls" in printed
    assert "flash_attn_with_kvcache" in printed and "decode, paged 8k:" not in printed
