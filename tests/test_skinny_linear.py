"""engine/skinny_linear.py: every prologue and epilogue against the unfused PyTorch ops.

On CPU through the Triton interpreter (float32, float16: it computes bfloat16 wrongly);
with --gpu on CUDA, bfloat16 too, the 0.5B shapes, launch plans and a CUDA graph. The
accuracy rule of STYLE.md: the error against the float64 reference at most twice
PyTorch's own at the same dtype, plus a floor of one unit in the dtype's last place.
The sm_90 compile of a few variants is in tests/test_sm90_compile.py.
"""

import pytest
import torch

from flashtile.engine import skinny_linear as sl
from flashtile.engine.skinny_linear import skinny_linear, skinny_linear_reference
from flashtile.ops import configs
from tests.conftest import triton_available_here

# (prologue, with norm_residual): the four prologues the engine would call.
PROLOGUES = {"none": (None, False), "rmsnorm": ("rmsnorm", False),
             "add_rmsnorm": ("rmsnorm", True), "silu_mul": ("silu_mul", False)}
EPILOGUES = {"plain": (False, False), "bias": (True, False), "residual": (False, True),
             "bias_residual": (True, True)}
CPU_DTYPES = [torch.float32, torch.float16]
GPU_DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@pytest.fixture
def runs_triton(on_gpu):
    if not triton_available_here(on_gpu):
        pytest.skip("Triton on CPU needs TRITON_INTERPRET=1 (set by make test)")


@pytest.fixture
def tiles():
    """configs.set_override for the skinny kernel, removed after the test."""
    yield lambda cfg: configs.set_override("skinny_linear", cfg)
    configs.set_override("skinny_linear", None)


def make_inputs(m, n, k, dtype, device, prologue="none", epilogue="plain"):
    """Arguments of skinny_linear: W scaled by 1/sqrt(K) so y is O(1), a bias and
    residual of O(1) (an epilogue applied twice or not at all is then an O(1) error)."""
    name, add = PROLOGUES[prologue]
    has_bias, has_residual = EPILOGUES[epilogue]
    mk = lambda *shape, scale=1.0: (torch.randn(*shape, device=device) * scale).to(dtype)
    kw = dict(prologue=name)
    x = mk(m, 2 * k if name == "silu_mul" else k)
    if name == "rmsnorm":
        kw.update(norm_weight=mk(k, scale=0.5) + 1, eps=1e-5)
        if add:
            kw["norm_residual"] = mk(m, k)
    if has_bias:
        kw["bias"] = mk(n)
    if has_residual:
        kw["residual"] = mk(m, n)
    return x, mk(n, k, scale=k ** -0.5), kw


def _float64(kw):
    return {k: v.double() if isinstance(v, torch.Tensor) else v for k, v in kw.items()}


def check_against_reference(x, w, kw):
    """ours vs float64 within 2x torch's error at the dtype plus one unit in the last
    place (the float64 reference's RMSNorm statistics are fp32, as engine/layernorm.py's
    reference computes them); the x + norm_residual output, a plain rounded add,
    exactly."""
    ours = skinny_linear(x, w, **kw)
    torch_out = skinny_linear_reference(x, w, **kw)
    exact = skinny_linear_reference(x.double(), w.double(), **_float64(kw))
    if isinstance(ours, tuple):
        assert torch.equal(ours[1], torch_out[1])
        assert ours[1].is_contiguous()
        ours, torch_out, exact = ours[0], torch_out[0], exact[0]
    assert ours.dtype == x.dtype and ours.shape == exact.shape and ours.is_contiguous()
    err = (ours.double() - exact).abs().max().item()
    err_torch = (torch_out.double() - exact).abs().max().item()
    floor = torch.finfo(x.dtype).eps * exact.abs().max().item()
    assert err <= 2 * err_torch + floor, (err, err_torch, floor)
    return ours


@pytest.mark.parametrize("m", [1, 3, 16, 64])
@pytest.mark.parametrize("epilogue", list(EPILOGUES))
@pytest.mark.parametrize("prologue", list(PROLOGUES))
@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
def test_every_combination(runs_triton, device, dtype, prologue, epilogue, m):
    """Each prologue x epilogue at the decode batch sizes, K 96 (three steps of the
    interpreter's 32), N 40 (three column tiles, the last partly masked)."""
    x, w, kw = make_inputs(m, 40, 96, dtype, device, prologue, epilogue)
    check_against_reference(x, w, kw)


