#!/usr/bin/env python3
"""Fails when a module of the trainer library uses one that builds on it.

The trainer's modules form layers; a module may use its own layer's module and those of the
layers below it, never a module of its own layer or above. Any `crate::NAME` path in the code
(a `use`, or a path written in place) counts; comments do not.

    python3 scripts/layers.py [--root trainer/src] [--self-test]

Exit status 1 and one line per offending path (file:line: a -> b) when the rule is broken.
The table below is the design (docs/architecture.md says why in this order).
"""
import argparse
import re
import shutil
import sys
import tempfile
from pathlib import Path

# Lowest first. Modules on one line are one layer: they may not use each other.
LAYERS = [
    ["report", "images", "interrupt"],  # progress bars, plots, metrics files; image decoding; stop
    ["distributed"],  # ranks, collectives, jobs (local, MPI, TCP)
    ["data"],  # tables, samples, feature extraction over ranks, the cache
    ["train", "classify", "predict", "collect"],  # training; inference; captures from the fleet
    ["tune", "export"],  # trials of training; artifacts from a run
    ["track"],  # MLflow: runs, models, registry (observes train and tune)
    ["cli"],  # the commands
]

PATH = re.compile(r"\bcrate::([a-z_][a-z0-9_]*)")
GROUP = re.compile(r"\bcrate::\{")
IDENT = re.compile(r"[a-z_][a-z0-9_]*")
LINE_COMMENT = re.compile(r"//.*$")
BLOCK_COMMENT = re.compile(r"/\*.*?\*/", re.S)


def layer_of():
    table = {}
    for i, names in enumerate(LAYERS):
        for n in names:
            table[n] = i
    return table


def targets(text: str):
    """(line, module) of every `crate::NAME` and of each NAME in `crate::{NAME, NAME::x}`."""
    for m in PATH.finditer(text):
        yield text.count("\n", 0, m.start()) + 1, m.group(1)
    for m in GROUP.finditer(text):
        depth, item_start, i = 1, True, m.end()
        while i < len(text) and depth:
            c = text[i]
            if c in "{}":
                depth += 1 if c == "{" else -1
            elif c == "," and depth == 1:
                item_start = True
            elif item_start and depth == 1 and not c.isspace():
                name = IDENT.match(text, i)
                if name:
                    yield text.count("\n", 0, i) + 1, name.group(0)
                item_start = False
            i += 1


def module_of(root: Path, file: Path) -> str:
    rel = file.relative_to(root)
    return rel.parts[0].removesuffix(".rs")


def violations(root: Path):
    layer = layer_of()
    for file in sorted(root.rglob("*.rs")):
        module = module_of(root, file)
        if module in ("lib", "main"):
            continue
        if module not in layer:
            yield f"{file}: module `{module}` is in no layer of scripts/layers.py"
            continue
        text = BLOCK_COMMENT.sub(lambda m: "\n" * m.group(0).count("\n"), file.read_text())
        text = "\n".join(LINE_COMMENT.sub("", line) for line in text.splitlines())
        for n, target in sorted(set(targets(text))):
            if target == module or target not in layer:
                continue
            if layer[target] >= layer[module]:
                yield (
                    f"{file}:{n}: {module} (layer {layer[module]}) uses {target} "
                    f"(layer {layer[target]}): a module uses only the layers below its own"
                )


def self_test(root: Path) -> int:
    """The check fails on a copy of `root` given one upward use (and not for a comment)."""
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / "src"
        shutil.copytree(root, copy)
        target = copy / "distributed" / "mod.rs"
        target.write_text(
            target.read_text() + "\n// crate::cli in a comment\nuse crate::train::Observer;\n"
        )
        found = list(violations(copy))
    bad = [v for v in found if "distributed (layer 1) uses train" in v]
    if len(bad) != 1 or len(found) != 1:
        print(f"layers self-test: expected one upward use, found {found}", file=sys.stderr)
        return 1
    print(f"layers self-test: an upward use is caught: {bad[0].split('/src/', 1)[1]}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent / "trainer/src")
    ap.add_argument("--self-test", action="store_true", help="check that an upward use fails")
    args = ap.parse_args()
    if args.self_test and self_test(args.root):
        return 1
    found = list(violations(args.root))
    if not found:
        print(f"layers: {args.root}: every module uses only the layers below it")
        return 0
    print("\n".join(found))
    print(f"{len(found)} upward or sideways uses", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
