#!/usr/bin/env python3
"""Fails when a module uses one that builds on it, or two files use each other.

Three rules:

1. The trainer's modules form layers; a module may use its own layer's module and those of the
   layers below it, never a module of its own layer or above.
2. No two files of a crate in the workspace use each other (a two-file import circle), unless one
   is the other's parent module (`mod.rs` and its children, a file and its `tests`).
3. The agent's core (`edge-agent/src/core/`) does no IO: it uses none of the agent's modules that
   do (the shell, the store, the outbox, the configuration files, loaded models, replies, the
   command line), and no clock, file, socket or MQTT API.
4. No wire value of `shared/src/wire.rs` is compared as a string outside `shared`
   (`x == "idle"`, `"idle" =>` in a match): code compares the enums. A line whose comment says
   `not-wire: WHY` is the same word meaning something else (a PyTorch dtype named `int8`).

Any `crate::NAME`, `super::NAME` or `self::NAME` path in the code (a `use`, or a path written in
place) counts; comments do not.

    python3 scripts/layers.py [--root trainer/src] [--workspace .] [--self-test]

Exit status 1 and one line per offence (file:line: what) when a rule is broken. The table below is
the design (docs/architecture.md says why in this order).
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


USE = re.compile(r"\buse\s+((?:crate|super|self)\b[^;]*);", re.S)
INLINE = re.compile(r"\b((?:crate|super|self)(?:::[A-Za-z_][A-Za-z0-9_]*)+)")
TEST_MOD = re.compile(r"#\[cfg\(test\)\]\s*(?:pub(?:\([a-z]+\))?\s+)?mod\s+\w+\s*\{")


def code_of(file: Path) -> str:
    """The file's text without comments or an inline `#[cfg(test)] mod x { .. }` (whose `super`
    is the file itself), line numbers kept."""
    text = BLOCK_COMMENT.sub(lambda m: "\n" * m.group(0).count("\n"), file.read_text())
    text = "\n".join(LINE_COMMENT.sub("", line) for line in text.splitlines())
    m = TEST_MOD.search(text)
    return text[: m.start()] if m else text


def expand(tree: str):
    """The paths of a use tree: `crate::a::{b, c::{d, e}}` gives crate::a::b, crate::a::c::d, ..."""
    tree = re.sub(r"\s+", "", tree)
    i = tree.find("{")
    if i < 0:
        yield tree.split(" as ")[0]
        return
    head, body = tree[:i], tree[i + 1 : tree.rfind("}")]
    depth, start = 0, 0
    for j, c in enumerate(body + ","):
        if c in "{}":
            depth += 1 if c == "{" else -1
        elif c == "," and depth == 0:
            item = body[start:j]
            start = j + 1
            if item:
                yield from expand(head + item)


def module_path(src: Path, file: Path):
    parts = list(file.relative_to(src).with_suffix("").parts)
    if parts[-1] in ("mod", "lib", "main"):
        parts.pop()
    return parts


def file_of(src: Path, parts):
    """The file that defines the longest module prefix of `parts` (None: the crate root)."""
    for k in range(len(parts), 0, -1):
        for f in (src.joinpath(*parts[:k]).with_suffix(".rs"), src.joinpath(*parts[:k], "mod.rs")):
            if f.is_file():
                return f
    return None


def uses(src: Path, file: Path):
    """(line, file) of each file of the crate that `file` names by a path."""
    text = code_of(file)
    here = module_path(src, file)
    spans = []
    for m in USE.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        spans.append((m.start(), m.end()))
        for path in expand(m.group(1)):
            yield line, resolve(src, here, file, path)
    for m in INLINE.finditer(text):
        if any(a <= m.start() < b for a, b in spans):
            continue
        yield text.count("\n", 0, m.start()) + 1, resolve(src, here, file, m.group(1))


def resolve(src: Path, here, file: Path, path: str):
    parts = [p for p in path.split("::") if p]
    base = list(here) if file.name in ("mod.rs", "lib.rs", "main.rs") else list(here)
    if parts[0] == "crate":
        base, parts = [], parts[1:]
    else:
        # `self` is this module; each `super` one up (a file `a/b.rs` is module a::b).
        while parts and parts[0] in ("self", "super"):
            if parts.pop(0) == "super" and base:
                base.pop()
    return file_of(src, base + [p for p in parts if p != "*"])


def is_ancestor(src: Path, a: Path, b: Path) -> bool:
    pa, pb = module_path(src, a), module_path(src, b)
    return pa == pb[: len(pa)]


def circles(workspace: Path):
    """Two files of one crate that use each other, neither the other's parent module."""
    for src in sorted(workspace.glob("*/src")):
        files = [f for f in sorted(src.rglob("*.rs")) if "bin" not in f.relative_to(src).parts]
        edges = {}
        for f in files:
            for line, target in uses(src, f):
                if target is not None and target != f:
                    edges.setdefault((f, target), line)
        for (a, b), line in sorted(edges.items()):
            if str(a) < str(b) and (b, a) in edges:
                if is_ancestor(src, a, b) or is_ancestor(src, b, a):
                    continue
                yield (
                    f"{a}:{line}: uses {b.relative_to(src)}, and {b}:{edges[(b, a)]} uses "
                    f"{a.relative_to(src)}: a two-file import circle (move what both need below both)"
                )


WIRE_VALUE = re.compile(r'^\s*(?:#\[[^\]]*\]\s*)*[A-Z][A-Za-z0-9]* = "([^"]+)",', re.M)


def wire_values(workspace: Path):
    """The string form of every value of `shared/src/wire.rs`'s enums."""
    return set(WIRE_VALUE.findall((workspace / "shared/src/wire.rs").read_text()))


