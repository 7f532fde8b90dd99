"""A CMake build tree of the torch extension (-DFUSEDCE_TORCH=ON) made importable without
installing it, for the tests and the scripts that run them: a folder holding a package
`fusedce` whose entries link to this checkout's python/fusedce and whose extension and build
facts link to <build dir>/torch. Put the folder first on PYTHONPATH. The package itself reads no
environment variable; the tests' conftest.py calls this when FUSEDCE_BUILD_DIR names a build.

    PYTHONPATH=$(python tests/python/build_tree.py BUILD_DIR [OUT]) python -m fusedce.bench ...
    (OUT: the folder, default BUILD_DIR/python; printed)
"""

import os
import runpy
import sys
from pathlib import Path

SOURCE = Path(__file__).resolve().parents[2] / "python" / "fusedce"


def package_folder(build_dir, out=None):
    """Lays out OUT/fusedce (links, replaced where they point elsewhere) and returns OUT."""
    built = Path(build_dir).resolve() / "torch"
    info = built / "_build_info.py"
    if not info.exists():
        raise FileNotFoundError(f"{info} is missing: configure {build_dir} with -DFUSEDCE_TORCH=ON and build it")
    from_build = {"_build_info.py", runpy.run_path(str(info))["library"]}
    out = Path(out) if out is not None else Path(build_dir) / "python"
    package = out.resolve() / "fusedce"
    package.mkdir(parents=True, exist_ok=True)
    sources = [p for p in SOURCE.iterdir() if p.name != "__pycache__" and p.name not in from_build]
    for target in sources + [built / name for name in from_build]:
        link = package / target.name
        if link.is_symlink() and os.readlink(link) == str(target):
            continue
        if link.is_symlink() or link.exists():
            link.unlink()
        try:
            link.symlink_to(target)
        except FileExistsError:  # another process laid out the same folder meanwhile
            pass
    return out.resolve()


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3):
        sys.exit(__doc__)
    print(package_folder(*sys.argv[1:]))
