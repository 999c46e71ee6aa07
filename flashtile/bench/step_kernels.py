"""One engine step, kernel by kernel (``flashtile.bench.throughput --decode-step --kernels N``).

A few engine steps run under torch.profiler, all batch sizes in one session: with CUDA
graphs, re-initialising CUPTI after a teardown has crashed (torch/profiler/profiler.py's
FIXME), and a session opened before the capture has been seen to record no kernel of a
later replay at all. Each step runs inside a ``record_function`` range, and the runner's
``prepare``, ``forward`` and ``wait`` inside ranges of their own, so every event can be
placed in its step and section:

- CUDA: the kernels, copies and memsets (CUPTI's activity records, a replayed graph's
  kernels included). A kernel the profiler links to a host operator or range belongs to
  the section that launched it: ``forward`` (the eager layers), or elsewhere in the step
  (the inputs' copies, the logits, sampling, the copy of the sampled ids back). One
  linked to none (a replayed graph's kernels: no operator is open around
  ``CUDAGraph.replay``) is placed by its device start: before the step's first kernel
  launched after the forward (the logits' matmul), it is the forward's.
- CPU (no CUDA activity: the tests' tiny model): each operator's self time, the
  stretches of its span that none of its child operators covers, placed by its start.

Per step, averaged over the steps: the host's wall time split into prepare, the
forward's launch, the rest of ``launch`` and ``wait``; on the device, the time before
the first kernel (host work the device waits for), the time kernels run (the union of
their intervals), the idle time between them, and the time after the last one; per
section, each kernel's launches, microseconds and share of all the step's kernel time.
"""

from __future__ import annotations

import re
from contextlib import contextmanager

STEP = "flashtile.step/"
PARTS = ("prepare", "forward", "wait")  # the runner's methods timed as host ranges
SECTIONS = ("forward", "rest")
WARM_STEPS, STEPS = 2, 3  # untimed steps first: kernel selection, allocator, caches


# What names a templated kernel's work among its template arguments: PyTorch's functors
# and reduction ops (FillFunctor, ArgMaxOps), the enclosing kernel of a lambda
# (direct_copy_kernel_cuda, gpu_index_kernel).
_WORK = re.compile(r"\b(\w*Functor\w*|\w+Ops?|\w+_kernel(?:_cuda)?|\w+_cuda)\b")
_GENERIC = re.compile(r"(Kernel\d*|device_kernel|kernel)")


def short_name(name: str, width: int = 72) -> str:
    """A kernel's name without its parameter list, namespaces and template arguments,
    but for the template argument that says what it does: ``void
    at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<c10::BFloat16>,
    ...>(int, ...)`` -> ``vectorized_elementwise_kernel[FillFunctor]``; cutlass's
    ``Kernel2<cutlass_80_..._gemm_...>`` -> its argument. Copies and memsets ("Memcpy
    HtoD (Pinned -> Device)"), operators ("aten::mm") and plain names (Triton's,
    cuBLAS's nvjet_*) are kept."""
    if name.startswith(("Memcpy", "Memset")) or not re.search(r"[<(]", name):
        return name[:width]
    name = name.removeprefix("void ").replace("(anonymous namespace)::", "")
    depth, head_end, args_end = 0, None, len(name)
    for i, c in enumerate(name):
        if c == "<":
            if depth == 0 and head_end is None:
                head_end = i
            depth += 1
        elif c == ">":
            depth -= 1
        elif c == "(" and depth == 0:
            args_end = i
            break
    head = name[:head_end if head_end is not None else args_end].split("::")[-1]
    if head_end is None:
        return head[:width]
    template = name[head_end + 1:args_end].rstrip().removesuffix(">")
    work = _WORK.findall(template)
    if work:
        return f"{head}[{work[-1]}]"[:width]
    if _GENERIC.fullmatch(head):
        return re.split(r"[<,(]", template)[0].split("::")[-1].strip()[:width]
    return head[:width]


