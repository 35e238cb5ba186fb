"""Where the Rust code's progress bars go (the CLI's bars: decoding, features, evaluation,
publishing): the Rust side hands each bar's latest line here while a command runs (every 100 ms
at most, 4 redraws a second), and :func:`show` draws it — in a notebook, as a display updated in
place in the running cell; in a terminal, on one stderr line rewritten with a carriage return;
elsewhere (a log file, a Spark executor) not at all, the log records say what happens.
:func:`kestrel.set_progress` sends the lines to a function of the caller's instead."""

from __future__ import annotations

import sys
from typing import Callable, Dict, Optional

#: The caller's function, if any: ``(bar, line)``, ``line`` empty once the bar is cleared.
_hook: Optional[Callable[[int, str], None]] = None
#: Notebook displays by bar.
_handles: Dict[int, object] = {}


def set_hook(hook: Optional[Callable[[int, str], None]]) -> None:
    global _hook
    _hook = hook


def _notebook():
    """IPython's display functions when this runs in a notebook kernel, else None."""
    ipython = sys.modules.get("IPython")
    if ipython is None:
        return None
    shell = ipython.get_ipython()
    if shell is None or type(shell).__name__ == "TerminalInteractiveShell":
        return None
    from IPython import display

    return display


def show(bar: int, line: str) -> None:
    if _hook is not None:
        _hook(bar, line)
        return
    display = _notebook()
    if display is not None:
        bundle = {"text/plain": line}
        if bar in _handles:
            display.update_display(bundle, raw=True, display_id=_handles[bar])
        elif line:
            _handles[bar] = f"kestrel-progress-{bar}"
            display.display(bundle, raw=True, display_id=_handles[bar])
        return
    err = sys.stderr
    if err is not None and hasattr(err, "isatty") and err.isatty():
        err.write("\r" + line + ("\x1b[K" if line else "\r\x1b[K"))
        err.flush()
