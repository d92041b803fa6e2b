"""A test that hangs ends the run instead of using up CI's whole time limit.

Each test arms a timer of `test_timeout` seconds (pytest.ini; `-o test_timeout=0` turns it off).
When it fires, SIGALRM's handler, faulthandler's C one, prints the stack of every thread, the hung
test's among them, and the process then dies of the signal ("Alarm clock"). A C signal handler
needs neither the GIL nor the interpreter's attention, so it fires in hangs that hold the GIL
inside C too (a fork that deadlocked, a stuck collective); and forked children, which do not
inherit the timer, are left as they are.
"""
import faulthandler
import os
import signal

import pytest


def pytest_addoption(parser):
    parser.addini("test_timeout", "seconds a test may run before the stacks of its threads are "
                  "printed and the run ends (0: no limit)", default="0")


def _seconds(config) -> float:
    value = config.getini("test_timeout")
    try:
        return float(value)
    except ValueError:
        raise pytest.UsageError(f"test_timeout: expected a number of seconds, got {value!r}")


def pytest_configure(config):
    if _seconds(config) > 0:
        # the terminal's stderr (output capture is suspended while plugins configure), and the
        # default action, ending the process, once the stacks are out
        faulthandler.register(signal.SIGALRM, file=os.dup(2), all_threads=True, chain=True)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    seconds = _seconds(item.config)
    if seconds > 0:
        signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        if seconds > 0:
            signal.setitimer(signal.ITIMER_REAL, 0)
