"""Loads the fusedce torch extension (a library of torch ops, no Python module of its own)."""

import os

import torch

try:
    from . import _build_info
except ImportError as e:  # a source tree that was never built
    raise ImportError(
        "fusedce: the torch extension is not built; install the package with "
        "`pip install --no-build-isolation .` (or `-e .`) in an environment that has torch"
    ) from e

with_cuda = _build_info.with_cuda
"""True when the extension has CUDA kernels (nvcc was found and torch had CUDA at build time)."""

built_with_torch = _build_info.torch_version
"""The torch version the extension was compiled against."""


def _major_minor(version):
    return tuple(version.split("+")[0].split(".")[:2])


def _find_library():
    import fusedce

    for directory in list(fusedce.__path__) + [os.path.dirname(_build_info.__file__)]:
        path = os.path.join(directory, _build_info.library)
        if os.path.exists(path):
            return path
    raise ImportError(f"fusedce: {_build_info.library} not found next to the package")


def load():
    if _major_minor(torch.__version__) != _major_minor(built_with_torch):
        # torch's C++ ABI changes between minor versions: a mismatch would crash, not fail.
        raise ImportError(
            f"fusedce was built against torch {built_with_torch} but torch {torch.__version__} "
            "is installed; rebuild it (`pip install --no-build-isolation --force-reinstall .`)"
        )
    torch.ops.load_library(_find_library())
