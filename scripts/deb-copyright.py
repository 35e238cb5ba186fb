#!/usr/bin/env python3
"""The DEP-5 copyright file of the edge agent's Debian package: Kestrel's own code, then every crate
statically linked into the binary for TARGET (with FEATURES), its authors and licence, then one
paragraph per licence with its text (or where Debian keeps it).

    scripts/deb-copyright.py TARGET [FEATURES] > copyright

The crates are those `cargo tree -p edge-agent --target TARGET -e normal` lists (build scripts and
proc macros are not linked); their authors and licences come from `cargo metadata`. Licence texts come from
/usr/share/common-licenses when Debian ships them, otherwise from a licence file of a crate under
that licence.
"""
import json
import os
import re
import subprocess
import sys

COMMON = {"Apache-2.0", "MPL-2.0", "GPL-2.0", "GPL-3.0", "LGPL-2.1", "LGPL-3.0", "CC0-1.0"}
# Licence file names, by licence, that crates use.
FILES = {
    "MIT": ["LICENSE-MIT", "LICENSE-MIT.md", "LICENSE.MIT", "LICENSE", "LICENSE.md", "LICENCE"],
    "Unicode-3.0": ["LICENSE-UNICODE", "LICENSE"],
    "BSD-3-Clause": ["LICENSE-BSD", "LICENSE", "LICENSE.md"],
    "BSD-2-Clause": ["LICENSE-BSD", "LICENSE-BSD-2-Clause", "LICENSE"],
    "ISC": ["LICENSE-ISC", "LICENSE", "LICENSE.md"],
    "Zlib": ["LICENSE-ZLIB", "LICENSE-ZLIB.md", "LICENSE"],
    "0BSD": ["LICENSE-0BSD", "LICENSE-0BSD.md", "LICENSE"],
    "BSL-1.0": ["LICENSE-BOOST", "LICENSE-BSL", "LICENSE"],
    "Unlicense": ["UNLICENSE", "LICENSE-UNLICENSE"],
    "CDLA-Permissive-2.0": ["LICENSE"],
    "Apache-2.0 WITH LLVM-exception": ["LICENSE-Apache-2.0_WITH_LLVM-exception", "LICENSE-APACHE"],
}


def dep5(expr):
    """An SPDX expression in DEP-5 syntax (lower-case `or`/`and`, `/` as `or`)."""
    expr = (expr or "UNKNOWN").replace("/", " OR ")
    expr = re.sub(r"\s+OR\s+", " or ", expr)
    expr = re.sub(r"\s+AND\s+", " and ", expr)
    return re.sub(r"[()]", "", expr).strip()


def names(expr):
    """The licence names of a DEP-5 expression (`X WITH Y` kept whole)."""
    return [n.strip() for n in re.split(r"\s+(?:or|and)\s+", expr) if n.strip()]


def main():
    target = sys.argv[1]
    features = sys.argv[2] if len(sys.argv) > 2 else ""
    cmd = ["cargo", "metadata", "--format-version", "1", "--locked", "--filter-platform", target]
    if features:
        cmd += ["--features", features]
    meta = json.loads(subprocess.check_output(cmd, cwd=os.path.join(os.path.dirname(__file__), "..")))
    pkgs = {p["id"]: p for p in meta["packages"]}
    # The crates linked: `cargo tree -p edge-agent` resolves features as building the agent alone
    # does (cargo metadata unifies them over the workspace: the trainer's ONNX and candle too).
    tree = ["cargo", "tree", "--locked", "-p", "edge-agent", "--target", target, "-e", "normal",
            "--prefix", "none", "--format", "{p}"]
    if features:
        tree += ["--features", features]
    linked = set()
    for line in subprocess.check_output(tree, cwd=os.path.join(os.path.dirname(__file__), ".."),
                                        text=True).splitlines():
        w = line.split()
        if len(w) >= 2:
            linked.add((w[0], w[1].lstrip("v")))
    seen = [i for i, p in pkgs.items() if (p["name"], p["version"]) in linked]
    ours = {p["name"] for p in pkgs.values() if p["source"] is None}
    out = [
        "Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/",
        "Upstream-Name: kestrel",
        "Comment: The agent is one statically linked binary: the paragraphs after the first",
        " name the crates (Rust libraries) linked into it, as published on crates.io.",
        "",
        "Files: *",
        "Copyright: 2026 Kestrel maintainers",
        "License: Apache-2.0",
    ]
    used = {}
    for i in sorted(seen, key=lambda i: (pkgs[i]["name"], pkgs[i]["version"])):
        p = pkgs[i]
        if p["name"] in ours:
            continue
        lic = dep5(p.get("license"))
        authors = [re.sub(r"\s*<[^>]*>", "", a) for a in p.get("authors") or []] or [
            "the authors of " + p["name"]
        ]
        out += [
            "",
            f"Files: crates.io/{p['name']}-{p['version']}/*",
            "Copyright: " + authors[0],
            *[" " + a for a in authors[1:]],
            f"License: {lic}",
        ]
        for n in names(lic):
            used.setdefault(n, os.path.dirname(p["manifest_path"]))
        # Later crates may hold a licence text an earlier one lacked.
        for n in names(lic):
            if used[n] is None:
                used[n] = os.path.dirname(p["manifest_path"])
    used.setdefault("Apache-2.0", None)
    for n in sorted(used):
        out += ["", f"License: {n}"]
        base = n.split(" WITH ")[0]
        if base in COMMON:
            out += [f" On Debian systems, the full text of the {base} licence is in",
                    f" /usr/share/common-licenses/{base}."]
            if " WITH " in n:
                out += [" .", f" With the {n.split(' WITH ')[1]} exception."]
            continue
        text = None
        d = used[n]
        for f in FILES.get(n, ["LICENSE"]):
            if d and os.path.isfile(os.path.join(d, f)):
                text = open(os.path.join(d, f), encoding="utf-8", errors="replace").read()
                break
        if not text:
            text = f"The {n} licence, as published by SPDX: https://spdx.org/licenses/{n}.html"
        for line in text.strip().splitlines():
            line = line.rstrip()
            out.append(" " + line if line else " .")
    print("\n".join(out))


if __name__ == "__main__":
    main()
