"""One version number: include/fusedce/version.h holds it (CMake's project() reads it there);
pyproject.toml's version and fusedce.__version__ repeat it for Python's tools and must agree."""

import re
from pathlib import Path

import fusedce

ROOT = Path(__file__).resolve().parents[2]


def header_version(text):
    parts = [re.search(rf"^#define FUSEDCE_VERSION_{p} (\d+)$", text, re.M) for p in ("MAJOR", "MINOR", "PATCH")]
    assert all(parts), "version.h lacks a FUSEDCE_VERSION_* line"
    return ".".join(m.group(1) for m in parts)


def test_every_copy_of_the_version_agrees():
    header = header_version((ROOT / "include" / "fusedce" / "version.h").read_text())
    found = re.search(r'^version = "([^"]+)"$', (ROOT / "pyproject.toml").read_text(), re.M)
    assert found, "pyproject.toml has no version line"
    pyproject = found.group(1)
    assert pyproject == header, f"pyproject.toml says {pyproject}, version.h {header}"
    assert fusedce.__version__ == header, f"fusedce.__version__ is {fusedce.__version__}, version.h {header}"
    assert "VERSION 0" not in (ROOT / "CMakeLists.txt").read_text().split("project(")[1].split(")")[0], \
        "CMakeLists.txt's project() must take the version from version.h, not a literal"


def test_the_header_parse_can_fail():
    assert header_version("#define FUSEDCE_VERSION_MAJOR 1\n#define FUSEDCE_VERSION_MINOR 2\n"
                          "#define FUSEDCE_VERSION_PATCH 3\n") == "1.2.3"
    assert header_version("#define FUSEDCE_VERSION_MAJOR 0\n#define FUSEDCE_VERSION_MINOR 2\n"
                          "#define FUSEDCE_VERSION_PATCH 0\n") != "0.1.0"
