"""The Kernels Hub package: scripts/build_kernels_hub.sh builds the CPU variant with the
project's CMake build (or FUSEDCE_HUB_REPO names a kernel repository already built), the kernels
package parses its build.toml and metadata, selects the variant by its name and loads it with
get_local_kernel, beside the installed fusedce; then hub_checks.py's checks of
fused_linear_cross_entropy and cross_entropy against float64."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fusedce
import hub_checks

kernels = pytest.importorskip("kernels")
from kernels._rust import Backend, Build, Metadata  # noqa: E402
from kernels.variants import get_variants_local, resolve_variant  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def hub_repo():
    given = os.environ.get("FUSEDCE_HUB_REPO")
    if given:
        return Path(given).resolve()
    out = ROOT / "build-hub" / "kernel"
    env = dict(os.environ, FUSEDCE_PYTHON=sys.executable)
    env.pop("FUSEDCE_BUILD_DIR", None)
    done = subprocess.run(["bash", str(ROOT / "scripts" / "build_kernels_hub.sh"), str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def hub(hub_repo):
    return kernels.get_local_kernel(hub_repo, backend="cpu")


def test_build_toml_is_valid_for_kernels():
    build = Build.open(ROOT)
    assert build.general.backends == [Backend.CPU, Backend.CUDA]


# Built by CMake where it finds their dependency, in place of the listed fallback.
_NOT_LISTED = {"src/cpu/gemm_openblas.cpp", "src/cuda/linear/cutlass_products.cu",
               "src/cuda/linear/cutlass_run.h", "src/cuda/linear/window_forward.cu",
               "src/cuda/logprobs/lp_fused_products.cu"}


def test_build_toml_lists_every_source():
    """build.toml's source lists describe the kernel to kernel-builder; a file added to src/ or
    include/ and missing there (or a listed file that is gone) makes them wrong."""
    import tomllib

    with open(ROOT / "build.toml", "rb") as f:
        toml = tomllib.load(f)
    listed = set(toml["torch"]["src"])
    for kernel in toml["kernel"].values():
        listed |= set(kernel["src"])
    sources = {str(p.relative_to(ROOT)) for d in ("src", "include", "torch") for p in (ROOT / d).rglob("*")
               if p.suffix in (".h", ".cpp", ".cu", ".cuh")}
    assert sorted(sources - listed - _NOT_LISTED) == []
    assert sorted(x for x in listed if not (ROOT / x).exists()) == []


def test_variant_is_named_for_this_torch_and_selected(hub_repo):
    major, minor = torch.__version__.split(".")[:2]
    abi = "cxx11" if torch.compiled_with_cxx11_abi() else "cxx98"
    import platform

    name = f"torch{major}{minor}-{abi}-cpu-{platform.machine()}-linux"
    variant, trace = resolve_variant(get_variants_local(hub_repo / "build"), "cpu")
    assert variant is not None and variant.variant_str == name, trace
    metadata = Metadata.read_from_file(hub_repo / "build" / name / "metadata.json")
    assert str(metadata.name) == "fusedce" and metadata.backend.backend_type == Backend.CPU
    assert metadata.id.startswith("_fusedce_cpu_")


def test_loads_beside_the_installed_fusedce(hub):
    namespace = hub._fusedce._library.namespace
    assert namespace != fusedce._library.namespace
    assert hub.ops is getattr(torch.ops, namespace)
    assert hub.add_op_namespace_prefix("lce_fwd") == f"{namespace}::lce_fwd"
    h = torch.randn(9, 16)
    w = torch.randn(40, 16)
    t = torch.randint(0, 40, (9,))
    assert torch.equal(hub.fused_linear_cross_entropy(h, w, t), fusedce.linear_cross_entropy(h, w, t))


def test_matches_float64(hub):
    count, failed, failures = hub_checks.run(hub, "cpu")
    assert failed == 0, "\n".join(failures)
    assert count > 20


def _source_revision(source_dir):
    """torch/kernels_hub.cmake's fusedce_source_revision for sources at `source_dir` (CMake's
    script mode, PROJECT_VERSION 0.1.0)."""
    script = source_dir.parent / f"revision_{source_dir.name}.cmake"
    script.write_text(f'set(PROJECT_SOURCE_DIR "{source_dir}")\nset(PROJECT_VERSION 0.1.0)\n'
                      f'include("{ROOT / "torch" / "kernels_hub.cmake"}")\n'
                      'fusedce_source_revision(rev)\nmessage(STATUS "rev=${rev}")\n')
    done = subprocess.run(["cmake", "-P", str(script)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return next(line.split("rev=", 1)[1] for line in done.stdout.splitlines() if "rev=" in line)


def _git(cwd, *args):
    env = dict(os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@t", GIT_COMMITTER_NAME="t",
               GIT_COMMITTER_EMAIL="t@t")
    return subprocess.run(["git", *args], cwd=cwd, env=env, check=True, capture_output=True,
                          text=True).stdout.strip()


def test_namespace_revision_is_the_sources_own(tmp_path):
    """A git checkout of the sources is named by its own commit; sources unpacked inside another
    repository (a tarball in someone's checkout) by the project's version, never by the
    enclosing repository's commit."""
    outer = tmp_path / "outer"
    unpacked = outer / "vendor" / "fusedce-0.1.0"
    unpacked.mkdir(parents=True)
    (unpacked / "CMakeLists.txt").write_text("# sources\n")
    _git(outer, "init", "-q")
    _git(outer, "add", "-A")
    _git(outer, "commit", "-q", "-m", "outer")
    assert _source_revision(unpacked) == "v0_1_0"

    checkout = tmp_path / "checkout"
    checkout.mkdir()
    (checkout / "CMakeLists.txt").write_text("# sources\n")
    _git(checkout, "init", "-q")
    _git(checkout, "add", "-A")
    _git(checkout, "commit", "-q", "-m", "own")
    assert _source_revision(checkout) == _git(checkout, "rev-parse", "--short=7", "HEAD")
