#!/usr/bin/env python3
"""Gives each tracked file of a new checkout the modification time it had when its content was
last seen, so that cargo (which decides what to rebuild by comparing source and build times)
rebuilds only the crates whose files changed.

A fresh clone stamps every file with the time of the clone, and cargo then rebuilds every crate
of the workspace (and the three ARM agents, with fat LTO) although `$KESTREL_HOME/target` holds a
build of the very same sources. Keyed by content, never by commit: a file whose blob (git's
SHA-1 of its content) is the one recorded takes the recorded time back; any other file keeps the
new time and is recorded with it, so it is newer than every build made before it existed and its
crate is rebuilt. Files with changes not staged in git (a developer's edits) are left alone and
forgotten, so they count as changed the next time too.

The record is `$KESTREL_HOME/mtimes.tsv` (blob, time in ns, path relative to the repository).
Sound as long as the clock does not go back: a restored time is the moment that content first
appeared in a checkout here, and a build of other content was made before that or after it; in
the latter case it was a build of this content.

Usage: scripts/keep-mtimes.py [--dry-run | --self-test]   (scripts/setup.sh runs it first)"""

import os
import subprocess
import sys


def tracked(repo):
    """{path: blob} of the files git tracks whose working copy is the staged one."""
    out = subprocess.run(["git", "-C", repo, "ls-files", "-s", "-z"], capture_output=True, check=True).stdout
    files = {}
    for entry in out.split(b"\0"):
        if not entry:
            continue
        meta, path = entry.split(b"\t", 1)
        mode, blob, _stage = meta.split()
        if mode in (b"100644", b"100755"):
            files[path.decode()] = blob.decode()
    dirty = subprocess.run(["git", "-C", repo, "diff", "--name-only", "-z"], capture_output=True,
                           check=True).stdout
    for path in dirty.split(b"\0"):
        files.pop(path.decode(), None)
    return files


def read(record):
    known = {}
    try:
        with open(record) as f:
            for line in f:
                blob, ns, path = line.rstrip("\n").split("\t", 2)
                known[path] = (blob, int(ns))
    except (OSError, ValueError):
        return {}
    return known


def keep(repo, record, dry=False):
    """Restores and records the times of `repo`'s files; (restored, new or changed)."""
    known = read(record)
    files = tracked(repo)
    restored = changed = 0
    lines = []
    for path, blob in sorted(files.items()):
        full = os.path.join(repo, path)
        try:
            now = os.stat(full, follow_symlinks=False).st_mtime_ns
        except OSError:
            continue
        ns = now
        seen = known.get(path)
        if seen and seen[0] == blob:
            if seen[1] < now:
                if not dry:
                    os.utime(full, ns=(seen[1], seen[1]), follow_symlinks=False)
                restored += 1
            ns = min(now, seen[1])
        else:
            changed += 1
        lines.append(f"{blob}\t{ns}\t{path}\n")
    if not dry:
        os.makedirs(os.path.dirname(record), exist_ok=True)
        tmp = record + ".tmp"
        with open(tmp, "w") as f:
            f.writelines(lines)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, record)
    return restored, changed


def self_test():
    """A clone of unchanged files gets their times back; a changed, a new and an edited file do not."""
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        git = lambda repo, *a: subprocess.run(["git", "-C", repo, *a], check=True, capture_output=True)
        src, record = f"{d}/src", f"{d}/home/mtimes.tsv"
        os.makedirs(src)
        git(src, "init", "-q")
        for name in ("a.rs", "b.rs"):
            with open(f"{src}/{name}", "w") as f:
                f.write(name)
        git(src, "add", ".")
        git(src, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
        os.utime(f"{src}/a.rs", ns=(10**18, 10**18))  # as if first seen long ago
        os.utime(f"{src}/b.rs", ns=(10**18, 10**18))
        assert keep(src, record) == (0, 2)
        with open(f"{src}/b.rs", "w") as f:
            f.write("b2")
        with open(f"{src}/c.rs", "w") as f:
            f.write("c")
        git(src, "add", ".")
        git(src, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "two")
        git(d, "clone", "-q", src, f"{d}/clone")
        clone = f"{d}/clone"
        assert keep(clone, record) == (1, 2), keep(clone, record, dry=True)
        mtime = lambda p: os.stat(f"{clone}/{p}").st_mtime_ns
        assert mtime("a.rs") == 10**18, "unchanged: its time back"
        assert mtime("b.rs") > 10**18 and mtime("c.rs") > 10**18, "changed and new: now"
        # An edit not committed: left alone and forgotten, so it counts as changed next time too.
        with open(f"{clone}/a.rs", "w") as f:
            f.write("edited")
        os.utime(f"{clone}/a.rs", ns=(2 * 10**18, 2 * 10**18))
        keep(clone, record)
        assert mtime("a.rs") == 2 * 10**18
        assert "a.rs" not in read(record)
    print("keep-mtimes: self-test passed", file=sys.stderr)


def main():
    if "--self-test" in sys.argv[1:]:
        return self_test()
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    home = os.environ.get("KESTREL_HOME") or os.path.expanduser("~/.cache/kestrel")
    restored, changed = keep(repo, os.path.join(home, "mtimes.tsv"), dry="--dry-run" in sys.argv[1:])
    print(f"keep-mtimes: {restored} files given back their earlier time, {changed} new or changed",
          file=sys.stderr)


if __name__ == "__main__":
    main()
