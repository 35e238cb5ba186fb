"""The flags' type hints: generated from the trainer's own command line, current, and read by a
type checker as an IDE reads them."""

from __future__ import annotations

import subprocess
import sys
import typing
from pathlib import Path

from kestrel import _flags, _native

ROOT = Path(__file__).resolve().parents[2]


def test_the_typed_flags_are_the_clis_flags():
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen-flags.py"), "--check"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    fit = typing.get_type_hints(_flags.FitFlags)
    cli = {name for name, _, _ in _native.flag_specs("fit")}
    assert set(fit) == cli - {"data", "out", "json"}, set(fit) ^ (cli - {"data", "out", "json"})
    assert fit["epochs"] is int and fit["lr"] is float and fit["no_mlflow"] is bool
    assert typing.get_args(fit["optimizer"]) == ("sgd", "adamw", "lbfgs")


def test_a_type_checker_reads_the_flags(tmp_path):
    snippet = tmp_path / "cell.py"
    snippet.write_text(
        "import kestrel\n"
        "import kestrel.spark as ks\n"
        "kestrel.fit('t', out='o', epochs=3, lr=0.1, no_mlflow=True)\n"
        "kestrel.fit('t', out='o', epochs='three')\n"
        "kestrel.fit('t', out='o', epoch=3)\n"
        "ks.fit('t', out='o', num_workers=2, optimizer='newton')\n"
    )
    r = subprocess.run(
        [sys.executable, "-m", "mypy", "--follow-imports=silent", "--ignore-missing-imports",
         "--no-incremental", "--cache-dir=/dev/null", str(snippet)],
        capture_output=True, text=True, cwd=tmp_path,
    )
    errors = [line for line in r.stdout.splitlines() if ": error:" in line]
    print(r.stdout)
    assert [int(e.split(":")[1]) for e in errors] == [4, 5, 6], r.stdout
    assert '"epochs"' in errors[0] and '"epoch"' in errors[1] and '"optimizer"' in errors[2], r.stdout
