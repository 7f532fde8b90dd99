#!/usr/bin/env python3
"""Lengths of the C++ / CUDA functions under the given folders, longest first: a function is a
brace block whose opening follows a parenthesised parameter list (not a control statement, a
class, a namespace or an initialiser), and its length counts the lines from its signature's
last line to its closing brace. A reading aid and a check, not a parser: lambdas count as part
of the function around them.

Usage: function_lengths.py [--max LINES] DIR_OR_FILE...   (exit 1 when a function is longer)
"""
import argparse
import os
import re
import sys

SUFFIXES = (".h", ".cuh", ".cu", ".cpp", ".cc")
CONTROL = re.compile(r"\b(if|for|while|switch|catch|do|else)\s*(\(.*\))?\s*$")
NOT_FUNCTION = re.compile(r"\b(struct|class|namespace|enum|union)\b|=\s*$|^\s*extern\s+\"C\"")


def strip(line, in_block):
    """The line without comments and string / char literals; in_block: inside a /* */ comment."""
    out, i = [], 0
    while i < len(line):
        if in_block:
            end = line.find("*/", i)
            if end < 0:
                return "".join(out), True
            i, in_block = end + 2, False
        elif line.startswith("//", i):
            break
        elif line.startswith("/*", i):
            in_block, i = True, i + 2
        elif line[i] in "\"'":
            q, i = line[i], i + 1
            while i < len(line) and line[i] != q:
                i += 2 if line[i] == "\\" else 1
            i += 1
        else:
            out.append(line[i])
            i += 1
    return "".join(out), in_block


def functions(path):
    """(name, first line, length) of each function in the file."""
    text = open(path, encoding="utf-8", errors="replace").read().splitlines()
    stack, found, in_block, head = [], [], False, ""
    for no, raw in enumerate(text, 1):
        line, in_block = strip(raw, in_block)
        if line.lstrip().startswith("#"):
            continue
        for ch in line:
            if ch == "{":
                sig = head.strip()
                is_fn = (")" in sig and not CONTROL.search(sig) and not NOT_FUNCTION.search(sig)
                         and not any(s[2] for s in stack))
                name = re.findall(r"([~\w:]+)\s*\(", sig)
                stack.append((no, name[0] if name else "?", is_fn))
                head = ""
            elif ch == "}":
                if stack:
                    start, name, is_fn = stack.pop()
                    if is_fn:
                        found.append((name, start, no - start + 1))
                head = ""
            elif ch == ";":
                head = ""
            else:
                head += ch
        head += " "
    return found


def main():
    p = argparse.ArgumentParser()
    p.add_argument("paths", nargs="+")
    p.add_argument("--max", type=int, default=0)
    p.add_argument("--top", type=int, default=15)
    a = p.parse_args()
    rows = []
    for root in a.paths:
        files = [root] if os.path.isfile(root) else [
            os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if f.endswith(SUFFIXES)]
        for f in sorted(files):
            rows += [(n, f, s, name) for name, s, n in functions(f)]
    rows.sort(reverse=True)
    for n, f, s, name in rows[:a.top]:
        print(f"{n:5d}  {f}:{s}  {name}")
    over = [r for r in rows if a.max and r[0] > a.max]
    if over:
        print(f"{len(over)} function(s) longer than {a.max} lines")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
