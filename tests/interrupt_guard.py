"""A test that lets a KeyboardInterrupt out fails alone; the session runs on (loaded by the root conftest.py).

pytest ends the whole session on a KeyboardInterrupt from a test: right for a developer's Ctrl-C, wrong for a
test of interrupts that lets one escape (CI once lost 128 tests that way). SIGINT's handler here tells the two
apart: a test that interrupts its own process announces it first (``interrupt_this_process``); an interrupt
nobody announced came from outside (Ctrl-C) and ends the session as usual. Any other KeyboardInterrupt that
escapes a test's setup, call or teardown (announced, or raised by code) fails that test. pytest already
reports a test's SystemExit as that test's failure.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable

import pytest


class InterruptEscaped(Exception):
    """A KeyboardInterrupt escaped a test: that test fails, and the others still run."""


class _Sigint:
    """SIGINT's handler for the session: it raises KeyboardInterrupt, as Python's default handler and a
    Jupyter kernel do, and remembers whether an interrupt came from outside."""

    def __init__(self, ignored: bool):
        self.ignored = ignored  # the session inherited SIGINT ignored (`pytest &` from a script)
        self.sent = 0  # interrupts tests announced (any thread, under the lock)
        self.taken = 0  # announced interrupts that arrived (only here, in the main thread: no lock needed)
        self.from_outside = False
        self.lock = threading.Lock()  # between announcing threads; never taken here, where it could deadlock

    def __call__(self, signum: int, frame: object) -> None:
        if self.taken < self.sent:
            self.taken += 1
        elif self.ignored:
            return
        else:
            self.from_outside = True
        raise KeyboardInterrupt


_handler: _Sigint | None = None


def interrupt_this_process() -> None:
    """Send SIGINT to this process, as Jupyter's Interrupt does to a kernel, announced as a test's own."""
    if _handler is None:
        raise RuntimeError("tests/interrupt_guard.py is not loaded: conftest.py loads it for every test")
    with _handler.lock:
        _handler.sent += 1
    os.kill(os.getpid(), signal.SIGINT)


@pytest.fixture
def interrupt_when():
    """``interrupt_when(ready)``: a thread interrupts this process once ``ready()`` holds (asked every 50 ms,
    for at most 300 s); no interrupt is sent after the test."""
    lock, done, threads, errors = threading.Lock(), threading.Event(), [], []

    def start(ready: Callable[[], bool]) -> None:
        def wait_then_interrupt() -> None:
            end = time.monotonic() + 300
            while not done.is_set() and time.monotonic() < end:
                try:
                    now = ready()
                except Exception as e:  # told at the test's end: the interrupt was never sent
                    errors.append(e)
                    return
                if now:
                    with lock:
                        if not done.is_set():
                            interrupt_this_process()
                    return
                done.wait(0.05)

        threads.append(threading.Thread(target=wait_then_interrupt, daemon=True, name="interrupt_when"))
        threads[-1].start()

    yield start
    with lock:
        done.set()
    for thread in threads:
        thread.join()
    if errors:
        raise RuntimeError("interrupt_when: ready() raised, so no interrupt was sent") from errors[0]


def pytest_configure(config: pytest.Config) -> None:
    global _handler
    if threading.current_thread() is threading.main_thread():
        _handler = _Sigint(ignored=signal.getsignal(signal.SIGINT) == signal.SIG_IGN)
        signal.signal(signal.SIGINT, _handler)


def _guard(when: str):
    try:
        return (yield)
    except KeyboardInterrupt as e:
        if _handler is not None and _handler.from_outside:
            raise  # a Ctrl-C: stop the session, as pytest does
        raise InterruptEscaped(
            f"a KeyboardInterrupt escaped this test's {when}: it fails alone, and the session runs on"
        ) from e


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item):
    return (yield from _guard("setup"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    return (yield from _guard("call"))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):
    return (yield from _guard("teardown"))
