"""Where does a flashtile call spend its host time? (NOTES.md section 7)

Host microseconds per call on a tiny shape (kernels take a few us): a bare Triton
launch; flash_attn_func forward and forward+backward; the forward with its launch a
no-op; the forward through the custom op and through its launcher; forward+backward
through the custom op's own autograd; the backward launcher alone. Then a cProfile of
forward+backward by own time. (Decode's host cost: profile_decode_host.py.)
Run on the GPU: PYTHONPATH=. python3 benchmarks/launch_cost.py
"""
from types import SimpleNamespace

import torch
import triton

import flashtile
from flashtile import custom_ops
from flashtile.ops import configs
from flashtile.ops.bwd import attn_bwd as bwd_launcher
from flashtile.ops.fwd import attn_fwd as fwd_launcher

from _host_timing import loop_us, print_profile  # benchmarks/_host_timing.py


@triton.jit
def _empty_kernel(X, n):
    pass


def host_us(fn):
    return loop_us(fn)[0]


q, k, v = (torch.randn(1, 128, 2, 64, device="cuda", dtype=torch.bfloat16,
                       requires_grad=True) for _ in range(3))
do = torch.randn_like(q)
qd, kd, vd = q.detach(), k.detach(), v.detach()


def fwd():
    flashtile.flash_attn_func(qd, kd, vd, causal=True)


def fwd_bwd():
    o = flashtile.flash_attn_func(q, k, v, causal=True)
    torch.autograd.grad(o, (q, k, v), do)


print(f"bare Triton launch (2 args): {host_us(lambda: _empty_kernel[(1,)](qd, 1)):.1f} us")
print(f"flash_attn_func fwd: {host_us(fwd):.1f} us")
print(f"flash_attn_func fwd_bwd: {host_us(fwd_bwd):.1f} us")
real = configs.launch
configs.launch = lambda *a, **kw: None
print(f"flash_attn_func fwd, launch stubbed: {host_us(fwd):.1f} us")
configs.launch = real
# The same forward through the flashtile::attn_fwd custom op and through the launcher
# it wraps: the difference is torch's custom-op dispatch (run 11's profile blamed it).
scalars = (0.125, 0, -1, 0, 0.0, False)
print(f"custom op flashtile::attn_fwd: "
      f"{host_us(lambda: custom_ops.attn_fwd(qd, kd, vd, None, None, *scalars)):.1f} us")
launcher = dict(attn_mask=None, alibi_slopes=None, softmax_scale=0.125, diag_offset=0,
                window_left=-1, window_right=0, softcap=0.0, allow_tf32=False)
print(f"launcher flashtile.ops.fwd.attn_fwd: "
      f"{host_us(lambda: fwd_launcher(qd, kd, vd, **launcher)):.1f} us")
# Forward+backward through the custom op's registered autograd (the path eager calls
# took before they skipped the dispatcher) against the eager path above, and the
# backward launcher alone.


def fwd_bwd_op():
    o, _ = custom_ops.attn_fwd(q, k, v, None, None, *scalars)
    torch.autograd.grad(o, (q, k, v), do)


out, lse = fwd_launcher(qd, kd, vd, **launcher)
print(f"fwd_bwd through the custom op's autograd: {host_us(fwd_bwd_op):.1f} us")
print(f"launcher flashtile.ops.bwd.attn_bwd: "
      f"{host_us(lambda: bwd_launcher(do, qd, kd, vd, out, lse, None, **launcher)):.1f} us")


# The autograd engine's own cost per backward, with nothing of flashtile in it: a Python
# Function whose forward is one clone and whose backward returns its gradient, with three
# inputs as flash_attn_func has (run 14: the backward's host time was ~860 us against a
# ~176 us launcher).
class _Identity3(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, c):
        return a.clone()

    @staticmethod
    def backward(ctx, g):
        return g, g, g


def engine_only():
    torch.autograd.grad(_Identity3.apply(q, k, v), (q, k, v), do)


print(f"autograd.grad through a 3-input identity Function: {host_us(engine_only):.1f} us")
# The eager backward's own Python, called directly (no engine), and the whole
# forward+backward with the engine's device threads off (the backward then runs on the
# calling thread): together they split the backward's host time between flashtile's
# code, the engine, and the hand-off to the engine's CUDA worker thread.
ctx = SimpleNamespace(saved_tensors=(qd, kd, vd, out, lse, None, None), scalars=dict(
    softmax_scale=0.125, diag_offset=0, window_left=-1, window_right=0, softcap=0.0,
    allow_tf32=False))
print(f"eager backward called directly: "
      f"{host_us(lambda: custom_ops._backward(ctx, do, None, custom_ops._attn_bwd_impl)):.1f} us")
with torch.autograd.set_multithreading_enabled(False):
    print(f"flash_attn_func fwd_bwd, engine threads off: {host_us(fwd_bwd):.1f} us")
print_profile(fwd_bwd, 200, 18)
