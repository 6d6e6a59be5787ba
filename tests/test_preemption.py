"""SIGTERM as a preemption's notice (parallax_ng/runtime/preemption.py): the
step every worker stops at, and a process that gets SIGTERM goes on, but not
for ever. (Whole jobs: tests/test_restarts.py.)"""
import os
import signal
import subprocess
import sys
import time

from task_env import TASK_PATH

from parallax_ng.runtime import preemption
from parallax_ng.runtime.preemption import RUN_ENV, Preemption

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_one_process_stops_at_the_step_it_is_at(tmp_path):
    assert Preemption(str(tmp_path)).stop_at(17) == 17


def test_workers_stop_one_past_the_largest_step_any_was_at(tmp_path, monkeypatch):
    """Worker 0 heard at step 10, worker 1 at 11: until both have written,
    no stop; then both stop at 12, wherever each is."""
    monkeypatch.setenv(RUN_ENV, "run-a")
    first, second = Preemption(str(tmp_path), 0, 2), Preemption(str(tmp_path), 1, 2)
    assert first.stop_at(10) is None
    assert first.stop_at(11) is None          # its step at the request stays 10
    assert second.stop_at(11) == 12
    assert first.stop_at(12) == 12
    assert sorted(os.listdir(tmp_path / "stop" / "run-a")) == ["worker-0", "worker-1"]


def test_a_worker_without_sigterm_learns_of_it_from_the_others_files(tmp_path, monkeypatch):
    """An orchestrator may give SIGTERM to one pod: the other workers look
    for its file (once every POLL seconds) and stop with it."""
    monkeypatch.setenv(RUN_ENV, "run-c")
    monkeypatch.setattr(preemption, "POLL", 0.0)
    told, other = Preemption(str(tmp_path), 0, 2), Preemption(str(tmp_path), 1, 2)
    assert not other.requested
    told.stop_at(30)
    assert other.requested
    assert other.stop_at(31) == 32 and told.stop_at(31) == 32


def test_each_start_of_a_job_has_its_own_files(tmp_path, monkeypatch):
    """Files a stopped start left do not stop the next one: a launched
    start is named by the launcher, another by the step it resumed from."""
    monkeypatch.setenv(RUN_ENV, "run-a")
    for w in (0, 1):
        Preemption(str(tmp_path), w, 2).stop_at(5)
    monkeypatch.setenv(RUN_ENV, "run-b")
    assert Preemption(str(tmp_path), 0, 2).stop_at(8) is None
    monkeypatch.delenv(RUN_ENV)
    resumed = Preemption(str(tmp_path), 0, 2)
    resumed.start = 6
    assert resumed.directory == str(tmp_path / "stop" / "from-6")


CHILD = """
import sys, time
from parallax_ng.runtime import preemption
assert preemption.install()
print("ready", flush=True)
while not preemption.requested():
    time.sleep(0.01)
print("requested", flush=True)
time.sleep(float(sys.argv[1]))
print("still here", flush=True)
"""


def start_child(tmp_path, linger: float, grace: str):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    env = dict(os.environ, PYTHONPATH=TASK_PATH, TF_CPP_MIN_LOG_LEVEL="2",
               PARALLAX_NG_GRACE_SECONDS=grace)
    child = subprocess.Popen([sys.executable, str(script), str(linger)], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert child.stdout.readline() == "ready\n"
    return child


def test_sigterm_requests_and_the_process_goes_on_until_its_grace_ends(tmp_path):
    """The first SIGTERM only requests (a second within a second is the
    same notice twice); the grace period ends the process as SIGTERM would."""
    child = start_child(tmp_path, linger=60, grace="1.5")
    sent = time.monotonic()
    child.send_signal(signal.SIGTERM)
    assert child.stdout.readline() == "requested\n"
    child.send_signal(signal.SIGTERM)
    out, err = child.communicate(timeout=30)
    assert child.returncode == 143
    assert 1.4 < time.monotonic() - sent < 20
    assert "still here" not in out
    assert "parallax_ng: still running 1.5 s after SIGTERM; ending" in err


def test_a_second_sigterm_later_ends_the_process_at_once(tmp_path):
    child = start_child(tmp_path, linger=60, grace="60")
    child.send_signal(signal.SIGTERM)
    assert child.stdout.readline() == "requested\n"
    time.sleep(1.2)
    child.send_signal(signal.SIGTERM)
    out, _ = child.communicate(timeout=30)
    assert child.returncode == 143 and "still here" not in out


def test_a_process_that_finishes_within_its_grace_ends_as_it_would(tmp_path):
    child = start_child(tmp_path, linger=0.2, grace="30")
    child.send_signal(signal.SIGTERM)
    out, _ = child.communicate(timeout=30)
    assert child.returncode == 0 and out.endswith("still here\n")
