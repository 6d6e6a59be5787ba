"""The launcher's view of a job (parallax_ng/tools/tasks.py): what a task's
event lines set, and which host a restart replaces. (Whole jobs:
tests/test_launch.py, tests/test_restarts.py.)"""
import subprocess
import sys

import pytest

from parallax_ng.resources import load_resources
from parallax_ng.runtime.heartbeat import MARK
from parallax_ng.tools.tasks import THREADS, Job, Outcome, Task, thread_share


def test_a_tasks_events_are_kept():
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    job = Job()
    task = Task("worker 1", process, job=job)
    task._told(f"{MARK} saved 30 /ck/model.ckpt-30")
    task._told(f"{MARK} preempted 31")
    task._told(f"{MARK} error worker 1: ConfigError: bad key")
    assert task.saved == (30, "/ck/model.ckpt-30") and task.preempted == 31
    assert task.error == "ConfigError: bad key"
    job.tasks = [task]
    job.heard()
    assert job.saved == (30, "/ck/model.ckpt-30")


RESOURCES = {"hosts": [{"address": "10.0.0.1", "devices": ["cpu:0"]},
                       {"address": "10.0.0.2", "devices": ["cpu:0"]}],
             "ps": ["10.0.0.5"],
             "spares": [{"address": "10.0.0.8", "devices": ["cpu:0"]},
                        {"address": "10.0.0.9", "devices": ["cpu:0"]}]}


def test_a_host_that_failed_twice_takes_the_next_spare():
    job = Job(resources=load_resources(RESOURCES))
    job.restart(Outcome(9, "worker 1", True), 1, 5)
    assert [h.address for h in job.resources.hosts] == ["10.0.0.1", "10.0.0.2"]
    job.restart(Outcome(9, "worker 1", True), 2, 5)
    assert [h.address for h in job.resources.hosts] == ["10.0.0.1", "10.0.0.8"]
    for count in (3, 4):             # the server's address fails twice: the next spare
        job.restart(Outcome(1, "ps 0", True), count, 5)
    assert job.resources.ps == ("10.0.0.9",)
    job.restart(Outcome(9, "worker 0", True), 5, 5)
    job.restart(Outcome(9, "worker 0", True), 6, 6)     # no spare left: it stays
    assert job.resources.hosts[0].address == "10.0.0.1"


def test_a_run_tensorflow_refused_as_a_repeat_is_not_a_hosts_failure():
    job = Job(resources=load_resources(RESOURCES))
    for count in (1, 2):
        job.restart(Outcome(1, "worker 1", True, hosts_fault=False), count, 5)
    assert job.failures == {} and job.resources.hosts[1].address == "10.0.0.2"


def test_a_preemption_is_not_a_hosts_failure():
    job = Job(resources=load_resources(RESOURCES))
    for count in (1, 2):
        job.preempted_by = "worker 1"
        job.restart(Outcome(143, "worker 1", True), count, 5)
    assert job.failures == {} and job.resources.hosts[1].address == "10.0.0.2"


def test_tasks_on_one_machine_share_its_cores_for_tensorflows_pools():
    assert thread_share(3, {}, cores=2) == dict.fromkeys(THREADS, "1")
    assert thread_share(4, {}, cores=64) == dict.fromkeys(THREADS, "16")
    assert thread_share(1, {}, cores=2) == {}                        # a task alone: as it is
    assert thread_share(3, {"TF_NUM_INTRAOP_THREADS": "2"}, cores=2) == {}   # the user's


PROGRESS = """
import sys
for k in range(3):              # each part once the test has seen the one before
    sys.stdin.readline()
    sys.stdout.write(f"\\r{k}/3 working"); sys.stdout.flush()
sys.stdin.readline()
print("\\r3/3 done   ")
print("next")
"""


