"""parallax_ng/runtime/heartbeat.py: the lines a launched task writes for its
launcher, in a real child process with the launcher's environment."""
import os
import subprocess
import sys

from task_env import TASK_PATH

from parallax_ng.runtime import heartbeat

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_a_line_says_run_or_idle_and_parses_back():
    assert heartbeat.line().startswith("heartbeat idle ")
    with heartbeat.running():
        kind, rest = heartbeat.parse(f"noise {heartbeat.MARK} {heartbeat.line()}")
        assert kind == "heartbeat" and rest.split()[0] == "run"
    assert heartbeat.parse("an ordinary line") is None


def child(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, env=dict(os.environ, PYTHONPATH=TASK_PATH, **env))


def test_a_launched_task_beats_and_reports_its_error_in_one_line():
    code = ("import time, parallax_ng.runtime.heartbeat as h; h.start(); h.set_timeout(7); "
            "time.sleep(1.5); from parallax_ng.errors import ConfigError; "
            "raise ConfigError(\"config key 'x' is not known;\\n known keys: a, b\")")
    done = child(code, **{heartbeat.ENV: "worker 1"})
    lines = [heartbeat.parse(ln) for ln in done.stderr.split("\n")]   # MARK is \x1e,
    # which str.splitlines() takes for a line break
    beats = [rest for kind, rest in filter(None, lines) if kind == "heartbeat"]
    errors = [rest for kind, rest in filter(None, lines) if kind == "error"]
    assert len(beats) >= 1 and beats[-1].split()[2] == "7"
    assert errors == ["worker 1: ConfigError: config key 'x' is not known; known keys: a, b"]
    assert "Traceback" not in done.stderr          # a user's mistake: the line only


def test_an_error_the_runner_added_a_line_to_reports_that_line():
    """TensorFlow's first line says little ("Graph execution error:"); the
    line the runner adds (a run that timed out, runtime/executor.py) is
    the one the launcher shows."""
    code = ("import parallax_ng.runtime.heartbeat as h; h.start(); "
            "raise TimeoutError('Graph execution error:\\n\\nOperation timed out.\\n"
            "parallax_ng: worker 1\\'s run of [x] did not end')")
    done = child(code, **{heartbeat.ENV: "worker 1"})
    errors = [rest for kind, rest in filter(None, map(heartbeat.parse, done.stderr.split("\n")))
              if kind == "error"]
    assert errors == ["worker 1: TimeoutError: parallax_ng: worker 1's run of [x] did not end"]


def test_outside_a_launched_job_it_writes_nothing():
    done = child("import parallax_ng.runtime.heartbeat as h; h.start(); raise ValueError('boom')",
                 **{heartbeat.ENV: ""})
    assert heartbeat.MARK not in done.stderr and "ValueError: boom" in done.stderr


def test_the_last_line_says_the_interpreter_ends():
    """`exiting` comes after the program's own exit handlers (the launcher
    waits longer for what follows: TensorFlow's teardown beats no more), and
    no heartbeat follows it, however often they beat (one did, in a CI run,
    with the daemon thread still beating during the interpreter's end)."""
    code = ("import atexit, sys, time, parallax_ng.runtime.heartbeat as h; h.INTERVAL = 1e-4; "
            "sys.setswitchinterval(1e-6); beats = []; write = h._write; "
            "h._write = lambda text: (beats.append(text), write(text)); "
            "h.start(); atexit.register(lambda: sys.stderr.write('handler ran\\n')); "
            "end = time.monotonic() + 20\n"
            "while len(beats) < 20 and time.monotonic() < end: pass")  # exit while it beats
    done = child(code, **{heartbeat.ENV: "worker 0"})
    assert done.returncode == 0, done.stderr
    told = [(ln, heartbeat.parse(ln)) for ln in done.stderr.split("\n")]
    kinds = [p[0] for _, p in told if p]
    assert kinds[-1] == "exiting" and kinds.count("exiting") == 1 and len(kinds) > 20
    lines = [ln for ln, _ in told]
    assert lines.index("handler ran") < [i for i, (_, p) in enumerate(told)
                                         if p and p[0] == "exiting"][0]