def is_test_file(path: Path) -> bool:
    n = path.name
    return n == "tests.rs" or n.startswith("tests_") or n.endswith("_tests.rs") or "tests" in path.parts[:-1]


def wire_comparisons(workspace: Path):
    """A wire value compared as a string (`== "idle"`, `"idle" =>`, `| "idle"`) outside `shared`."""
    values = wire_values(workspace)
    alt = "|".join(re.escape(v) for v in sorted(values, key=len, reverse=True))
    lit = rf'"(?:{alt})"'
    compare = re.compile(
        rf"(?:[=!]=\s*{lit})|(?:{lit}\s*(?:[=!]=|=>|\|[^|]))|(?:[^|]\|\s*{lit})|(?:matches!\([^,]*,\s*{lit})"
    )
    for src in sorted(workspace.glob("*/src")):
        if src.parent.name in ("shared", "tests", "fuzz"):
            continue
        for file in sorted(src.rglob("*.rs")):
            if is_test_file(file.relative_to(src)):
                continue
            text = code_of(file)
            raw = file.read_text().splitlines()
            for m in compare.finditer(text):
                line = text.count("\n", 0, m.start()) + 1
                if "not-wire:" in raw[line - 1]:
                    continue  # the same word, not a wire value (a comment on the line says what)
                yield (
                    f"{file}:{line}: `{m.group(0).strip()}` compares a wire value as a string "
                    f"(compare the enum of kestrel_shared::wire)"
                )


CORE = "edge-agent/src/core"
SHELL_MODULES = ("agent", "store", "outbox", "config", "models", "replies", "cli")
IO_APIS = re.compile(
    r"\b(?:Instant::now|SystemTime::now|std::fs|std::net|tokio|rumqttc|now_ms\(\)|now_unix\(\)|now_rfc3339\(\))"
)


def impure_core(workspace: Path):
    """A file of the agent's core that uses a module of the shell, or an IO API."""
    core = workspace / CORE
    src = core.parent
    if not core.is_dir():
        return
    for file in sorted(core.rglob("*.rs")):
        if is_test_file(file.relative_to(src)):
            continue
        for line, target in sorted(set(uses(src, file)), key=lambda t: (t[0], str(t[1]))):
            if target is not None and target.relative_to(src).parts[0].removesuffix(".rs") in SHELL_MODULES:
                yield f"{file}:{line}: the core uses {target.relative_to(src)}, a module that does IO"
        text = code_of(file)
        for m in IO_APIS.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            yield f"{file}:{line}: the core calls `{m.group(0)}` (IO belongs to the shell: pass the value in)"


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


def self_test_workspace(workspace: Path) -> int:
    """The circle and wire rules fail on a small workspace that breaks each once (and not on a
    parent and its child, or a line marked `not-wire:`)."""
    with tempfile.TemporaryDirectory() as tmp:
        ws = Path(tmp)
        (ws / "shared/src").mkdir(parents=True)
        shutil.copy(workspace / "shared/src/wire.rs", ws / "shared/src/wire.rs")
        files = {
            "a/src/lib.rs": "mod x;\nmod y;\nmod p;\n",
            "a/src/x.rs": "use crate::y::Y;\npub struct X;\n",
            "a/src/y.rs": "pub struct Y(crate::x::X);\n",
            "a/src/p/mod.rs": "mod c;\nuse c::C;\npub struct P(crate::p::c::C);\n",
            "a/src/p/c.rs": "use super::P;\npub struct C;\n",
            "b/src/lib.rs": (
                "fn f(s: &S) -> bool {\n    s.state == \"idle\"\n}\n"
                "fn g(t: &str) -> u8 {\n    match t {\n        \"int8\" => 1, // not-wire: a dtype\n"
                "        _ => 0,\n    }\n}\n"
            ),
        }
        files["edge-agent/src/lib.rs"] = "pub mod core;\npub mod store;\n"
        files["edge-agent/src/store.rs"] = "pub struct Store;\n"
        files["edge-agent/src/core/mod.rs"] = (
            "use crate::store::Store;\nfn t() -> std::time::Instant {\n    std::time::Instant::now()\n}\n"
        )
        for name, text in files.items():
            (ws / name).parent.mkdir(parents=True, exist_ok=True)
            (ws / name).write_text(text)
        found = list(circles(ws)) + list(impure_core(ws)) + list(wire_comparisons(ws))
    ok = (
        len(found) == 4
        and "a/src/x.rs:1: uses y.rs" in found[0]
        and "core/mod.rs:1: the core uses store.rs" in found[1]
        and "core/mod.rs:3: the core calls `Instant::now`" in found[2]
        and "b/src/lib.rs:2: `== \"idle\"`" in found[3]
    )
    if not ok:
        print(f"layers self-test: expected a circle, an impure core and a wire comparison, found {found}", file=sys.stderr)
        return 1
    print("layers self-test: a two-file circle, IO in the agent's core and a wire value compared as a string are caught")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    here = Path(__file__).resolve().parent.parent
    ap.add_argument("--root", type=Path, default=here / "trainer/src")
    ap.add_argument("--workspace", type=Path, default=here)
    ap.add_argument("--self-test", action="store_true", help="check that each rule fails when broken")
    args = ap.parse_args()
    if args.self_test and (self_test(args.root) or self_test_workspace(args.workspace)):
        return 1
    found = list(violations(args.root))
    found += list(circles(args.workspace))
    found += list(impure_core(args.workspace))
    found += list(wire_comparisons(args.workspace))
    if not found:
        print(
            f"layers: {args.root}: every module uses only the layers below it; "
            f"{args.workspace}: no two files use each other, the agent's core does no IO, "
            "no wire value is compared as a string"
        )
        return 0
    print("\n".join(found))
    print(f"{len(found)} offences", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
