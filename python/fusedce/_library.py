"""Loads the fusedce torch extension (a library of torch ops, no Python module of its own) and
the facts of its build (_build_info.py, written by torch/CMakeLists.txt beside the library)."""

import importlib.util
import os
import sys

import torch


def _locate():
    """The first directory of the package's search path that holds a build: the installed
    package, the install of an editable checkout, or a CMake build tree's folder laid out by
    tests/python/build_tree.py."""
    package = sys.modules[__name__.rpartition(".")[0]]  # fusedce, or the Kernels Hub's copy

    for directory in package.__path__:
        path = os.path.join(directory, "_build_info.py")
        if os.path.exists(path):
            spec = importlib.util.spec_from_file_location(package.__name__ + "._build_info", path)
            info = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(info)
            return info, os.path.join(directory, info.library)
    raise ImportError(
        "fusedce: the torch extension is not built; install the package with "
        "`pip install --no-build-isolation .` (or `-e .`) in an environment that has torch, or "
        "run from a CMake build directory configured with -DFUSEDCE_TORCH=ON through "
        "`PYTHONPATH=$(python tests/python/build_tree.py <build dir>)`")


_info, _path = _locate()

with_cuda = _info.with_cuda
"""True when the extension has CUDA kernels (nvcc was found and torch had CUDA at build time)."""

cpu_blas = getattr(_info, "cpu_blas", "none")
"""The library behind the CPU linear path's matrix products: "OpenBLAS", or "none" (the core's
own tile products, when the build found no OpenBLAS)."""

built_with_torch = _info.torch_version
"""The torch version the extension was compiled against."""

namespace = getattr(_info, "namespace", "fusedce")
"""The ops' namespace: torch.ops.<namespace> (torch/ops_namespace.h)."""


def qualified(name):
    """An op's qualified name, "<namespace>::<name>", as torch.library takes it."""
    return f"{namespace}::{name}"


def ops():
    """torch.ops.<namespace>, once load() has run."""
    return getattr(torch.ops, namespace)


def _major_minor(version):
    return tuple(version.split("+")[0].split(".")[:2])


def load():
    if _major_minor(torch.__version__) != _major_minor(built_with_torch):
        # torch's C++ ABI changes between minor versions: a mismatch would crash, not fail.
        raise ImportError(
            f"fusedce was built against torch {built_with_torch} but torch {torch.__version__} "
            "is installed; rebuild it (`pip install --no-build-isolation --force-reinstall .`)")
    if not os.path.exists(_path):
        raise ImportError(f"fusedce: {_path} is missing; rebuild the package")
    torch.ops.load_library(_path)
