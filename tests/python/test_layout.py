"""The source layout's rules, checked on every run: no function in src/cuda longer than 150
lines (scripts/function_lengths.py), no setting read from the environment in src/ (the one
exception passes OpenBLAS's own OPENBLAS_CORETYPE through to the private OpenBLAS), and no
work-log words in the comments of src/ and bench/ (dates, session numbers)."""

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_FUNCTION_LINES = 150


def _lengths():
    spec = importlib.util.spec_from_file_location("function_lengths", ROOT / "scripts" / "function_lengths.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _sources(*folders):
    for folder in folders:
        for path in sorted((ROOT / folder).rglob("*")):
            if path.suffix in (".h", ".cuh", ".cu", ".cpp", ".cc", ".py"):
                yield path


def test_no_long_function_in_src_cuda():
    lengths = _lengths()
    long = [(n, f"{p.relative_to(ROOT)}:{start}", name)
            for p in _sources("src/cuda") if p.suffix != ".py"
            for name, start, n in lengths.functions(str(p)) if n > MAX_FUNCTION_LINES]
    assert not long, f"functions longer than {MAX_FUNCTION_LINES} lines: {long}"


def test_function_lengths_sees_a_long_function(tmp_path):
    """The measure itself: a 200-line kernel body is seen whole, a struct and an if are not
    functions."""
    body = "\n".join(f"  x += {i};" for i in range(198))
    src = tmp_path / "k.cu"
    src.write_text("struct S {\n  int a;\n};\n__global__ void k(int* p) {\n  int x = 0;\n"
                   f"  if (p) {{\n{body}\n  }}\n  *p = x;\n}}\n")
    assert _lengths().functions(str(src)) == [("k", 4, 204)]


def test_no_environment_settings_in_src():
    allowed = {"src/cpu/gemm_openblas.cpp"}
    found = [str(p.relative_to(ROOT)) for p in _sources("src", "include")
             if "getenv(" in p.read_text(errors="replace") and str(p.relative_to(ROOT)) not in allowed]
    assert not found, f"getenv in {found}: pass settings explicitly (PlanChoices), experiments go in dev/"


def test_no_work_log_words_in_comments():
    log = re.compile(r"(//|#|\*).*(\b20\d\d-\d\d-\d\d\b|\bsession \d+|\bsession's\b|\bcall \d+ of\b)")
    found = [f"{p.relative_to(ROOT)}:{i}" for p in _sources("src", "include", "bench", "torch")
             for i, line in enumerate(p.read_text(errors="replace").splitlines(), 1) if log.search(line)]
    assert not found, f"work-log words (dates, session numbers) in comments: {found}"
