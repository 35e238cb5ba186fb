"""Writes python/kestrel/_flags.py: the keyword arguments of the package's functions as TypedDicts,
from the trainer's own command line (`kestrel._native.flag_specs`), so that an IDE shows each flag
with its type and help. python/tests/test_flags.py fails when the file is out of date.

    python scripts/gen-flags.py            # rewrite the file
    python scripts/gen-flags.py --check    # exit 1 if it differs
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

TARGET = Path(__file__).resolve().parent.parent / "python" / "kestrel" / "_flags.py"

#: Each TypedDict: the command, and the names its function takes itself (not in the dict).
COMMANDS = {
    "PrepareFlags": ("prepare", {"data"}),
    "FitFlags": ("fit", {"data", "out"}),
    "TuneFlags": ("tune", {"data", "out"}),
    "EvaluateFlags": ("evaluate", {"run"}),
    "ExportFlags": ("export", {"run", "out"}),
    "PredictFlags": ("predict", {"model", "data", "out"}),
    "PublishFlags": ("publish", {"artifact", "broker"}),
    "StatusFlags": ("status", {"broker"}),
}
#: Set by every function itself.
ALWAYS = {"json"}
#: What the Spark functions take themselves, besides their command's.
SPARK_OWN = {"label", "path", "content", "staging", "num_workers", "timeout_s", "use_gpu"}


def render() -> str:
    from kestrel import _native

    lines = [
        '"""The keyword arguments of the package\'s functions, typed: written by scripts/gen-flags.py from',
        "the trainer's command line (do not edit; python/tests/test_flags.py checks it is current).",
        "Each key is a flag (``--label-column`` is ``label_column``); ``True`` gives a switch, a",
        'sequence repeats a flag."""',
        "",
        "from __future__ import annotations",
        "",
        "from typing import Literal, Sequence, TypedDict, Union",
        "",
    ]
    for cls, (command, own) in COMMANDS.items():
        lines += ["", f"class {cls}(TypedDict, total=False):", f'    """``trainer {command}``\'s flags."""', ""]
        for name, python, help_ in _native.flag_specs(command):
            if name in own or name in ALWAYS or name in SPARK_OWN:
                continue
            lines.append(f"    {name}: {python}")
            doc = help_.replace("\\", "\\\\").replace('"""', "'''").strip() or name
            lines.append(f'    """{doc}"""')
        lines.append("")
    return "\n".join(lines).rstrip("\n") + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if the file differs")
    args = ap.parse_args()
    text = render()
    if args.check:
        if not TARGET.is_file() or TARGET.read_text() != text:
            sys.exit(f"{TARGET} is out of date: run python scripts/gen-flags.py")
        return
    TARGET.write_text(text)
    print(f"wrote {TARGET}")


if __name__ == "__main__":
    main()
