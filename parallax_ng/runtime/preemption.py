"""Preemption: SIGTERM makes a job write a checkpoint at a step every worker
reaches, then stop.

Requires: a runner with checkpoints (`checkpoint.dir`, storage every worker
shares) in the process's main thread. SIGTERM may reach one worker or all
(the launcher passes it on to every worker when it or any task gets one;
an orchestrator may give it to one pod): a worker that did not get it
learns of it from the others' files, which it looks for once a second.
Guarantees: `install` (a Preemption installs it) makes SIGTERM set a
request for the process, which goes on; `stop_at(step)`, called after each
training step once a request came, says the step at which this worker
saves and stops. In one process that is the step just trained. In a job
every worker writes the step it was at when it saw the request
(`<dir>/stop/<run>/worker-<i>`, <run> naming this start of the job: the
launcher's, else the step it resumed from) and stops at one
past the largest of them, S = max(k) + 1: workers train in lockstep (no
worker finishes step s before every other began it), so when any worker
finishes step S every worker's file is there and each of them computes the
same S, and none is past it. A second SIGTERM a second or more later, or
the grace period passing, ends the process as SIGTERM's default does (a
process that trains no more does not stay). Without a runner that
checkpoints, SIGTERM keeps its default (the process ends).
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import NoReturn

from . import heartbeat

RUN_ENV = "PARALLAX_NG_RUN"     # one start of a launched job (the launcher sets it)
GRACE_ENV = "PARALLAX_NG_GRACE_SECONDS"   # how long a preempted process may take
EXIT_CODE = 143                 # 128 + SIGTERM: the task stopped for a preemption
REPEAT = 1.0                    # seconds after which another SIGTERM ends the process
POLL = 1.0                      # seconds between looks for another worker's request

_request = {"at": None, "installed": False}    # one per process: every runner sees it


def requested() -> bool:
    """Whether this process got SIGTERM (after `install`)."""
    return _request["at"] is not None


def install() -> bool:
    """SIGTERM requests the stop (only from the main thread, and only where
    SIGTERM still has its default handler); whether it does now. A second
    SIGTERM (REPEAT seconds or more after the first), or the grace period
    passing (PARALLAX_NG_GRACE_SECONDS, default 30), ends the process as
    SIGTERM's default would: a process out of training does not stay."""
    if _request["installed"]:
        return True
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return False
    signal.signal(signal.SIGTERM, _on_sigterm)
    _request["installed"] = True
    return True


def _on_sigterm(signum, frame) -> None:
    now = time.monotonic()
    if _request["at"] is None:
        _request["at"] = now
        heartbeat.tell("stopping", "SIGTERM")
        grace = float(os.environ.get(GRACE_ENV) or 30)
        timer = threading.Timer(grace, _end, args=(grace,))
        timer.daemon = True
        timer.start()
    elif now - _request["at"] >= REPEAT:
        _end(None)


def _end(grace) -> None:
    """As SIGTERM's default (no clean-up), with the shell's code for it,
    143; from the handler or the grace timer's thread."""
    if grace is not None:
        print(f"parallax_ng: still running {grace:g} s after SIGTERM; ending",
              file=sys.stderr, flush=True)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(EXIT_CODE)


def end() -> NoReturn:
    """End this process after the checkpoint, as SIGTERM would have (code
    143), by SystemExit: the script's `finally` blocks and the exit
    handlers (a worker telling the servers it is done) still run. (The one
    process end below tools/: the signal's sender decided it.)"""
    raise SystemExit(EXIT_CODE)


class Preemption:
    def __init__(self, directory: str, worker: int = 0, workers: int = 1):
        self.worker, self.workers = worker, workers
        self.root = os.path.join(directory, "stop")
        self.start = 0                 # the step the job resumed from (the runner sets it)
        self.at: int | None = None     # the step this worker was at when it saw the request
        self._looked = time.monotonic()   # when it last looked for other workers' files
        install()

    @property
    def requested(self) -> bool:
        """This process got SIGTERM, or (looked at once every POLL seconds)
        another worker of this start of the job did: an orchestrator may
        give it to one task only."""
        if requested() or self.at is not None:
            return True
        now = time.monotonic()
        if self.workers == 1 or now - self._looked < POLL:
            return False
        self._looked = now
        try:
            return bool(os.listdir(self.directory))
        except OSError:
            return False

    @property
    def directory(self) -> str:
        return os.path.join(self.root, os.environ.get(RUN_ENV) or f"from-{self.start}")

    def stop_at(self, step: int) -> int | None:
        """The step this worker saves and stops at, once every worker's step
        at the request is known (None before)."""
        if self.workers == 1:
            return step
        if self.at is None:
            self.at = step
            os.makedirs(self.directory, exist_ok=True)
            path = os.path.join(self.directory, f"worker-{self.worker}")
            with open(path + ".tmp", "w") as f:
                f.write(str(step))
            os.replace(path + ".tmp", path)     # whole or absent for a reader
        seen = []
        for w in range(self.workers):
            try:
                with open(os.path.join(self.directory, f"worker-{w}")) as f:
                    seen.append(int(f.read()))
            except (OSError, ValueError):
                return None
        return max(seen) + 1