@pytest.mark.parametrize("n,k", [(40, 224), (72, 96), (130, 224), (128, 896)],
                         ids=lambda v: str(v))
@pytest.mark.parametrize("prologue,epilogue", [("add_rmsnorm", "bias"),
                                               ("silu_mul", "residual"),
                                               ("none", "residual")])
@pytest.mark.parametrize("m", [1, 16, 64])
@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
def test_shapes(runs_triton, device, dtype, m, prologue, epilogue, n, k):
    """Non-powers of two like the real widths (N 130: a 2-column last tile), and
    K 896, the 0.5B shape's hidden size."""
    x, w, kw = make_inputs(m, n, k, dtype, device, prologue, epilogue)
    check_against_reference(x, w, kw)


SPLITS = [configs.SkinnyConfig(16, 32, 2), configs.SkinnyConfig(16, 32, 3),
          configs.SkinnyConfig(32, 32, 7), configs.SkinnyConfig(16, 64, 2, 4, 2)]


@pytest.mark.parametrize("cfg", SPLITS,
                         ids=lambda c: f"n{c.block_n}k{c.block_k}s{c.split_k}")
@pytest.mark.parametrize("prologue,epilogue", [("add_rmsnorm", "bias_residual"),
                                               ("silu_mul", "bias_residual"),
                                               ("none", "residual")])
@pytest.mark.parametrize("m", [1, 5, 64])
@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
def test_split_k(runs_triton, device, tiles, dtype, m, prologue, epilogue, cfg):
    """The reduction split over programs: the bias and residual added once (by the last
    program of each column tile), every split's partial summed, x + norm_residual
    written once per element by the first column tile's splits. K 224 is 7 steps of 32:
    split 3 leaves the last split one step; 7 splits at BLOCK_K 32 one step each."""
    tiles(cfg)
    x, w, kw = make_inputs(m, 72, 224, dtype, device, prologue, epilogue)
    check_against_reference(x, w, kw)


@pytest.mark.parametrize("split", [1, 2], ids=["whole_k", "split2"])
@pytest.mark.parametrize("prologue,epilogue", [("add_rmsnorm", "bias_residual"),
                                               ("rmsnorm", "bias"),
                                               ("silu_mul", "bias_residual"),
                                               ("none", "residual")])
@pytest.mark.parametrize("m", [65, 100, 256])
@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
def test_row_tiles(runs_triton, device, tiles, dtype, m, prologue, epilogue, split):
    """Past 64 rows, tiles of 64 along a grid dimension: 65 (a last tile of one row),
    100, 256 (four full tiles). Each row tile normalises its own rows, the first column
    tile's programs write its rows of x + norm_residual (compared exactly: a row tile
    left unwritten or another tile's rows are caught), and a split counts in on its row
    tile's counters (one counter for all the row tiles would let a program sum the
    partials before the other tiles' splits stored theirs). K 96 is three steps of 32:
    split 2 leaves the last split one step."""
    tiles(configs.SkinnyConfig(16, 32, split))
    x, w, kw = make_inputs(m, 40, 96, dtype, device, prologue, epilogue)
    check_against_reference(x, w, kw)


@pytest.mark.parametrize("m", [4, 256])
@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
def test_split_k_is_deterministic_and_leaves_counters_at_zero(runs_triton, device, tiles,
                                                              dtype, m):
    """The last program sums the partials in split order: calls give the same bits;
    each call resets its counters (at 256 rows, those of four row tiles), so the next
    call (another shape too) is right."""
    tiles(configs.SkinnyConfig(16, 32, 3))
    x, w, kw = make_inputs(m, 72, 224, dtype, device, "silu_mul", "bias")
    first = skinny_linear(x, w, **kw)
    assert torch.equal(skinny_linear(x, w, **kw), first)
    counters = sl._workspaces[x.device][1]
    assert not counters.any()
    x2, w2, kw2 = make_inputs(2, 130, 96, dtype, device, "add_rmsnorm", "residual")
    check_against_reference(x2, w2, kw2)
    assert not counters.any()


