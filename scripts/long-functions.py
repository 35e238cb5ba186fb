#!/usr/bin/env python3
"""Lists the longest functions of the workspace's Rust code (lines from `fn` to its closing brace).

Usage: scripts/long-functions.py [--max N] [--top K] [PATH ...]
With --max N it exits 1 when a function is longer than N lines, unless the line before its `fn`
(or a doc/attribute line above it) carries `// long-function: <reason>`: a reason written beside it.
"""
import argparse
import os
import re
import sys

FN = re.compile(r"^\s*(pub(\([^)]*\))?\s+)?(const\s+)?(async\s+)?(unsafe\s+)?(extern\s+\"[^\"]*\"\s+)?fn\s+([A-Za-z_][A-Za-z0-9_]*)")


def strip(line, state):
    """Removes comments, strings and char literals from a line; `state` carries block comments
    and multi-line strings across lines. Returns (code, state)."""
    out = []
    i, n = 0, len(line)
    while i < n:
        if state == "block":
            j = line.find("*/", i)
            if j < 0:
                return "".join(out), state
            i, state = j + 2, None
            continue
        if state and state.startswith("str"):
            hashes = state[3:]
            if hashes == "":
                # ordinary string: honour escapes
                while i < n:
                    if line[i] == "\\":
                        i += 2
                        continue
                    if line[i] == '"':
                        i += 1
                        state = None
                        break
                    i += 1
                continue
            end = '"' + hashes[1:]
            j = line.find(end, i)
            if j < 0:
                return "".join(out), state
            i, state = j + len(end), None
            continue
        c = line[i]
        if line.startswith("//", i):
            break
        if line.startswith("/*", i):
            state, i = "block", i + 2
            continue
        m = re.match(r'b?r(#*)"', line[i:])
        if m:
            state, i = "str#" + m.group(1), i + m.end()
            continue
        if c == '"' or line.startswith('b"', i):
            state, i = "str", i + (2 if c == "b" else 1)
            continue
        if c == "'":
            m = re.match(r"'(\\.|\\u\{[0-9a-fA-F]+\}|[^\\'])'", line[i:])
            if m:
                i += m.end()
                continue
        out.append(c)
        i += 1
    return "".join(out), state


def functions(path):
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    state = None
    stack = []  # (name, start line, depth at which its body opened, reason)
    depth = 0
    pending = None  # fn seen, body brace not yet
    found = []
    for no, raw in enumerate(lines, 1):
        code, state = strip(raw, state)
        m = FN.match(code)
        if m:
            reason = None
            k = no - 2
            while k >= 0 and (lines[k].strip().startswith(("///", "#[", "//")) or not lines[k].strip()):
                if "long-function:" in lines[k]:
                    reason = lines[k].split("long-function:", 1)[1].strip()
                    break
                if not lines[k].strip():
                    break
                k -= 1
            pending = (m.group(7), no, reason)
        for c in code:
            if c == "{":
                depth += 1
                if pending:
                    stack.append((pending[0], pending[1], depth, pending[2]))
                    pending = None
            elif c == "}":
                if stack and stack[-1][2] == depth:
                    name, start, _, reason = stack.pop()
                    found.append((no - start + 1, path, start, name, reason))
                depth -= 1
            elif c == ";" and pending and depth >= 0:
                pending = None  # a declaration without a body (trait method)
    return found


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max", type=int, help="fail when a function without a written reason is longer")
    ap.add_argument("--top", type=int, default=15, help="how many to list")
    ap.add_argument("paths", nargs="*", default=["shared", "runtime", "models", "trainer", "fleet", "edge-agent", "tests"])
    a = ap.parse_args()
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    found = []
    for p in a.paths:
        p = os.path.join(root, p)
        for dirpath, dirs, files in os.walk(p):
            dirs[:] = [d for d in dirs if d not in ("target", "fuzz", ".git")]
            for f in files:
                if f.endswith(".rs"):
                    found += functions(os.path.join(dirpath, f))
    found.sort(key=lambda t: -t[0])
    for n, path, start, name, reason in found[: a.top]:
        rel = os.path.relpath(path, root)
        print(f"{n:5} {rel}:{start} {name}" + (f"  (reason: {reason})" if reason else ""))
    if a.max is not None:
        bad = [t for t in found if t[0] > a.max and not t[4]]
        if bad:
            print(f"{len(bad)} function(s) longer than {a.max} lines without a `// long-function:` reason", file=sys.stderr)
            for n, path, start, name, _ in bad:
                print(f"  {n:5} {os.path.relpath(path, root)}:{start} {name}", file=sys.stderr)
            return 1
        print(f"no function over {a.max} lines without a written reason ({len(found)} functions)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
