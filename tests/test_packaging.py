"""The package metadata and the tree: the license, the test extra, a wheel that builds
without warnings and without developer tooling, make test-gpu's optional pytest-xdist,
and benchmarks/ listed in the docs."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _pyproject():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)


def test_license_file_and_spdx_metadata():
    """Regression: pyproject said Apache-2.0 as a (deprecated) table and no LICENSE
    file shipped."""
    project = _pyproject()["project"]
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
    with open(os.path.join(ROOT, "LICENSE")) as f:
        text = f.read()
    assert re.match(r"\s*Apache License\s+Version 2.0, January 2004", text)
    assert "END OF TERMS AND CONDITIONS" in text


def test_test_extra_has_what_make_test_gpu_uses():
    assert any(r.startswith("pytest-xdist") for r in
               _pyproject()["project"]["optional-dependencies"]["test"])
    with open(os.path.join(ROOT, "Makefile")) as f:
        makefile = f.read()
    # -n only where xdist imports: the GPU machine's python may lack it.
    assert 'XDIST = $(shell $(GPU_PY) -c "import xdist"' in makefile
    assert re.search(r"^test-gpu:\n\t.*\$\(GPU_PY\) -m pytest .*\$\(XDIST\)", makefile,
                     re.M)


def test_wheel_builds_without_warnings(tmp_path):
    """Regression: setuptools warned three times that project.license is a table."""
    setuptools = pytest.importorskip("setuptools")
    if int(setuptools.__version__.split(".")[0]) < 77:
        pytest.skip("the build requires setuptools>=77 (license-files)")
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(os.path.join(ROOT, name), tmp_path)
    shutil.copytree(os.path.join(ROOT, "flashtile"), tmp_path / "flashtile",
                    ignore=shutil.ignore_patterns("__pycache__"))
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                           "--no-build-isolation", "-w", str(tmp_path / "dist"), "."],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    log = done.stdout + done.stderr
    assert done.returncode == 0, log
    assert not re.search(r"\w+Warning\b", log), log  # setuptools' warnings, not pip's notes
    (wheel,) = (tmp_path / "dist").iterdir()
    assert wheel.name == "flashtile-0.1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
    assert "flashtile/demo.py" in names
    assert "flashtile-0.1.0.dist-info/licenses/LICENSE" in names
    # Developer tooling stays out of the installed package (it was flashtile/ops/aot.py).
    assert not [n for n in names if "aot" in n or n.startswith(("tests/", "benchmarks/"))]


def test_every_benchmark_script_is_listed_in_the_docs():
    """benchmarks/ holds what a user or reviewer runs, each with a line in
    docs/benchmarks/README.md; the retired study scripts are in NOTES.md section 13."""
    scripts = sorted(f for f in os.listdir(os.path.join(ROOT, "benchmarks"))
                     if f.endswith(".py"))
    with open(os.path.join(ROOT, "docs", "benchmarks", "README.md")) as f:
        listed = re.findall(r"^- `benchmarks/(\w+\.py)`: ", f.read(), re.M)
    assert scripts == sorted(listed) == ["bench_attention.py", "cpu_vs_sdpa.py",
                                       "gemm_probe.py", "ring_scaling.py"]
