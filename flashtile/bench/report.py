"""What ``flashtile bench`` writes: markdown tables, raw JSON and PNG plots.

Tables have one row per (head_dim, causal, mode, seqlen) and one column per provider:
TFLOP/s with flashtile's ratio to the best peer that ran, the median time with its
p20-p80 range, and the peak extra memory. A cell that did not run shows "OOM" or "n/a";
the reasons are listed once under the tables.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
from collections import defaultdict

from flashtile.bench.run import Result

logger = logging.getLogger("flashtile")
SCHEMA = "flashtile-bench/1"


def _rows(results: list[Result]) -> dict:
    """{(head_dim, causal, mode, seqlen): {provider: Result}}, in run order."""
    rows = defaultdict(dict)
    for r in results:
        rows[r.cell.row()][r.cell.provider] = r
    return rows


def _providers(results):
    return list(dict.fromkeys(r.cell.provider for r in results))


def best_peer(by_provider: dict) -> tuple[str | None, float | None]:
    """The fastest peer that ran: (name, TFLOP/s). flashtile's own variants
    (flashtile-fusedbwd, flashtile-hopper, flashtile-dropout, ...) are not peers."""
    peers = [(r.tflops, name) for name, r in by_provider.items()
             if not name.startswith("flashtile") and r.status == "ok"]
    if not peers:
        return None, None
    tflops, name = max(peers)
    return name, tflops


def summary(results: list[Result]) -> list[dict]:
    """Per row: flashtile's TFLOP/s, the best peer, and flashtile / best peer."""
    out = []
    for (d, causal, mode, seqlen), by in _rows(results).items():
        peer, peer_tflops = best_peer(by)
        ours = by.get("flashtile")
        ours_tflops = ours.tflops if ours is not None and ours.status == "ok" else None
        ratio = ours_tflops / peer_tflops if ours_tflops and peer_tflops else None
        out.append(dict(head_dim=d, causal=causal, mode=mode, seqlen=seqlen,
                        flashtile_tflops=ours_tflops, best_peer=peer,
                        best_peer_tflops=peer_tflops, ratio=ratio))
    return out


def _cell(r: Result | None, value, spec) -> str:
    if r is None:
        return ""
    if r.status != "ok":
        return r.status
    x = value(r)
    return "n/a" if x is None else format(x, spec)


def _table(results, title, value, spec, with_ratio=False) -> str:
    providers = _providers(results)
    head = ["head_dim", "causal", "mode", "seqlen", *providers]
    if with_ratio:
        head += ["best peer", "flashtile / best peer"]
    lines = [f"**{title}**", "", "| " + " | ".join(head) + " |",
             "|" + "---|" * 4 + "---:|" * (len(head) - 4)]
    ratios = {(s["head_dim"], s["causal"], s["mode"], s["seqlen"]): s
              for s in summary(results)} if with_ratio else {}
    for (d, causal, mode, seqlen), by in _rows(results).items():
        vals = [_cell(by.get(p), value, spec) for p in providers]
        if with_ratio:
            row = ratios[(d, causal, mode, seqlen)]
            vals += [row["best_peer"] or "n/a",
                     "n/a" if row["ratio"] is None else f"{row['ratio']:.2f}"]
        lines.append(f"| {d} | {causal} | {mode} | {seqlen} | " + " | ".join(vals) + " |")
    return "\n".join(lines)


def _ms(x: float) -> str:
    return f"{x:.3g}" if x < 1000 else f"{x:.0f}"


def _time_range(r: Result):
    if r.ms is None:
        return None
    return f"{_ms(r.ms)} ({_ms(r.ms_p20)}-{_ms(r.ms_p80)})"


def _not_run(results) -> str:
    reasons = {}
    for r in results:
        if r.status != "ok":
            reasons.setdefault((r.cell.provider, r.status, r.reason), []).append(r.cell)
    if not reasons:
        return ""
    lines = ["Not run:"]
    for (provider, status, reason), cells in reasons.items():
        lines.append(f"- {provider}: {status} ({reason}) in {len(cells)} cell(s)")
    return "\n".join(lines)