def _relayed(monkeypatch, terminal: bool) -> bytes:
    """What the launcher writes of PROGRESS's output: to a terminal (a
    pty), where each part must show before the task writes the next, or
    to a pipe."""
    import os
    import pty
    import select
    master, replica = pty.openpty() if terminal else os.pipe()
    out = os.fdopen(replica, "w")
    monkeypatch.setattr(sys, "stdout", out)
    process = subprocess.Popen([sys.executable, "-c", PROGRESS], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    task = Task("worker 0", process)
    task.relay()
    data = b""
    for k in range(4):
        process.stdin.write(b"\n")
        process.stdin.flush()
        while terminal and k < 3 and b"%d/3 working" % k not in data:
            assert select.select([master], [], [], 30)[0], data     # shown, or a failure
            data += os.read(master, 1 << 16)
    process.stdin.close()
    process.wait(30)
    task.finish()
    out.close()
    while True:
        try:
            chunk = os.read(master, 1 << 16)
        except OSError:         # a pty's reader sees EIO once every writer is gone
            break
        if not chunk:
            break
        data += chunk
    os.close(master)
    return data.replace(b"\r\n", b"\n")       # a terminal's line ending


def test_a_progress_bar_shows_as_it_comes_and_is_kept_as_its_last_part(monkeypatch):
    """Keras's progress bar rewrites one line by carriage returns and ends
    it at the epoch's end. On a terminal each part shows in place as it
    comes (a line read whole had shown nothing until the end), prefixed;
    to a pipe or file only what the terminal would show at the end."""
    shown = _relayed(monkeypatch, terminal=True)
    for k in range(3):
        assert b"\r[worker 0] %d/3 working" % k in shown, shown
    assert shown.endswith(b"\r[worker 0] 3/3 done   \n[worker 0] next\n"), shown
    assert _relayed(monkeypatch, terminal=False) == b"[worker 0] 3/3 done   \n[worker 0] next\n"


def test_another_tasks_line_ends_a_shown_progress_bar(monkeypatch):
    """A line of another task (or another line of the bar's task, a
    warning) while a task's bar is on the terminal starts on a line of its
    own; the bar's task ends the bar in place."""
    import io

    class Terminal(io.BytesIO):
        buffer = property(lambda self: self)

        def isatty(self):
            return True
    out = Terminal()
    monkeypatch.setattr(sys, "stdout", out)
    one, two = (Task(f"worker {k}", None) for k in range(2))
    one._live(b"1/3", b"[worker 0] ", out)
    two._line(b"Epoch 2/2\n", b"[worker 1] ", out)
    one._live(b"2/3", b"[worker 0] ", out)
    one._line(b"a warning\n", b"[worker 0] ", out)        # not the bar: a line of its own
    one._live(b"3/3", b"[worker 0] ", out)
    one._line(b"\r1/3\r3/3 done\n", b"[worker 0] ", out)
    assert out.getvalue() == (b"\r[worker 0] 1/3\n[worker 1] Epoch 2/2\n"
                              b"\r[worker 0] 2/3\n[worker 0] a warning\n"
                              b"\r[worker 0] 3/3\r[worker 0] 3/3 done\n")


TEARDOWN_LINES = (
    "W0000 00:00:1796220489.574492   26579 master_session.cc:2166] UNAVAILABLE: failed to "
    "connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:30230: Failed to connect "
    "to remote host: Connection refused\n"
    "Additional GRPC error information from remote target /job:worker/replica:0/task:1 while "
    "calling /tensorflow.WorkerService/DeleteWorkerSession:\n"
    ':UNKNOWN:Error received from peer  {grpc_message:"failed to connect", grpc_status:14}\n')


@pytest.mark.parametrize("verbose", [False, True])
def test_a_session_closed_after_another_task_ended_is_not_shown(verbose):
    """A worker that closes its session after another task's process ended
    (the job done) gets TensorFlow's warning and gRPC's two lines naming
    DeleteWorkerSession: dropped, whole, and only they (the same lines
    about another call, or split by another line, are shown)."""
    import io
    import os

    class Out(io.BytesIO):
        buffer = property(lambda self: self)

        def isatty(self):
            return False
    other = TEARDOWN_LINES.replace("DeleteWorkerSession", "RunGraph")
    text = ("before\n" + TEARDOWN_LINES + TEARDOWN_LINES.split("\n", 1)[1] + "between\n" +
            other + TEARDOWN_LINES.split("\n")[0] + "\nafter\n" + TEARDOWN_LINES[:150])
    out = Out()
    read, write = os.pipe()
    for k in range(0, len(text), 97):       # in pieces that split lines
        os.write(write, text[k:k + 97].encode())
    os.close(write)
    Task("worker 0", None, verbose=verbose)._copy(os.fdopen(read, "rb"), out)
    shown = out.getvalue().decode().replace("[worker 0] ", "")
    if verbose:
        assert shown == text + "\n"
    else:
        assert shown == ("before\nbetween\n" + other + TEARDOWN_LINES.split("\n")[0] +
                         "\nafter\n" + TEARDOWN_LINES[:150] + "\n")
