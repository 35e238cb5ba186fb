"""Ctrl-C ("interrupt kernel") stops Kestrel's work in the cell within seconds, leaving only whole
files: `kestrel.fit` in a Python process of its own (as a notebook kernel runs it), and
`kestrel.spark.fit` on the cluster (its barrier stage cancelled, the slots free again)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from conftest import wait_until
from kestrel import spark as ks


def epochs_done(run: Path) -> int:
    m = run / "metrics.jsonl"
    return len(m.read_text().splitlines()) if m.is_file() else 0


def assert_whole(run: Path) -> None:
    """Every JSON file of the run parses, every line of its metrics too, and no run finished."""
    assert not (run / "summary.json").exists(), "the interrupted run did not finish"
    for p in run.rglob("*.json"):
        if ".tmp." not in p.name:
            json.loads(p.read_text())
    for line in (run / "metrics.jsonl").read_text().splitlines():
        json.loads(line)


def test_ctrl_c_stops_kestrel_fit_within_a_batch(lfw_dir, tmp_path):
    run = tmp_path / "run"
    script = textwrap.dedent(
        f"""
        import kestrel
        try:
            kestrel.fit({str(lfw_dir)!r}, out={str(run)!r}, epochs=100000, batch_size=8, optimizer="sgd",
                        no_mlflow=True, engine="tract", cache={str(tmp_path / "cache")!r})
            print("FINISHED", flush=True)
        except KeyboardInterrupt:
            print("INTERRUPTED", flush=True)
        """
    )
    # Ctrl-C as a terminal sends it: a test command started in the background of a shell without
    # job control inherits SIGINT ignored, and Python then installs no KeyboardInterrupt for it.
    p = subprocess.Popen(
        [sys.executable, "-c", script],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        wait_until("the first epoch", lambda: epochs_done(run) >= 1 or p.poll() is not None, timeout=300)
        assert p.poll() is None, p.communicate()
        t0 = time.monotonic()
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=60)
        took = time.monotonic() - t0
    finally:
        p.kill()
    print(f"stopped {took:.2f} s after Ctrl-C")
    assert "INTERRUPTED" in out, (out, err[-2000:])
    assert took < 10, took
    assert_whole(run)


def test_interrupt_kernel_cancels_a_spark_fit(spark, lfw, shared):
    run = shared / "interrupted"
    main = threading.main_thread().ident

    def interrupt_after_an_epoch():
        wait_until("the first epoch on the cluster", lambda: epochs_done(run) >= 1, timeout=300)
        signal.pthread_kill(main, signal.SIGINT)  # what "interrupt kernel" does

    t = threading.Thread(target=interrupt_after_an_epoch, daemon=True)
    t.start()
    with pytest.raises(KeyboardInterrupt):
        ks.fit(lfw, out=str(run), num_workers=2, epochs=100000, batch_size=8, optimizer="sgd", no_mlflow=True,
               engine="tract", threads=1, cache=str(shared / "cache"))
    t0 = time.monotonic()
    t.join(timeout=5)
    # The barrier stage released its slots: a job that needs every slot at once runs.
    ks.check_shared(spark, str(shared), "shared")
    print(f"slots free {time.monotonic() - t0:.2f} s after the interrupt")
    assert_whole(run)
