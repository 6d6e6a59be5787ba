"""Benchmark: how long a job takes to train again after it loses a task.

Starts `parallax-ng run --restarts 1` jobs of tests/resume_script.py (an
embedding model with Adam, clipping and moving averages; 2 workers + 1
server on this machine; a checkpoint every 30 steps) and, at step 100 of
200, SIGKILLs worker 1, SIGKILLs the server, SIGSTOPs worker 1 (found by
its silence after `communication.timeout_seconds`) or SIGTERMs the launcher
(a preemption: checkpoint and stop, then a second launch resumes). Prints,
for each, the seconds from the loss to the launcher's restart and to the
first training step after it (the launcher's own `training again` line),
and the steps trained again (from the last checkpoint).

    python benchmarks/restart_time.py [--timeout 8] [--repeats 1] [--launch fork,no-fork]

`--launch` says how the launcher starts its tasks: `fork` (the default:
forked from one process that imported TensorFlow, tools/forking.py) and
`no-fork` (`parallax-ng run --no-fork`: a process of its own each); each
case runs under each, one row apiece.
"""
import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "resume_script.py")
ENV = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2")


class Job:
    """A launcher with its output lines time-stamped as they come."""

    def __init__(self, argv):
        self.lines, self.new = [], threading.Condition()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "parallax_ng", "run", *argv], env=ENV, text=True,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        self.readers = [threading.Thread(target=self._read, args=(p,), daemon=True)
                        for p in (self.process.stdout, self.process.stderr)]
        for t in self.readers:
            t.start()

    def _read(self, pipe):
        for line in pipe:
            with self.new:
                self.lines.append((time.monotonic(), line.rstrip("\n")))
                self.new.notify_all()

    def wait_for(self, pattern, timeout=300):
        deadline = time.monotonic() + timeout
        with self.new:
            while True:
                for at, line in self.lines:
                    found = re.search(pattern, line)
                    if found:
                        return at, found
                if time.monotonic() > deadline or self.process.poll() is not None and \
                        not any(t.is_alive() for t in self.readers):
                    raise RuntimeError(f"no line matches {pattern!r}")
                self.new.wait(1.0)

    def finish(self):
        code = self.process.wait(600)
        for t in self.readers:
            t.join(10)
        return code


def one(case: str, timeout: float, launch: str = "fork") -> dict:
    tmp = tempfile.mkdtemp()
    res = os.path.join(tmp, "r.yaml")
    with open(res, "w") as f:
        f.write("hosts:\n" + "  - address: 127.0.0.1\n    devices: [cpu:0]\n" * 2
                + "ps: [127.0.0.1]\n")
    config = json.dumps({"communication": {"timeout_seconds": timeout},
                         "sparse_method": "ps"})
    argv = ["-r", res, *(["--restarts", "1"] if case != "sigterm" else []),
            *(["--no-fork"] if launch == "no-fork" else []), SCRIPT, "--",
            os.path.join(tmp, "ck"), os.path.join(tmp, "out"), "200", "--run-option",
            "hybrid", "--every", "30", "--print-steps", "--config", config]
    job = Job(argv)
    task = {"kill-worker": "worker 1", "kill-server": "ps 0", "stop-worker": "worker 1"}
    victim = int(job.wait_for(rf"started {task[case]} \(pid (\d+)\)")[1].group(1)) \
        if case in task else job.process.pid
    job.wait_for(r"^\[worker 1\] step 100$")
    sent = time.monotonic()
    os.kill(victim, {"stop-worker": signal.SIGSTOP, "sigterm": signal.SIGTERM}.get(
        case, signal.SIGKILL))
    if case == "sigterm":
        assert job.finish() == 143
        stopped, found = job.wait_for(r"the job stopped at step (\d+)")
        again = Job(argv)
        first, _ = again.wait_for(r"^\[worker \d\] step \d+$")
        assert again.finish() == 0
        return {"restart": stopped - sent, "training": None, "again": 0,
                "saved": int(found.group(1)), "relaunch": first - again.lines[0][0]}
    restart, found = job.wait_for(r"restart 1 of 1: .* resumes from step (\d+)")
    training, _ = job.wait_for(r"training again")
    assert job.finish() == 0
    steps = [re.match(r"\[worker \d\] step (\d+)$", line) for at, line in job.lines
             if at < restart]
    reached = max(int(m.group(1)) for m in steps if m)
    return {"restart": restart - sent, "training": training - sent,
            "again": reached - int(found.group(1))}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--timeout", type=float, default=8.0,
                        help="communication.timeout_seconds (how long a stopped task "
                             "goes unnoticed)")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--cases", default="kill-worker,kill-server,stop-worker,sigterm")
    parser.add_argument("--launch", default="fork",
                        help="fork, no-fork or both (fork,no-fork)")
    opts = parser.parse_args()
    print("case          | launch  | to restart (s) | to training again (s) | steps trained again")
    for case in opts.cases.split(","):
        for launch in opts.launch.split(","):
            runs = [one(case, opts.timeout, launch) for _ in range(opts.repeats)]
            med = {k: statistics.median(r[k] for r in runs) if runs[0][k] is not None
                   else None for k in runs[0]}
            if case == "sigterm":
                print(f"{case:13} | {launch:7} | checkpoint of step {med['saved']:.0f} and "
                      f"stop: {med['restart']:.1f} s after SIGTERM; a new launch trains "
                      f"{med['relaunch']:.1f} s after it starts")
                continue
            print(f"{case:13} | {launch:7} | {med['restart']:14.1f} | "
                  f"{med['training']:21.1f} | {med['again']:.0f}")


if __name__ == "__main__":
    main()