def test_workspace_is_never_freed(runs_triton, device, tiles, monkeypatch):
    """reserve_workspace sizes the split-K workspace before CUDA graphs capture it: calls
    up to MAX_ROWS rows reuse it (four row tiles take four counters per column tile:
    sized for one, the 256-row call would reallocate). A later call that needs more
    gets a new one, and the old one stays allocated (a graph keeps its address), its
    counters at zero."""
    monkeypatch.setattr(sl, "_workspaces", {})
    monkeypatch.setattr(sl, "_retired", [])
    tiles(configs.SkinnyConfig(16, 32, 3))
    sl.reserve_workspace(device, rows=sl.MAX_ROWS, n=72)
    first = sl._workspaces[torch.device(device)]
    for m in (4, sl.MAX_ROWS):
        x, w, kw = make_inputs(m, 72, 224, torch.float32, device, "silu_mul", "bias")
        check_against_reference(x, w, kw)
        assert sl._workspaces[torch.device(device)] is first
    x, w, kw = make_inputs(sl.MAX_ROWS, 130, 224, torch.float32, device, "add_rmsnorm",
                           "residual")
    check_against_reference(x, w, kw)
    assert sl._retired == [first] and sl._workspaces[torch.device(device)] is not first
    assert not first[1].any()


@pytest.mark.parametrize("dtype", [torch.float16, pytest.param(torch.bfloat16,
                                                               marks=pytest.mark.gpu)],
                         ids=str)
def test_prologue_rounding_matches_eager(runs_triton, device, dtype):
    """With W the identity (each output one product, exact in fp32) y is the prologue's
    own 16-bit output: bit for bit the unfused ops' (the norm's cast before the weight
    multiply, silu rounded before the multiply by up), but for the last-place
    differences of exp, rsqrt and the order of the sum of squares that the module
    docstring allows, which must stay rare (fp32 shows that order in its last bit on
    6% of the elements: not a test of the 16-bit roundings)."""
    k = 96
    w = torch.eye(k, device=device, dtype=dtype)
    for prologue in ("rmsnorm", "add_rmsnorm", "silu_mul"):
        x, _, kw = make_inputs(16, k, k, dtype, device, prologue)
        ours = skinny_linear(x, w, **kw)
        ref = skinny_linear_reference(x, w, **kw)
        if isinstance(ours, tuple):
            ours, ref = ours[0], ref[0]
        differ = ours != ref
        ulp = torch.finfo(dtype).eps * ref.abs().float()
        assert differ.float().mean() <= 0.01, (prologue, differ.sum().item())
        assert ((ours.float() - ref.float()).abs() <= ulp)[differ].all(), prologue


def test_reference_is_the_engine_sequence():
    """skinny_linear_reference is what engine/model.py's modules compute on CPU (their
    PyTorch path): RMSNorm with its residual add, then F.linear; the MLP's
    SiLU-and-multiply, then F.linear."""
    from flashtile.engine import model

    torch.manual_seed(1)
    fused = model.ELEMENTWISE["triton"]  # on CPU tensors: the PyTorch references
    for dtype in (torch.float32, torch.bfloat16):
        x, w, kw = make_inputs(3, 24, 32, dtype, "cpu", "add_rmsnorm", "bias")
        norm = model.RMSNorm(32, kw["eps"], fused).to(dtype)
        norm.weight.data.copy_(kw["norm_weight"])
        h, x_sum = norm(x, kw["norm_residual"])
        y, ref_sum = skinny_linear_reference(x, w, **kw)
        assert torch.equal(ref_sum, x_sum)
        assert torch.equal(y, torch.nn.functional.linear(h, w, kw["bias"]))
        g = torch.randn(3, 64).to(dtype)
        assert torch.equal(skinny_linear_reference(g, w, prologue="silu_mul"),
                           torch.nn.functional.linear(fused.silu_and_mul(g), w))