def _ratio_line(results) -> str:
    ratios = sorted(s["ratio"] for s in summary(results) if s["ratio"] is not None)
    if not ratios:
        return "flashtile / best peer: no row where both ran."
    return (f"flashtile / best peer over {len(ratios)} rows: min {ratios[0]:.2f}, "
            f"median {statistics.median(ratios):.2f}, max {ratios[-1]:.2f}.")


def flops_unit(results) -> tuple[float, str]:
    """TFLOP/s, or GFLOP/s where nothing reaches 1 TFLOP/s (a CPU): (scale, name)."""
    top = max((r.tflops for r in results if r.tflops is not None), default=0.0)
    return (1.0, "TFLOP/s") if top >= 1.0 else (1e3, "GFLOP/s")


def _na(x):
    return "n/a" if x is None else x


def markdown(results: list[Result], machine: dict, settings: dict) -> str:
    measured = any(r.peak_mib is not None for r in results)
    scale, unit = flops_unit(results)
    parts = [
        f"# flashtile bench: {machine.get('device', '?')}",
        "",
        "Command: " + "; ".join(f"`{c}`" for c in machine.get(
            "commands", [machine.get("command", "?")])) + "  ",
        f"Date: {machine.get('date', '?')}; torch {machine.get('torch')}, triton "
        f"{machine.get('triton')}, flashtile {machine.get('flashtile')}, CUDA "
        f"{_na(machine.get('cuda'))}, cuDNN {_na(machine.get('cudnn'))}; flashtile backend "
        f"{machine.get('backend')}.  ",
        f"{settings['dtype']}, batch * seqlen = {settings['tokens']} tokens (batch >= 1), "
        + (f"nheads = {settings['head_budget']} / head_dim. "
           if settings.get("head_budget") else f"nheads = {settings['nheads']}. ")
        + f"{unit} = 4*B*H*N*N*D (x0.5 causal, x3.5 fwd_bwd) / median time.",
        "",
        _table(results, f"{unit} (median)", lambda r: r.tflops * scale, ".1f",
               with_ratio=True),
        "",
        _ratio_line(results),
        "",
        _table(results, "Time, ms: median (p20-p80)", _time_range, "s"),
        "",
    ]
    if measured:
        parts += [_table(results, "Peak memory above the inputs, MiB (measured: "
                         "torch.cuda.max_memory_allocated)", lambda r: r.peak_mib, ".0f"),
                  ""]
    else:
        parts += ["Peak memory: not measured on this device (CPU); JSON has null.", ""]
    parts.append(_not_run(results))
    return "\n".join(parts).rstrip() + "\n"


def to_json(results, machine, settings) -> dict:
    return dict(schema=SCHEMA, machine=machine, settings=settings,
                memory_measured=any(r.peak_mib is not None for r in results),
                results=[r.to_json() for r in results], summary=summary(results))


def check_append(previous: dict, machine: dict, settings: dict) -> None:
    """One device, dtype and tokens/heads rule per results folder, or ValueError."""
    old_machine, old_settings = previous.get("machine", {}), previous.get("settings", {})
    pairs = [("device", machine.get("device"), old_machine.get("device"))]
    pairs += [(key, settings.get(key), old_settings.get(key))
              for key in ("dtype", "tokens", "head_budget", "nheads")]
    for key, new, old in pairs:
        if old != new:
            raise ValueError(f"--append: the folder holds {key} {old!r}, this run is "
                             f"{new!r}; use another --out")


