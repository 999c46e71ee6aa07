"""flashtile bench host: the host time of eager calls while the GPU is busy (issue 15)."""

import statistics

import pytest

from flashtile.bench import host
from flashtile.cli import main
from flashtile.ops import _launch


def test_needs_cuda(capsys, on_gpu):
    if on_gpu:
        pytest.skip("CPU only: on a GPU the command runs")
    assert main(["bench", "host"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "needs a CUDA device" in err


def test_markdown_marks_synced_and_missing_rows():
    rows = [dict(call="forward", provider="flashtile", host_us=21.04, gpu_busy=True,
                 vs_cudnn=None),
            dict(call="forward", provider="flashtile, no plans", host_us=150.0,
                 gpu_busy=False, vs_cudnn=None),
            dict(call="forward", provider="sdpa_cudnn", host_us=None, error="x"),
            dict(call="bare Triton launch", provider="triton", host_us=14.2, gpu_busy=True),
            dict(call="piece: torch.empty (one CUDA allocation)", provider="piece",
                 host_us=3.14, gpu_busy=True)]
    text = host.markdown(rows)
    assert "| forward | 21.0 | 150.0 (synced) | n/a | n/a |" in text
    assert "launch (Triton's own path, 2 arguments): 14.2 us" in text
    assert text.endswith("| piece of a call | us |\n| --- | ---: |\n"
                         "| torch.empty (one CUDA allocation) | 3.1 |")


class Call:
    """A fake eager call: ``us`` microseconds of host time at full speed; raises
    RuntimeError from its ``fail_at``-th call on (as cuDNN SDPA does for a shape it
    refuses). DriftingHost calls it once a loop."""

    def __init__(self, name, us, fail_at=None):
        self.name, self.us, self.fail_at, self.count = name, us, fail_at, 0

    def __call__(self):
        self.count += 1
        if self.fail_at is not None and self.count >= self.fail_at:
            raise RuntimeError(f"{self.name} refuses this shape\nsecond line")


class DriftingHost:
    """Stands in for host._timed_loop with a fake clock: the host runs at full speed
    until ``slow_after`` seconds, then at half speed (as between the two runs of the
    H200 machine, 26 and 43 us for the same forward). A flashtile call without launch
    plans costs 5x its time with them. ``log``: (call, plans on, sleep cycles) of each
    loop."""

    def __init__(self, slow_after):
        self.now, self.slow_after, self.log = 0.0, slow_after, []

    def __call__(self, fn, calls, sleep_cycles):
        plans = _launch._enabled["on"]
        self.log.append((fn.name, plans, sleep_cycles))
        fn()
        speed = 1 if self.now < self.slow_after else 0.5
        per_call = fn.us * 1e-6 * (1 if plans else 5) / speed
        self.now += per_call * calls
        return per_call, True


def fake_row(monkeypatch, slow_after=0.011, **providers):
    host_clock = DriftingHost(slow_after)
    monkeypatch.setattr(host, "_timed_loop", host_clock)
    rows = host.time_row("forward", providers, calls=50, rounds=9, cycles_per_s=1e9)
    return {r["provider"]: r for r in rows}, host_clock


def test_rounds_interleave_variants_in_rotating_order(monkeypatch):
    rows, clock = fake_row(monkeypatch, flashtile=Call("flashtile", 20),
                           sdpa_cudnn=Call("sdpa_cudnn", 40))
    variants = [("flashtile", True), ("flashtile", False), ("sdpa_cudnn", True)]
    # One untimed warm-up per variant (3 calls, then an unhindered loop), no GPU sleep.
    assert [entry[:2] for entry in clock.log[:6]] == [v for v in variants for _ in "ab"]
    assert all(cycles == 0 for *_, cycles in clock.log[:6])
    timed = clock.log[6:]
    assert len(timed) == 9 * 3 and all(cycles > 0 for *_, cycles in timed)
    # Round r starts at variant r mod 3: each variant is first in 3 of the 9 rounds.
    assert [entry[:2] for entry in timed] == [
        variants[(r + i) % 3] for r in range(9) for i in range(3)]
    assert list(rows) == ["flashtile", "flashtile, no plans", "sdpa_cudnn"]


def test_ratio_is_the_true_cost_ratio_despite_drift(monkeypatch):
    """The host halves its speed during the rounds: the per-round ratio stays 20/40,
    while the same fake host timed sequentially (each variant's rounds after the
    previous one's, the schedule before the interleaving) gives 20/80."""
    providers = dict(flashtile=Call("flashtile", 20), sdpa_cudnn=Call("sdpa_cudnn", 40))
    rows, clock = fake_row(monkeypatch, **providers)
    assert rows["flashtile"]["vs_cudnn"] == pytest.approx(0.5)
    assert rows["flashtile, no plans"]["vs_cudnn"] == pytest.approx(2.5)
    assert "vs_cudnn" not in rows["sdpa_cudnn"]
    assert clock.now > clock.slow_after  # the drift happened inside the run
    assert all(r["gpu_busy"] for r in rows.values())

    sequential = DriftingHost(clock.slow_after)
    median = {}
    for label, fn, plans in host._variants(providers):
        previous = _launch.set_enabled(plans)
        sequential(fn, 3, 0), sequential(fn, 50, 0)
        median[label] = statistics.median(sequential(fn, 50, 1)[0] for _ in range(9))
        _launch.set_enabled(previous)
    assert median["flashtile"] / median["sdpa_cudnn"] == pytest.approx(0.25)


@pytest.mark.parametrize("fail_at", [1, 6], ids=["at-warm-up", "mid-rounds"])
def test_a_raising_variant_leaves_the_others_their_rounds(monkeypatch, fail_at):
    rows, clock = fake_row(monkeypatch, flashtile=Call("flashtile", 20),
                           sdpa_cudnn=Call("sdpa_cudnn", 40, fail_at=fail_at))
    assert rows["sdpa_cudnn"] == dict(call="forward", provider="sdpa_cudnn",
                                      host_us=None, error="sdpa_cudnn refuses this shape")
    assert sum(name == "sdpa_cudnn" for name, *_ in clock.log) == min(fail_at, 2 + 9)
    for label in ("flashtile", "flashtile, no plans"):
        assert rows[label]["host_us"] is not None and rows[label]["vs_cudnn"] is None
    assert sum(name == "flashtile" and cycles > 0 for name, _, cycles in clock.log) == 18


def test_markdown_shows_the_ratio_column(monkeypatch):
    forward, _ = fake_row(monkeypatch, flashtile=Call("flashtile", 20),
                          sdpa_cudnn=Call("sdpa_cudnn", 40))
    monkeypatch.setattr(host, "_timed_loop", DriftingHost(slow_after=1.0))
    varlen = host.time_row("varlen forward", dict(flashtile=Call("flashtile", 30)),
                           calls=50, rounds=3, cycles_per_s=1e9)
    text = host.markdown([*forward.values(), *varlen])
    lines = text.splitlines()
    assert lines[0].endswith("| flashtile / cuDNN (median of per-round ratios) |")
    assert "| varlen forward | 30.0 | 150.0 | - | - |" in lines
    assert any(line.startswith("| forward |") and line.endswith("| 0.50 |")
               for line in lines)


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
