"""tests/interrupt_guard.py: a KeyboardInterrupt that escapes a test fails that test alone, while a Ctrl-C
from outside still ends the session; each checked in a pytest session of its own."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from ddp_test_support import REPO

TESTS = """
import time

def test_raises_keyboardinterrupt():
    raise KeyboardInterrupt

def test_exits():
    raise SystemExit(3)

def test_interrupts_its_own_process(interrupt_when):
    interrupt_when(lambda: True)
    time.sleep(600)

def test_after_them():
    pass
"""


def _pytest(folder, *args: str) -> subprocess.Popen:
    """A pytest session in ``folder`` with the guard loaded, SIGINT handled as in a fresh process."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen(
        [sys.executable, "-m", "pytest", "-p", "tests.interrupt_guard", "-p", "no:cacheprovider", *args],
        cwd=folder,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def test_an_escaping_keyboardinterrupt_fails_only_its_own_test(tmp_path):
    (tmp_path / "test_escapes.py").write_text(TESTS)
    out, _ = _pytest(tmp_path, "-rf").communicate(timeout=300)
    assert "1 passed" in out and "3 failed" in out, out
    for name in ("test_raises_keyboardinterrupt", "test_exits", "test_interrupts_its_own_process"):
        assert f"FAILED test_escapes.py::{name}" in out, out
    assert "a KeyboardInterrupt escaped this test's call: it fails alone" in out, out


def test_a_ctrl_c_from_outside_still_ends_the_session(tmp_path):
    (tmp_path / "test_waits.py").write_text(
        f"import time\n\ndef test_waits():\n    open({str(tmp_path / 'started')!r}, 'w').close()\n"
        "    time.sleep(600)\n\ndef test_never_runs():\n    pass\n"
    )
    session = _pytest(tmp_path, "-v")
    # The file is made in test_waits's call; the interrupt ends the session wherever in that call it lands.
    while not (tmp_path / "started").exists():
        assert session.poll() is None, session.stdout.read()
        time.sleep(0.05)
    session.send_signal(signal.SIGINT)
    out, _ = session.communicate(timeout=300)
    assert session.returncode == 2 and "KeyboardInterrupt" in out, out
    assert "test_never_runs" not in out, out