def _bad_calls():
    f32 = lambda *s: torch.randn(*s)
    x, w = f32(3, 8), f32(5, 8)
    yield "x: expected a 2-d", ValueError, (f32(3, 1, 8), w), {}
    yield r"x\.shape\[0\]: expected at most 256", ValueError, (f32(257, 8), w), {}
    yield r"x\.shape\[1\]: expected weight\.shape\[1\] = 8", ValueError, (f32(3, 9), w), {}
    yield r"x\.shape\[1\]: expected 2 \* weight\.shape\[1\]", ValueError, (x, w), \
        dict(prologue="silu_mul")
    yield r"weight\.shape\[1\]: expected at least 1", ValueError, (f32(3, 0), f32(5, 0)), {}
    yield r"bias: expected shape \(5,\)", ValueError, (x, w), dict(bias=f32(4))
    yield r"residual: expected shape \(3, 5\)", ValueError, (x, w), dict(residual=f32(5, 3))
    yield "norm_weight: expected a", ValueError, (x, w), dict(prologue="rmsnorm")
    yield r"norm_weight: expected shape \(8,\)", ValueError, (x, w), \
        dict(prologue="rmsnorm", norm_weight=f32(9))
    yield "norm_weight: expected None unless", ValueError, (x, w), dict(norm_weight=f32(8))
    yield "norm_residual: expected None unless", ValueError, (f32(3, 16), w), \
        dict(prologue="silu_mul", norm_residual=f32(3, 8))
    yield r"norm_residual: expected shape \(3, 8\)", ValueError, (x, w), \
        dict(prologue="rmsnorm", norm_weight=f32(8), norm_residual=f32(8))
    yield r"weight\.dtype: expected x's dtype torch\.float32", TypeError, \
        (x, w.half()), {}
    yield r"bias\.dtype: expected x's dtype", TypeError, (x, w), dict(bias=f32(5).double())
    yield r"x\.dtype: expected float16, bfloat16 or float32", TypeError, \
        (x.long(), w.long()), {}
    yield r"weight\.stride\(-1\): expected 1", ValueError, (x, f32(8, 5).t()), {}
    yield "weight: expected a torch.Tensor", TypeError, (x, [[1.0]]), {}
    yield "prologue: expected one of", ValueError, (x, w), dict(prologue="gelu")


@pytest.mark.parametrize("match,error,args,kw", list(_bad_calls()),
                         ids=lambda v: v if isinstance(v, str) else None)
def test_bad_input(match, error, args, kw):
    """Each mistake raises before any launch, naming the argument and the fix's
    expectation (CPU tensors: no kernel could run)."""
    with pytest.raises(error, match=match):
        skinny_linear(*args, **kw)


def test_bfloat16_is_refused_in_the_interpreter(monkeypatch, on_gpu):
    if on_gpu:
        pytest.skip("CPU tensors only")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    x, w = torch.randn(2, 8, dtype=torch.bfloat16), torch.randn(4, 8, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match=r"x\.dtype: expected float32 or float16 while"):
        skinny_linear(x, w)


def test_cpu_without_the_interpreter_points_to_the_reference(monkeypatch, on_gpu):
    if on_gpu:
        pytest.skip("CPU tensors only")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="skinny_linear_reference"):
        skinny_linear(torch.randn(2, 8), torch.randn(4, 8))


# ---- GPU: bfloat16, the engine's shapes, launch plans, CUDA graphs ----

# Qwen2.5-0.5B's layer (hidden 896, intermediate 4864, 14/2 heads of 64): (N, K).
SHAPES_05B = {"qkv": (1152, 896), "o": (896, 896), "gate_up": (9728, 896),
              "down": (896, 4864)}
ENGINE_CALLS = {"qkv": ("add_rmsnorm", "bias"), "o": ("none", "residual"),
                "gate_up": ("add_rmsnorm", "plain"), "down": ("silu_mul", "plain")}


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 4, 16, 64, 128, 256])
@pytest.mark.parametrize("op", list(SHAPES_05B))
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
def test_gpu_engine_shapes(dtype, op, m):
    """The 0.5B layer's four products at the table's tiles (down splits K at M <= 64;
    past 64 rows, in row tiles, every product but gate_up at 256 rows splits K)."""
    n, k = SHAPES_05B[op]
    x, w, kw = make_inputs(m, n, k, dtype, "cuda", *ENGINE_CALLS[op])
    check_against_reference(x, w, kw)


def _outputs(result):
    """skinny_linear's y, or y and x + norm_residual, as a tuple."""
    return (result,) if isinstance(result, torch.Tensor) else result


@pytest.mark.gpu
@pytest.mark.parametrize("op", list(SHAPES_05B))
def test_gpu_plan_replays_the_first_launch(op):
    """The second call of a layout goes through its launch plan: new inputs, the
    result the first call's path gives (bit for bit), the workspace of a split reused."""
    from flashtile.ops import _launch

    n, k = SHAPES_05B[op]
    x, w, kw = make_inputs(3, n, k, torch.bfloat16, "cuda", *ENGINE_CALLS[op])
    skinny_linear(x, w, **kw)
    x2 = torch.randn_like(x)
    plans = len(_launch._plans)
    via_plan = skinny_linear(x2, w, **kw)
    assert len(_launch._plans) == plans
    previous = _launch.set_enabled(False)
    try:
        direct = skinny_linear(x2, w, **kw)
    finally:
        _launch.set_enabled(previous)
    assert all(map(torch.equal, _outputs(via_plan), _outputs(direct)))