def merge(previous: dict, results: list[Result], settings: dict, machine: dict):
    """Add this run to a previous results.json (``--append``): a cell measured again
    replaces the old one; the settings' lists become unions; the commands are kept.
    Returns (results, settings, machine)."""
    check_append(previous, machine, settings)
    old_machine, old_settings = previous.get("machine", {}), previous.get("settings", {})
    fresh = {(r.cell.provider, r.cell.row()) for r in results}
    kept = [r for r in map(Result.from_json, previous.get("results", []))
            if (r.cell.provider, r.cell.row()) not in fresh]
    order = {p: i for i, p in enumerate(dict.fromkeys(
        [*old_settings.get("providers", []), *settings["providers"]]))}
    merged = sorted(kept + results, key=lambda r: (r.cell.row(), order[r.cell.provider]))
    settings = dict(settings)
    for key in ("providers", "head_dims", "seqlens", "causal", "modes"):
        union = dict.fromkeys([*old_settings.get(key, []), *settings[key]])
        settings[key] = list(union) if key == "providers" else sorted(union)
    commands = old_machine.get("commands", [old_machine.get("command")])
    machine = dict(machine, commands=[*commands, machine.get("command")])
    return merged, settings, machine


def _configs(results):
    return list(dict.fromkeys((r.cell.head_dim, r.cell.causal, r.cell.mode)
                              for r in results))


def _short(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def plot(results: list[Result], out_dir: str, title: str = "") -> list[str]:
    """TFLOP/s vs seqlen per (head_dim, causal, mode), one line per provider; and, where
    memory was measured, peak memory vs seqlen on a log scale. Returns the PNG paths."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    paths = []
    scale, unit = flops_unit(results)
    metrics = [("tflops", unit, scale, False)]
    if any(r.peak_mib is not None for r in results):
        metrics.append(("peak_mib", "peak memory above inputs (MiB)", 1.0, True))
    for d, causal, mode in _configs(results):
        mask = "causal" if causal else "full"
        for attr, ylabel, factor, log_y in metrics:
            fig, ax = plt.subplots(figsize=(7, 4.5))
            for provider in _providers(results):
                pts = sorted((r.cell.seqlen, getattr(r, attr) * factor) for r in results
                             if r.cell.provider == provider and r.status == "ok"
                             and getattr(r, attr) is not None
                             and (r.cell.head_dim, r.cell.causal, r.cell.mode)
                             == (d, causal, mode))
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=provider)
            ax.set_xscale("log", base=2)
            seqlens = sorted({r.cell.seqlen for r in results})
            ax.set_xticks(seqlens, [_short(n) for n in seqlens])
            ax.minorticks_off()
            if log_y:
                ax.set_yscale("log")
            else:
                ax.set_ylim(bottom=0)
            ax.set_xlabel("seqlen")
            ax.set_ylabel(ylabel)
            ax.set_title(f"{title} head_dim={d} {mask} {mode}".strip())
            ax.grid(True, which="both", alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend()
            name = "tflops" if attr == "tflops" else "memory"
            path = os.path.join(out_dir, f"{name}-d{d}-{mask}-{mode}.png")
            fig.savefig(path, dpi=110, bbox_inches="tight")
            plt.close(fig)
            paths.append(path)
    return paths


def _write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def write_outputs(results, machine, settings, out_dir, plots: bool = True) -> dict:
    """results.json, results.md and (``plots``) the plots in ``out_dir``; returns their
    paths."""
    os.makedirs(out_dir, exist_ok=True)
    paths = {"json": os.path.join(out_dir, "results.json"),
             "markdown": os.path.join(out_dir, "results.md")}
    # Written whole then renamed: results.json may hold earlier runs' cells (--append),
    # and a run killed mid-write must not leave it truncated.
    _write_atomic(paths["json"], json.dumps(to_json(results, machine, settings), indent=1,
                                            default=str))
    _write_atomic(paths["markdown"], markdown(results, machine, settings))
    paths["plots"] = []
    if not plots:
        return paths
    try:
        paths["plots"] = plot(results, out_dir, machine.get("device", ""))
    except ImportError:  # the bench extra is not installed: tables only
        logger.warning("flashtile bench: matplotlib is not installed; no plots "
                       "(pip install 'flashtile[bench]')")
        paths["plots"] = []
    return paths
