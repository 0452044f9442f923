"""Packaging: the sdist builds, a wheel built from it installs into a fresh venv, and both
commands run from there.

SLOW (~30-60 s: it compiles the hot path once) and offline: the build runs without isolation
in this venv (setuptools and Cython are already here), the fresh venv gets only our wheel, and
for running the commands it borrows this venv's dependencies through a .pth file instead of
downloading them. The fresh venv's own site-packages comes first on its path, so the `router`
it imports is the installed one (asserted).
"""

from __future__ import annotations

import subprocess
import sys
import sysconfig
import tarfile
import venv
import zipfile
from pathlib import Path

import pytest

import router

ROOT = Path(__file__).resolve().parent.parent
BUILD_TIMEOUT_S = 240


def _run(*cmd, cwd: Path) -> str:
    done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    assert done.returncode == 0, f"{cmd} failed: {done.stderr[-2000:]}"
    return done.stdout


@pytest.mark.timeout(2 * BUILD_TIMEOUT_S)
def test_sdist_builds_and_installs_into_a_fresh_venv(tmp_path: Path) -> None:
    dist = tmp_path / "dist"
    dist.mkdir()
    name = _run(sys.executable, "-c",
                f"from setuptools import build_meta as b; print(b.build_sdist({str(dist)!r}))", cwd=ROOT)
    sdist = dist / name.strip().splitlines()[-1]
    assert sdist.name == f"hugpy_router-{router.__version__}.tar.gz"
    with tarfile.open(sdist) as tar:
        members = {m.split("/", 1)[1] for m in tar.getnames() if "/" in m}
    assert {"router/_fastpath.pyx", "router/_fastpath_reservations.pxi", "router/_fastpath_stream.pxi",
            "router/_fastpath_body.pxi", "setup.py", "README.md", "router/store/schema/0001_router.sql"} <= members
    assert "router/_fastpath.c" not in members

    _run(sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
         "-w", str(dist), str(sdist), cwd=tmp_path)
    wheel = next(dist.glob("hugpy_router-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert any(n.startswith("router/_fastpath") and n.endswith(".so") for n in names)
    assert not [n for n in names if n.endswith((".pyx", ".pxi", ".c"))]
    metadata = zipfile.ZipFile(wheel).read(
        f"hugpy_router-{router.__version__}.dist-info/METADATA").decode()
    for field in ("License-Expression:", "Requires-Python: >=3.11", "Classifier:", "Project-URL:",
                  "Description-Content-Type: text/markdown"):
        assert field in metadata

    fresh = tmp_path / "fresh"
    venv.create(fresh, with_pip=False)
    python = fresh / "bin" / "python"
    _run(sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", "--no-deps",
         str(wheel), cwd=tmp_path)
    site = Path(_run(str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))",
                     cwd=tmp_path).strip())
    (site / "zz_borrowed_deps.pth").write_text(sysconfig.get_path("purelib") + "\n")

    for command in ("hugpy-router", "router"):
        out = _run(str(fresh / "bin" / command), "--version", cwd=tmp_path)
        assert out.split() == [command, router.__version__]
    where = _run(str(python), "-c",
                 "import router, router._fastpath as f, importlib.metadata as m;"
                 "print(f.__file__); print(m.version('hugpy-router'))", cwd=tmp_path).split()
    assert where[0].startswith(str(site)) and where[1] == router.__version__
