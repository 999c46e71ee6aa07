"""conftest.py's worker guard: under pytest-xdist, a test that leaves the process's CUDA
context broken ends its worker, so the worker's remaining tests run in a fresh one
instead of erroring one by one. On CPU the broken context is simulated: a test leaves a
file named after its process, and the guard's probe looks for it."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("xdist")

CONFTEST = Path(__file__).with_name("conftest.py")

INNER_CONFTEST = f'''
import importlib.util
import os

spec = importlib.util.spec_from_file_location("flashtile_conftest", {str(CONFTEST)!r})
guard = importlib.util.module_from_spec(spec)
spec.loader.exec_module(guard)
if os.environ.get("GUARD_PROBE") == "file":
    guard._cuda_context_broken = lambda: os.path.exists(f"broken-{{os.getpid()}}")
else:  # the control: a probe that never finds the context broken
    guard._cuda_context_broken = lambda: False
pytest_runtest_makereport = guard.pytest_runtest_makereport
pytest_runtest_protocol = guard.pytest_runtest_protocol
'''

INNER_TESTS = '''
import os

import pytest


def test_0_breaks_the_context():
    open(f"broken-{os.getpid()}", "w").close()
    assert False, "a kernel faulted"


@pytest.mark.parametrize("i", range(6))
def test_later(i):
    assert not os.path.exists(f"broken-{os.getpid()}"), "ran in the broken process"
'''


def _run(tmp_path, probe):
    (tmp_path / "conftest.py").write_text(INNER_CONFTEST)
    (tmp_path / "test_inner.py").write_text(INNER_TESTS)
    env = dict(os.environ, GUARD_PROBE=probe)
    # One worker: every test of the file is on it, after the breaking one.
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "-n", "1", "-p", "xdist", "test_inner.py"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=300)


def test_broken_context_hands_the_rest_to_a_fresh_worker(tmp_path):
    run = _run(tmp_path, "file")
    out = run.stdout + run.stderr
    assert run.returncode == 1, out
    assert "crashed while running 'test_inner.py::test_0_breaks_the_context'" in out, out
    assert "6 passed" in out and "test_later" not in out.split("short test summary")[-1]


def test_without_a_broken_context_the_worker_goes_on(tmp_path):
    """The control: the same run with a probe that finds nothing loses every later test
    to the broken process, as the GPU suite did before the guard."""
    run = _run(tmp_path, "never")
    out = run.stdout + run.stderr
    assert "7 failed" in out and "crashed" not in out, out
