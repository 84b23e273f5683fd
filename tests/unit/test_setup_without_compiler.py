"""setup.py on a machine without a C++ compiler: the build succeeds and installs no kernels (pagedllm then runs on
plain torch: tests/model/test_kernel_loading.py), rather than failing the install."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
def test_build_without_a_compiler_installs_no_kernels(tmp_path: Path) -> None:
    shutil.copy(ROOT / "setup.py", tmp_path / "setup.py")
    shutil.copytree(ROOT / "pagedllm" / "csrc", tmp_path / "pagedllm" / "csrc")
    env = dict(os.environ, CXX="/nonexistent/c++", CC="/nonexistent/cc")
    proc = subprocess.run(
        [sys.executable, "setup.py", "build_ext", "--inplace"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "no C++ compiler" in proc.stderr
    assert not list((tmp_path / "pagedllm").glob("*.so"))
