"""A clock that moves only when the test moves it, for testing timing logic (probes, timers, the
progress log) without depending on how fast or how busy the machine is."""
from __future__ import annotations

import contextlib
import types


class VirtualClock:
    """Stands in for the `time` module of the code under test: every clock reads `now`, and
    sleep() and busy_wait() advance it instead of waiting. `tick`, when set, advances the clock by
    that much at every read (a clock that runs while code runs)."""

    def __init__(self, start: float = 0.0, tick: float = 0.0):
        self.now = start
        self.tick = tick

    def read(self) -> float:
        self.now += self.tick
        return self.now

    perf_counter = process_time = monotonic = time = read

    def advance(self, seconds: float) -> None:
        self.now += seconds

    sleep = busy_wait = advance

    def as_time_module(self) -> types.SimpleNamespace:
        return types.SimpleNamespace(perf_counter=self.read, process_time=self.read,
                                     monotonic=self.read, time=self.read, sleep=self.advance)


@contextlib.contextmanager
def installed(clock: VirtualClock, module, *names: str):
    """Replace `module.time` (and `module.<name>` for each of `names`, e.g. a busy_wait helper)
    with the clock's for the duration; for forked ranks, where pytest's monkeypatch is absent."""
    saved = {name: getattr(module, name) for name in ("time", *names)}
    module.time = clock.as_time_module()
    for name in names:
        setattr(module, name, getattr(clock, name))
    try:
        yield clock
    finally:
        for name, value in saved.items():
            setattr(module, name, value)
