"""The binary wheel (scripts/build_wheel.sh) installs into a fresh virtual environment with
nothing but the wheel (--no-deps, --no-index; torch from the test's own environment through a
.pth file), with no compiler on the PATH, and computes a loss there that matches PyTorch's."""

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]

SMOKE = r"""
import os, shutil, sys
import torch, torch.nn.functional as F
for tool in ("cc", "gcc", "c++", "g++", "clang", "nvcc", "cmake", "ninja"):
    assert shutil.which(tool) is None, f"{tool} is on the PATH"
import fusedce
assert fusedce.__file__.startswith(sys.prefix), fusedce.__file__
logits = torch.randn(37, 1000, requires_grad=True)
target = torch.randint(0, 1000, (37,))
target[::5] = -100
loss = fusedce.cross_entropy(logits, target)
loss.backward()
ref = torch.func.grad(lambda x: F.cross_entropy(x.double(), target))(logits.detach().double())
assert abs(loss.item() - F.cross_entropy(logits.double(), target).item()) < 1e-5
assert (logits.grad.double() - ref).abs().max().item() < 1e-6
hidden, weight = torch.randn(37, 64), torch.randn(1000, 64) / 8
lin = fusedce.linear_cross_entropy(hidden, weight, target)
assert abs(lin.item() - F.cross_entropy(hidden.double() @ weight.double().T, target).item()) < 1e-4
print("wheel ok", fusedce.__version__, "cuda kernels:", fusedce.with_cuda, "loss", loss.item())
"""


def run(cmd, **kw):
    done = subprocess.run(cmd, capture_output=True, text=True, **kw)
    assert done.returncode == 0, f"{cmd}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def test_wheel_installs_and_runs_without_a_compiler(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "FUSEDCE_BUILD_DIR")}
    env["FUSEDCE_PYTHON"] = sys.executable
    wheel = Path(run(["bash", str(ROOT / "scripts" / "build_wheel.sh"), str(tmp_path / "dist")],
                     cwd=ROOT, env=env).strip().splitlines()[-1])
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    assert wheel.name.startswith(f"fusedce-0.1.0+torch{major}.{minor}"), wheel.name

    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", str(venv)], env=env)
    py = venv / "bin" / "python"
    site = Path(run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).strip())
    # torch (and what it imports) from this environment, after the venv's own packages.
    paths = {sysconfig.get_paths()["purelib"], str(Path(torch.__file__).parents[1])}
    (site / "torch_from_tests.pth").write_text("\n".join(sorted(paths)) + "\n")
    bare = {"PATH": str(venv / "bin"), "HOME": str(tmp_path), "LANG": "C.UTF-8"}
    run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)], env=bare,
        cwd=tmp_path)
    assert shutil.which("gcc", path=bare["PATH"]) is None
    out = run([str(py), "-c", SMOKE], env=bare, cwd=tmp_path)
    assert "wheel ok" in out
