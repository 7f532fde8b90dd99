"""The source layout's rules, checked on every run: no function in src/cuda longer than 150
lines (function_lengths.py beside this file), no setting read from the environment in src/, and no
work-log words in the comments of src/ and bench/ (dates, session numbers)."""

import re
from pathlib import Path

import function_lengths

ROOT = Path(__file__).resolve().parents[2]
MAX_FUNCTION_LINES = 150


def _sources(*folders):
    for folder in folders:
        for path in sorted((ROOT / folder).rglob("*")):
            if path.suffix in (".h", ".cuh", ".cu", ".cpp", ".cc", ".py"):
                yield path


def test_no_long_function_in_src_cuda():
    long = [(n, f"{p.relative_to(ROOT)}:{start}", name)
            for p in _sources("src/cuda") if p.suffix != ".py"
            for name, start, n in function_lengths.functions(str(p)) if n > MAX_FUNCTION_LINES]
    assert not long, f"functions longer than {MAX_FUNCTION_LINES} lines: {long}"


def test_function_lengths_sees_a_long_function(tmp_path):
    """The measure itself: a 200-line kernel body is seen whole, a struct and an if are not
    functions."""
    body = "\n".join(f"  x += {i};" for i in range(198))
    src = tmp_path / "k.cu"
    src.write_text("struct S {\n  int a;\n};\n__global__ void k(int* p) {\n  int x = 0;\n"
                   f"  if (p) {{\n{body}\n  }}\n  *p = x;\n}}\n")
    assert function_lengths.functions(str(src)) == [("k", 4, 204)]


def test_no_environment_settings_in_src():
    found = [str(p.relative_to(ROOT)) for p in _sources("src", "include") if "getenv(" in p.read_text(errors="replace")]
    assert not found, f"getenv in {found}: pass settings explicitly (PlanChoices), experiments go in dev/"


def test_no_work_log_words_in_comments():
    log = re.compile(r"(//|#|\*).*(\b20\d\d-\d\d-\d\d\b|\bsession \d+|\bsession's\b|\bcall \d+ of\b)")
    found = [f"{p.relative_to(ROOT)}:{i}" for p in _sources("src", "include", "bench", "torch")
             for i, line in enumerate(p.read_text(errors="replace").splitlines(), 1) if log.search(line)]
    assert not found, f"work-log words (dates, session numbers) in comments: {found}"


def test_dev_holds_experiments_not_calls_or_logs():
    """dev/ is one-file experiments: a device call's script or a result log belongs nowhere in
    the tree (what it showed goes to docs/performance.md); dev/ab_check/ is the one tool kept."""
    kept = ROOT / "dev" / "ab_check"
    found = [str(p.relative_to(ROOT)) for p in sorted((ROOT / "dev").rglob("*"))
             if p.is_file() and p.suffix in (".sh", ".txt", ".log", ".csv", ".json", ".out")
             and kept not in p.parents]
    assert not found, f"device-call scripts or logs in dev/: {found}"


def test_every_script_is_named_in_the_readme():
    """scripts/ holds what a user or CI runs, and README.md says what each one is for."""
    readme = (ROOT / "README.md").read_text()
    unnamed = [p.name for p in sorted((ROOT / "scripts").iterdir()) if p.is_file() and p.name not in readme]
    assert not unnamed, f"scripts/ files README.md does not name (move one-off tools to dev/): {unnamed}"