@pytest.mark.gpu
@pytest.mark.parametrize("m", [2, 256])
def test_gpu_cuda_graph_replay(m):
    """Captured after a warm-up call (as the engine's graphs are), replayed over new
    inputs copied in: the down projection (split K) and the fused norm + qkv (split K
    too at 256 rows, over four row tiles)."""
    calls = {op: make_inputs(m, *SHAPES_05B[op], torch.bfloat16, "cuda", *ENGINE_CALLS[op])
             for op in ("down", "qkv")}
    for x, w, kw in calls.values():
        skinny_linear(x, w, **kw)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = {op: skinny_linear(x, w, **kw) for op, (x, w, kw) in calls.items()}
    for x, _, kw in calls.values():
        x.copy_(torch.randn_like(x))
        if "norm_residual" in kw:
            kw["norm_residual"].copy_(torch.randn_like(kw["norm_residual"]))
    graph.replay()
    torch.cuda.synchronize()
    for op, (x, w, kw) in calls.items():
        again = skinny_linear(x, w, **kw)
        assert all(map(torch.equal, _outputs(outs[op]), _outputs(again))), op


# ---- flashtile.bench.skinny on CPU: its shapes, checks and tables ----

def test_bench_shapes_are_the_models_layers():
    from flashtile.bench import skinny

    assert skinny.shapes("qwen2.5-0.5b") == {
        "qkv": (1152, 896, "rmsnorm", True, True, False),
        "o": (896, 896, None, False, False, True),
        "gate_up": (9728, 896, "rmsnorm", True, False, False),
        "down": (896, 4864, "silu_mul", False, False, False)}
    one_b = skinny.shapes("llama-3.2-1b")
    assert one_b["qkv"][:2] == (3072, 2048) and not one_b["qkv"][4]
    assert one_b["down"][:2] == (2048, 8192) and one_b["gate_up"][:2] == (16384, 2048)


def test_bench_checks_each_provider(runs_triton, on_gpu):
    """The bench's providers at a small shape through the interpreter (fp32): each
    passes the check it runs before timing; a wrong one (the bias twice) fails it."""
    if on_gpu:
        pytest.skip("the CPU form of the bench's checks")
    from flashtile.bench import skinny

    for op_shape in ((72, 96, "rmsnorm", True, True, False), (40, 96, "silu_mul", False,
                                                                False, True)):
        kw, weights = skinny.make_call(op_shape, 3, "cpu", dtype=torch.float32)
        w = weights()
        fns = skinny.providers(kw)
        unfused = fns["unfused"](w)
        for name, fn in fns.items():
            skinny.check(name, fn, w, kw, unfused)
    kw, weights = skinny.make_call((72, 96, None, False, True, False), 2, "cpu",
                                   dtype=torch.float32)
    w = weights()
    fns = skinny.providers(kw)
    wrong = lambda w: fns["fused"](w) + w["bias"]
    with pytest.raises(RuntimeError, match="fused: max error"):
        skinny.check("fused", wrong, w, kw, fns["unfused"](w))


def test_bench_tables():
    """The markdown: a line per row; a layer's sum once its four products are timed
    (o counted as F.linear / plain), with the weight bytes at the copy bandwidth."""
    from flashtile.bench import skinny

    rows = []
    for op, (unfused, fused, linear, plain) in {"qkv": (6, 3, 5, 2.5), "o": (5, 2, 4, 2),
                                                "gate_up": (9, 5, 7, 4.5),
                                                "down": (8, 4, 7, 3.5)}.items():
        rows.append(dict(model="m", op=op, m=1, n=8, k=8, weight_mb=1.0,
                         unfused=dict(us=unfused), fused=dict(us=fused, gbps=500),
                         linear=dict(us=linear), plain=dict(us=plain)))
    rows.append(dict(model="m", op="qkv", m=4, n=8, k=8, weight_mb=1.0,
                     fused=dict(error="RuntimeError: x")))
    table = skinny.markdown(rows, copy_gbps=4000)
    assert "| m | o | 1 | 8 x 8 | 1.0 | 5.00 | 2.00 | 0.40 | 500 | 12% |" in table
    assert "| m | 1 | 27.00 | 14.00 | 0.52 | 1.00 |" in table
    assert "| m | qkv | 4 | 8 x 8 | 1.0 | n/a | n/a | n/a | n/a | n/a |" in table
    assert list(skinny.layer_sums(rows)) == [("m", 1)]
