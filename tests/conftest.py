import os
import sys
import time

import pytest
import torch


def pytest_addoption(parser):
    parser.addoption("--gpu", action="store_true",
                     help="run the suite on CUDA with fp16/bf16 and larger shapes")


def pytest_configure(config):
    # CI runs pytest with TRITON_INTERPRET=1 so the Triton kernels run on CPU tensors.
    if config.getoption("--gpu") and not torch.cuda.is_available():
        raise pytest.UsageError("--gpu given but torch sees no CUDA device")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--gpu"):
        return
    skip = pytest.mark.skip(reason="GPU only: run with --gpu (make test-gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def on_gpu(request):
    return request.config.getoption("--gpu")


@pytest.fixture(scope="session")
def device(on_gpu):
    return torch.device("cuda" if on_gpu else "cpu")


def triton_available_here(on_gpu):
    return on_gpu or os.environ.get("TRITON_INTERPRET") == "1"


@pytest.fixture(params=["torch", "triton"])
def backend(request, monkeypatch, on_gpu):
    """Run a test on each backend: the tiled PyTorch path (CPU only) and the Triton
    kernels (on the GPU, or on CPU through the interpreter). A test may also name
    "triton-fused" (indirect parametrization): the Triton kernels with the fused
    backward (FLASHTILE_BWD=fused); "triton" pins the split one."""
    if request.param == "torch" and on_gpu:
        pytest.skip("GPU runs the Triton kernels")
    if request.param != "torch" and not triton_available_here(on_gpu):
        pytest.skip("Triton on CPU needs TRITON_INTERPRET=1 (set by make test)")
    monkeypatch.setenv("FLASHTILE_BACKEND", request.param.split("-")[0])
    monkeypatch.setenv("FLASHTILE_BWD", "fused" if request.param == "triton-fused"
                       else "split")
    return request.param


@pytest.fixture
def index_checks():
    """flashtile.set_index_checks(True) for one test: bad index values raise ValueError
    (without it the kernels turn them into NaN rows)."""
    import flashtile

    previous = flashtile.set_index_checks(True)
    yield
    flashtile.set_index_checks(previous)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


# A test that breaks its process's CUDA context (an illegal instruction or address is
# sticky: every later CUDA call of the process fails; a deadlocked kernel holds the GPU
# for good) ends its pytest-xdist worker once its reports are sent: xdist then names it
# as the test the worker crashed in and hands the worker's remaining tests to a fresh
# one. Without this, each later test of that worker errors at setup (session 20's
# check: 2,270 tests of one worker lost to one faulting kernel). Serial runs (memcheck)
# are left as they are.
_FAILED = pytest.StashKey[bool]()


def _cuda_context_broken(wait_s: float = 10.0) -> bool:
    """Whether this process's CUDA context is unusable (checked after a failed test): a
    sticky fault, or work still running after ``wait_s`` (a kernel that deadlocked,
    which a blocking synchronize would wait on forever)."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return False
    deadline = time.monotonic() + wait_s
    try:
        while not torch.cuda.current_stream().query():
            if time.monotonic() > deadline:
                return True
            time.sleep(0.01)
        torch.cuda.synchronize()
    except RuntimeError:  # torch.AcceleratorError is one; it names the fault
        return True
    return False


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    if outcome.get_result().failed:
        item.stash[_FAILED] = True


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    yield
    # Inside the protocol, before xdist reports it complete: the controller blames this
    # test for the crash (not the next one) and reschedules the rest.
    if item.stash.get(_FAILED, False) and os.environ.get("PYTEST_XDIST_WORKER") \
            and _cuda_context_broken():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(3)
