"""Heartbeat: what a task of a launched job tells its launcher besides its
output, so a job that stops making progress names the task that stopped.

Requires: PARALLAX_NG_HEARTBEAT in the environment (the launcher sets it;
`start` does nothing without it). Guarantees: from `start` on, a daemon
thread writes one line to stderr every INTERVAL seconds,
`MARK heartbeat <state> <seconds in it> <timeout>`: state `run` while the
process is inside a runner's step (`running`), `idle` otherwise, and the
job's `communication.timeout_seconds` once a runner or server has said it
(`set_timeout`). A stopped process (SIGSTOP) or one held in a call that
never gives the interpreter back writes none. An exception that ends the
task is reported as one line `MARK error <task>: <Type>: <message>`; a
ParallaxError (a user's mistake: config, resources, graph) is printed only
as that line, its traceback only with PARALLAX_NG_VERBOSE=1. `tell` writes
an event the launcher keeps: `saved <step> <path>` once worker 0 has written
a checkpoint of the job, `trained <step>` after a process's first training
step (what a restarted job's launcher waits for), `exiting` when the
interpreter ends (after the program and its other exit handlers: what
follows, TensorFlow's teardown, writes no heartbeat; none follows it). The launcher
reads these lines (parallax_ng/tools/launch.py) and shows none of them. Writes
are single `os.write`s of whole lines, so they never break a line of the
task's own output in two unless the task left one unfinished.
"""
from __future__ import annotations

import atexit
import os
import sys
import threading
import time
from contextlib import contextmanager

ENV = "PARALLAX_NG_HEARTBEAT"          # the task's name, e.g. "worker 1"
VERBOSE_ENV = "PARALLAX_NG_VERBOSE"
MARK = "\x1eparallax_ng"               # starts every line the launcher keeps to itself
INTERVAL = 1.0                          # seconds between heartbeats

_state = {"running": 0, "since": time.monotonic(), "timeout": 0.0, "started": False,
          "exiting": False}
_lock = threading.Lock()
_told = threading.Lock()       # a heartbeat and `exiting` are written one at a time


def start() -> None:
    """Start the heartbeat and the one-line error report of a launched task."""
    name = os.environ.get(ENV)
    if not name or _state["started"]:
        return
    _state["started"] = True
    threading.Thread(target=_beat, name="parallax_ng heartbeat", daemon=True).start()
    atexit.register(_exiting)                 # registered first: runs after the others
    previous = sys.excepthook

    def report(kind, value, tb):
        from ..errors import ParallaxError
        text = str(value).strip()
        # a user's mistake whole on one line; another error's first line, or
        # the line the runner added to it (a run that timed out says which)
        ours = [line for line in text.splitlines() if line.startswith("parallax_ng: ")]
        text = " ".join(text.split()) if issubclass(kind, ParallaxError) else (
            ours[-1] if ours else text.splitlines()[0] if text else "")
        _write(f"error {name}: {kind.__name__}: {text}")
        if not issubclass(kind, ParallaxError) or os.environ.get(VERBOSE_ENV) == "1":
            previous(kind, value, tb)
    sys.excepthook = report


def tell(kind: str, text: str) -> None:
    """An event for the launcher (nothing outside a launched task)."""
    if _state["started"]:
        _write(f"{kind} {text}")


def set_timeout(seconds: float) -> None:
    """The job's timeout, which the launcher waits for a silent task."""
    _state["timeout"] = max(_state["timeout"], float(seconds))


@contextmanager
def running():
    """Marks the time inside a runner's step (a task that stays out of its
    runner while the others wait in theirs is the one holding the job)."""
    with _lock:
        if not _state["running"]:
            _state["since"] = time.monotonic()
        _state["running"] += 1
    try:
        yield
    finally:
        with _lock:
            _state["running"] -= 1
            if not _state["running"]:
                _state["since"] = time.monotonic()


def line() -> str:
    """This task's heartbeat line (without MARK)."""
    with _lock:
        state = "run" if _state["running"] else "idle"
        held = time.monotonic() - _state["since"]
    return f"heartbeat {state} {held:.1f} {_state['timeout']:g}"


def parse(text: str) -> tuple[str, str] | None:
    """(kind, rest) of a line a task wrote for its launcher, else None."""
    at = text.find(MARK)
    if at < 0:
        return None
    kind, _, rest = text[at + len(MARK):].strip().partition(" ")
    return kind, rest


def _beat() -> None:
    while True:
        with _told:
            if _state["exiting"]:
                return
            _write(line())
        time.sleep(INTERVAL)


def _exiting() -> None:
    """`exiting`, the last line: no heartbeat is written after it."""
    with _told:
        _state["exiting"] = True
        _write("exiting ")


def _write(text: str) -> None:
    try:
        os.write(2, f"{MARK} {text}\n".encode())
    except OSError:     # the launcher is gone: nothing to tell
        pass
