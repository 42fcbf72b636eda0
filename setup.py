"""The native CPU kernels, built when the project is installed (a wheel or `pip install -e .`).

A serving node needs no compiler and runs only code that its installed image contains. The library is
built for x86-64-v4 (AVX-512 F/BW/CD/DQ/VL over AVX2 and FMA) rather than this machine's `-march=native`,
so a wheel built on one AVX-512 CPU serves on any other; at start the node checks the CPU's flags before it
calls into it (`node/engine/cpu_kernels.py`). The extension is optional: where it cannot be built (no C++
compiler, not x86-64), the install still succeeds and the node serves with transformers' forward.

It is a plain shared library loaded through ctypes, not a Python module: it defines no PyInit function.
"""

from setuptools import Extension, setup

KERNEL_FLAGS = ["-O3", "-march=x86-64-v4", "-mtune=generic", "-std=c++17"]
"""Also what `scripts/kernel_ab.py`'s builds must use, so that an A/B measures what the node runs."""

setup(ext_modules=[Extension("node.engine._cpu_kernels", sources=["node/engine/kernels/cpu_kernels.cpp"],
                             extra_compile_args=KERNEL_FLAGS, language="c++", optional=True)])
