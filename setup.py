"""Builds pagedllm's native CPU kernels at install time (`pip install -e .`, `make setup`).

Two kinds of products, next to the Python package:
* pagedllm/_C: the torch bindings (csrc/cpu/bindings.cpp), built with torch's extension tooling;
* pagedllm/_cpu_<isa> for isa in generic, avx2, avx512, avx512bf16 (x86-64; generic only elsewhere): the kernels
  themselves, the same sources compiled once per instruction set into plain shared libraries with no torch or Python
  in them.
  The bindings pick one at run time from what the CPU has (csrc/cpu/kernels.h says why they are separate files).

Without a working C++ compiler the install still succeeds, without the kernels: pagedllm then runs on plain torch
and says so once in its log. Set PAGEDLLM_SKIP_KERNELS=1 to skip the build on purpose.
"""

from __future__ import annotations

import ctypes.util
import importlib.util
import os
import platform
import shutil
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = os.path.dirname(os.path.abspath(__file__))
CSRC = os.path.join("pagedllm", "csrc", "cpu")
KERNEL_SOURCES = [
    os.path.join(CSRC, f)
    for f in (
        "attention.cpp",
        "elementwise.cpp",
        "linear.cpp",
        "decoder.cpp",
        "quant.cpp",
        "bf16.cpp",
        "sampling.cpp",
        "moe.cpp",
        "ops.cpp",
    )
]
# Every build bakes in the hash of all these sources (the loader checks it), so a change to any of them rebuilds all.
ALL_SOURCES = sorted(os.path.join(CSRC, f) for f in os.listdir(os.path.join(ROOT, CSRC)) if f.endswith((".cpp", ".h")))
ISA_FLAGS = {
    "generic": [],
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-mavx2", "-mfma", "-mf16c"],
    # AVX-512 with VNNI (int8 dot products) and BF16: Zen 4 and 5, Intel from Cooper Lake and Sapphire Rapids.
    "avx512bf16": [
        "-mavx512f",
        "-mavx512bw",
        "-mavx512dq",
        "-mavx512vl",
        "-mavx512vnni",
        "-mavx512bf16",
        "-mavx2",
        "-mfma",
        "-mf16c",
    ],
}


def _source_hash() -> str:
    spec = importlib.util.spec_from_file_location(
        "_pagedllm_source_hash", os.path.join(ROOT, "pagedllm", "csrc", "source_hash.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.source_hash() or "unknown"


def _kernel_extensions() -> list[Extension]:
    x86 = platform.machine() in ("x86_64", "AMD64", "i686")
    cflags = [
        "-O3",
        "-g0",
        "-std=c++17",
        "-fopenmp",
        "-fvisibility=hidden",
        "-fvisibility-inlines-hidden",
        f'-DPAGEDLLM_SOURCE_HASH="{_source_hash()}"',
    ]
    ldflags = ["-fopenmp", "-Wl,-Bsymbolic"]
    if x86 and sys.platform.startswith("linux") and ctypes.util.find_library("mvec"):
        cflags.append("-DPAGEDLLM_LIBMVEC")
        ldflags.append("-lmvec")
    if x86:
        # Scheduling tuned for the CPU that builds (the install builds on the machine that runs): the instruction
        # sets stay those of each ISA build, so a build runs on any CPU that has its ISA.
        cflags.append("-mtune=native")
    isas = list(ISA_FLAGS) if x86 else ["generic"]
    return [
        Extension(
            f"pagedllm._cpu_{isa}",
            sources=KERNEL_SOURCES,
            depends=ALL_SOURCES,
            extra_compile_args=cflags + ISA_FLAGS[isa],
            extra_link_args=ldflags,
            language="c++",
        )
        for isa in isas
    ]


class BuildKernels(build_ext):
    """build_ext for the kernel libraries (each ISA's objects in their own temp folder: they share sources) and the
    torch bindings. No compiler, or one that cannot build them, leaves the package without kernels (pagedllm then
    runs on plain torch) instead of failing the install."""

    def build_extensions(self) -> None:
        cxx = getattr(self.compiler, "compiler_cxx", None) or ["c++"]
        if shutil.which(cxx[0]) is None:
            print(f"pagedllm: no C++ compiler ({cxx[0]}): installing without native kernels", file=sys.stderr)
            self.extensions = []
            return
        self._failed: list[Extension] = []
        self.force = True  # flags live in this file, which the timestamps of the sources do not cover
        super().build_extensions()
        # Whatever failed is not installed (an in-place build would otherwise copy a file that does not exist).
        self.extensions = [ext for ext in self.extensions if ext not in self._failed]

    def build_extension(self, ext: Extension) -> None:
        temp = self.build_temp
        self.build_temp = os.path.join(temp, ext.name)
        try:
            super().build_extension(ext)
        except Exception as exc:  # a compiler that cannot build this: pagedllm runs on plain torch
            print(f"pagedllm: could not build {ext.name} ({exc}); it will run without it", file=sys.stderr)
            self._failed.append(ext)
        finally:
            self.build_temp = temp


def _extensions_and_cmdclass():
    if os.environ.get("PAGEDLLM_SKIP_KERNELS", "0").strip() not in ("", "0"):
        return [], {}
    try:
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError:  # torch is a build requirement (pyproject.toml); without it, no bindings
        return _kernel_extensions(), {"build_ext": BuildKernels}

    class Build(BuildKernels, BuildExtension):
        pass

    bindings = CppExtension(
        "pagedllm._C",
        # shm_allreduce.cpp: the tensor-parallel all-reduce through shared memory (no ISA-specific code: it lives
        # here, not in the kernel libraries; the fused decoder reaches it through a function pointer).
        sources=[os.path.join(CSRC, "bindings.cpp"), os.path.join(CSRC, "shm_allreduce.cpp")],
        depends=ALL_SOURCES,
        # The same source hash as the kernel libraries, so that a stale _C is noticed too (_C.source_hash).
        extra_compile_args=["-O2", "-g0", "-std=c++17", f'-DPAGEDLLM_SOURCE_HASH="{_source_hash()}"'],
        # shm_open lives in librt before glibc 2.34 (an empty stub after)
        libraries=["rt"] if sys.platform.startswith("linux") else [],
    )
    return [bindings, *_kernel_extensions()], {"build_ext": Build.with_options(use_ninja=False)}


ext_modules, cmdclass = _extensions_and_cmdclass()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
