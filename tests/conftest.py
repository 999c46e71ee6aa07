import os

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


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