FLOOR_KERNELS = 240  # about a graphed decode step's kernels (10 a layer, 24 layers)


def graph_kernel_us(kernels: int = FLOOR_KERNELS, reps: int = 20) -> float:
    """Microseconds a kernel of a CUDA graph of ``kernels`` one-element adds, replayed
    back to back (median of ``reps`` replays): what each kernel of a graphed decode step
    costs however little it does, the floor under a small model's step (NOTES.md
    section 25: the 0.5B shape's batch-1 forward, ~250 kernels, takes 4x its bytes)."""
    import torch
    x = torch.zeros(1, device="cuda")
    return graph_us([lambda: x.add_(1)] * kernels, reps)


def graph_us(calls, reps: int = 20) -> float:
    """Microseconds per call of a CUDA graph of ``calls`` (functions of no argument) run
    back to back: the median of ``reps`` replays over the calls."""
    import torch
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up off the capture, as torch's docs ask
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return 1e3 * sorted(times)[reps // 2] / len(calls)


@contextmanager
def annotated(runner):
    """The runner's prepare, forward and wait each inside a record_function range while
    the context lasts (instance attributes over the methods, removed after)."""
    from torch.profiler import record_function

    def ranged(name, method):
        def run(*args, **kwargs):
            with record_function(f"flashtile.{name}"):
                return method(*args, **kwargs)
        return run

    for name in PARTS:
        setattr(runner, name, ranged(name, getattr(runner, name)))
    try:
        yield
    finally:
        for name in PARTS:
            delattr(runner, name)


def session(cuda: bool):
    """A torch.profiler session: CUDA activity on CUDA, the CPU's operators otherwise
    (the CPU's are recorded on CUDA too: they carry the launches' host times)."""
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    return profile(activities=activities, record_shapes=False, with_stack=False)


def run_steps(runner, scheduled, label: str, steps: int = STEPS, warm: int = WARM_STEPS):
    """``warm`` engine steps, then ``steps`` more each inside the range STEP + label:
    call inside ``session`` and ``annotated``. Each step is synchronous (it ends by
    reading the sampled ids), so all its device work lies inside its range."""
    from torch.profiler import record_function
    for i in range(warm + steps):
        if i < warm:
            runner.execute(scheduled)
            continue
        with record_function(STEP + label):
            runner.execute(scheduled)


def profile_events(prof, cuda: bool):
    """(host ranges [(name, start, end)], kernels [(name, start, end, launched, new)])
    from a finished session, in microseconds; ``launched``: the host time of the call
    that launched the kernel, None when the profiler linked it to none; ``new``: a
    launch of its own, not another stretch of the CPU operator before it."""
    from torch.autograd import DeviceType
    events = prof.events()
    host = [e for e in events if e.device_type == DeviceType.CPU and not e.is_async]
    ranges = [(e.name, e.time_range.start, e.time_range.end) for e in host
              if e.is_user_annotation and e.name.startswith("flashtile.")]
    kernels = []
    if cuda:
        # The frontend events (operators, ranges) by id: the id a device event links to.
        # Runtime calls (cudaLaunchKernel) link to them too, and their own ids are
        # CUPTI's, another numbering: left out.
        by_id = {e.id: e for e in host if not getattr(e, "linked_correlation_id", 0)}
        for e in events:
            if e.device_type != DeviceType.CUDA or e.is_user_annotation:
                continue
            src = by_id.get(getattr(e, "linked_correlation_id", 0))
            kernels.append((e.name, e.time_range.start, e.time_range.end,
                            src.time_range.start if src is not None else None, True))
        return ranges, kernels
    for e in host:
        if e.is_user_annotation or "::" not in e.name:
            continue
        # Self time: the op's span less its children's, as the stretches between them.
        t, start = e.time_range.start, e.time_range.start
        stretches = []
        for c in sorted(e.cpu_children, key=lambda c: c.time_range.start):
            stretches.append((t, c.time_range.start))
            t = max(t, c.time_range.end)
        stretches.append((t, e.time_range.end))
        kernels += [(e.name, a, b, start, i == 0) for i, (a, b) in enumerate(stretches)
                    if b > a or i == 0]
    return ranges, kernels


def _busy(intervals) -> float:
    """Length of the union of (start, end) intervals (the combine kernel's dependent
    launch overlaps the decode kernel's end)."""
    total, reach = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e > reach:
            total += e - max(s, reach)
            reach = e
    return total


def _inside(t, ranges) -> int | None:
    """Index of the range (start, end) that holds time t, or None."""
    for i, (s, e) in enumerate(ranges):
        if s <= t <= e:
            return i
    return None


def summarize(ranges, kernels, label: str, source: str) -> dict | None:
    """The per-step breakdown of the steps labelled ``label`` (module docstring), or
    None if none ran. ranges and kernels as ``profile_events`` returns them."""
    steps = [(s, e) for n, s, e in ranges if n == STEP + label]
    if not steps:
        return None
    n = len(steps)
    parts = {p: [(s, e) for name, s, e in ranges if name == f"flashtile.{p}"]
             for p in PARTS}
    per_step = [dict(forward=[], rest=[]) for _ in steps]
    unlinked = []
    for k in kernels:
        if k[3] is None:
            unlinked.append(k)
            continue
        i = _inside(k[3], steps)
        if i is not None:
            fwd = _inside(k[3], parts["forward"]) is not None
            per_step[i]["forward" if fwd else "rest"].append(k)
    placed = 0
    for k in unlinked:
        i = _inside(k[1], steps)
        if i is None:
            continue
        # Before the device start of the first kernel launched after the forward's
        # launch (the logits' matmul), it is the forward's.
        lo, hi = steps[i]
        fwd_end = max((e for s, e in parts["forward"] if lo <= s <= hi), default=None)
        later = [r[1] for r in per_step[i]["rest"] if fwd_end is not None and r[3] > fwd_end]
        fwd = fwd_end is not None and k[1] < min(later, default=float("inf"))
        per_step[i]["forward" if fwd else "rest"].append(k)
        placed += 1

    host = dict(step=sum(e - s for s, e in steps) / n)
    for p in PARTS:
        host[p] = sum(e - s for s, e in parts[p] if _inside(s, steps) is not None) / n
    host["rest"] = host["step"] - sum(host[p] for p in PARTS)
    device = dict(lead=0.0, busy=0.0, idle=0.0, tail=0.0)
    for (lo, hi), sec in zip(steps, per_step):
        ivs = [k[1:3] for ks in sec.values() for k in ks]
        if not ivs:
            continue
        first, last = min(s for s, _ in ivs), max(e for _, e in ivs)
        busy = _busy(ivs)
        device["lead"] += max(first - lo, 0.0) / n
        device["busy"] += busy / n
        device["idle"] += (last - first - busy) / n
        device["tail"] += max(hi - last, 0.0) / n
    total = sum(k[2] - k[1] for sec in per_step for ks in sec.values() for k in ks)
    sections = {}
    for section in SECTIONS:
        rows, span, idle, count = {}, 0.0, 0.0, 0
        for sec in per_step:
            ks = sec[section]
            if ks:
                first, last = min(k[1] for k in ks), max(k[2] for k in ks)
                span += last - first
                idle += last - first - _busy([k[1:3] for k in ks])
            count += sum(k[4] for k in ks)
            for name, s, e, _, new in ks:
                r = rows.setdefault(short_name(name), dict(launches=0, us=0.0, full={}))
                r["launches"] += new
                r["us"] += e - s
                r["full"][name] = r["full"].get(name, 0.0) + e - s
        table = [dict(name=k, launches=r["launches"] / n, us=r["us"] / n,
                      share=r["us"] / total if total else 0.0,
                      full_name=max(r["full"], key=r["full"].get))
                 for k, r in rows.items()]
        table.sort(key=lambda r: -r["us"])
        sections[section] = dict(launches=count / n, us=sum(r["us"] for r in table),
                                 share=sum(r["share"] for r in table), span_us=span / n,
                                 idle_us=idle / n, kernels=table)
    return dict(source=source, steps=n, host_us=host, device_us=device,
                sections=sections, unlinked=placed / n)


def graph_or_eager(graph: dict | None, eager: dict | None) -> dict | None:
    """The breakdown to report: the CUDA graph steps', unless the profiler saw no kernel
    of their forward (a CUPTI that does not report a replayed graph's kernels); then the
    eager steps', which say so."""
    if graph is not None and eager is not None and not graph["sections"]["forward"]["launches"]:
        return dict(eager, source="eager forward: the profiler saw no kernel of the CUDA "
                                  "graph replay")
    return graph


def markdown(title: str, b: dict, top: int, step_ms: float | None = None,
             forward_ms: float | None = None, eager: dict | None = None) -> str:
    """One step's breakdown as text and a table: the top kernels of each section, the
    rest of the section in one row, and the section's total. step_ms, forward_ms: the
    step and its forward timed without the profiler (CUPTI's tracing may widen the gaps
    between kernels); eager: the eager forward's breakdown, for comparison."""
    h, d = b["host_us"], b["device_us"]
    fwd = b["sections"]["forward"]

    def unprofiled(ms):
        return f" ({ms:.3f} ms without the profiler)" if ms else ""

    lines = [f"**{title}**: {b['steps']} steps under torch.profiler, {b['source']}", "",
             f"Host: step {h['step'] / 1e3:.3f} ms{unprofiled(step_ms)} = prepare "
             f"{h['prepare'] / 1e3:.3f} + forward launch {h['forward'] / 1e3:.3f} + logits "
             f"and sampling launch {h['rest'] / 1e3:.3f} + wait {h['wait'] / 1e3:.3f}.",
             f"Device: first kernel {d['lead'] / 1e3:.3f} ms after the step starts; "
             f"kernels run {d['busy'] / 1e3:.3f} ms, idle {d['idle'] / 1e3:.3f} ms between "
             f"them; the step ends {d['tail'] / 1e3:.3f} ms after the last one. The "
             f"forward's kernels span {fwd['span_us'] / 1e3:.3f} ms{unprofiled(forward_ms)}.",
             "",
             "| section | kernel | launches | us | of kernel time |",
             "| --- | --- | --- | --- | --- |"]
    for name in SECTIONS:
        s = b["sections"][name]
        for r in s["kernels"][:top]:
            lines.append(f"| {name} | {r['name']} | {r['launches']:g} | {r['us']:.1f} "
                         f"| {100 * r['share']:.1f}% |")
        more = s["kernels"][top:]
        if more:
            lines.append(f"| {name} | {len(more)} other kernels "
                         f"| {sum(r['launches'] for r in more):g} "
                         f"| {sum(r['us'] for r in more):.1f} "
                         f"| {100 * sum(r['share'] for r in more):.1f}% |")
        # The rest's kernels lie before the forward's (the inputs' copies) and after it:
        # only the forward's span says how long the device took for one section.
        span = (f" (span {s['span_us']:.0f} us, idle {s['idle_us']:.0f} us inside it)"
                if name == "forward" else "")
        lines.append(f"| {name} | **all**{span} | {s['launches']:g} | {s['us']:.1f} "
                     f"| {100 * s['share']:.1f}% |")
    if b["unlinked"]:
        lines.append(f"\n{b['unlinked']:g} kernels a step had no host event: placed by "
                     "their device start.")
    if eager is not None:
        f = eager["sections"]["forward"]
        lines.append(f"\nThe eager forward, for comparison: {f['launches']:g} kernels, "
                     f"{f['us']:.0f} us of kernels over a {f['span_us']:.0f} us span.")
    return "\n".join(lines)
