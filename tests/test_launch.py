"""The launcher as its user meets it (parallax_ng/tools/launch.py): SIGTERM stops
every task (workers without checkpoints at once), a task that stops making progress is named within the job's
timeout, a user's mistake is one line, a task killed by a signal gives the
shell's exit code. Real `parallax-ng run` jobs on 127.0.0.1
(tests/launch_script.py)."""
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest
from task_env import TASK_PATH

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "launch_script.py")
ENV = dict(os.environ, PYTHONPATH=TASK_PATH, TF_CPP_MIN_LOG_LEVEL="2")
TIMEOUT = 8          # the jobs' communication.timeout_seconds


def resources(tmp_path, servers=0, ports=None):
    path = tmp_path / "r.yaml"
    addresses = [f"127.0.0.1:{p}" if p else "127.0.0.1" for p in (ports or [None, None])]
    path.write_text("hosts:\n" + "".join(f"  - address: {a}\n    devices: [cpu:0]\n"
                                         for a in addresses)
                    + (f"ps: [{', '.join(['127.0.0.1'] * servers)}]\n" if servers else ""))
    return str(path)


def command(tmp_path, *script_args, config=None, servers=0, launcher=()):
    config = config or {"run_option": "allreduce",
                        "communication": {"timeout_seconds": TIMEOUT}}
    return [sys.executable, "-m", "parallax_ng", "run", SCRIPT, "-r",
            resources(tmp_path, servers), *launcher, "--", "--config", json.dumps(config),
            *script_args]


class Job:
    """A job started in the background, its launcher's stderr read line by line."""

    def __init__(self, cmd):
        self.process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        text=True, env=ENV)
        self.pids, self.err = {}, []

    def wait_for_steps(self, count: int = 1, seconds: float = 120) -> None:
        """Until worker 0 printed `count` steps (every task started)."""
        deadline = time.monotonic() + seconds
        seen = 0
        while seen < count and time.monotonic() < deadline:
            line = self.process.stdout.readline()
            assert line, self.finish()
            seen += line.startswith("[worker 0] step")
        assert seen >= count
        for line in self.process.stderr:
            self.err.append(line)
            if " (pid " in line and "started" in line:
                name = line.split("started ")[1].split(" (pid")[0]
                self.pids[name] = int(line.split("(pid ")[1].split(")")[0])
            if len(self.pids) == self.tasks:
                return

    tasks = 2

    def finish(self, seconds: float = 120) -> str:
        try:
            self.process.wait(timeout=seconds)
        finally:
            if self.process.poll() is None:
                self.process.kill()
        self.err.append(self.process.stderr.read())
        self.process.stdout.read()
        return "".join(self.err)

    def assert_all_gone(self) -> None:
        for pid in self.pids.values():
            for _ in range(50):
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.1)
            else:
                raise AssertionError(f"pid {pid} outlived the job")


def test_sigterm_stops_every_task_and_exits_143(tmp_path):
    job = Job(command(tmp_path))
    job.wait_for_steps(3)
    job.process.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    err = job.finish(60)
    assert job.process.returncode == 143, err
    assert time.monotonic() - sent < 20
    assert err.count("the launcher got SIGTERM: passed on to every worker") == 1
    assert "every worker stopped; none saved a checkpoint" in err
    job.assert_all_gone()


@pytest.mark.parametrize("victim", ["worker 1", "ps 0"])
def test_a_stopped_task_is_named_within_the_timeout(tmp_path, victim):
    """SIGSTOP: the task's heartbeat stops; the job ends within the timeout
    plus a few seconds naming it, not the worker that timed out waiting."""
    config = {"run_option": "ps" if victim == "ps 0" else "allreduce",
              "communication": {"timeout_seconds": TIMEOUT}}
    job = Job(command(tmp_path, config=config, servers=int(victim == "ps 0")))
    job.tasks = 2 + (victim == "ps 0")
    job.wait_for_steps(3)
    os.kill(job.pids[victim], signal.SIGSTOP)
    stopped = time.monotonic()
    err = job.finish(120)
    took = time.monotonic() - stopped
    assert job.process.returncode == 1, err
    said = [ln for ln in err.splitlines() if "stopped making progress" in ln]
    assert len(said) == 1 and said[0].startswith(
        f"parallax-ng run: {victim} (pid {job.pids[victim]}) stopped making progress: no "
        "heartbeat"), err
    assert took < TIMEOUT + 8, took
    job.assert_all_gone()


def test_a_worker_that_ends_after_fewer_runs_is_named_by_the_one_left_waiting(tmp_path):
    """Worker 0 ends after 3 steps, worker 1 goes on to a fourth: its
    all-reduce loses worker 0. Before, the job ended with TensorFlow's
    "UnavailableError: Graph execution error:"; now the line names the run,
    the lost worker and that every worker must make the same runs."""
    done = subprocess.run(command(tmp_path, "--steps", "4", "--fewer", "1"),
                          capture_output=True, text=True, env=ENV, timeout=120)
    assert done.returncode == 1, done.stderr
    said = [ln for ln in done.stderr.splitlines() if ln.startswith("parallax-ng run: worker 1")]
    assert len(said) == 1 and re.search(
        r"exited with code 1: UnavailableError: parallax_ng: worker 1's run of \[.*\] lost "
        "worker 0, which it meets in an exchange: that task ended or failed.*every worker "
        "must make the same runs, in the same order; stopping the job", said[0]), done.stderr


def test_a_worker_blocked_outside_its_steps_is_named(tmp_path):
    """Worker 1 blocks (its heartbeat goes on); worker 0 times out waiting
    for it in a collective, and the launcher names worker 1."""
    job = Job(command(tmp_path, "--block-at", "5"))
    job.wait_for_steps(3)
    started = time.monotonic()
    err = job.finish(120)
    assert job.process.returncode == 1, err
    assert "worker 1 (pid" in err and "outside its training steps for" in err, err
    assert "worker 0 failed waiting for it (DeadlineExceededError" in err
    assert time.monotonic() - started < TIMEOUT + 10
    job.assert_all_gone()


def test_a_task_killed_by_a_signal_gives_128_plus_the_signal(tmp_path):
    job = Job(command(tmp_path))
    job.wait_for_steps(3)
    os.kill(job.pids["worker 1"], signal.SIGKILL)
    err = job.finish(60)
    assert job.process.returncode == 137, err
    assert f"worker 1 (pid {job.pids['worker 1']}) exited with signal 9" in err
    job.assert_all_gone()


def test_a_config_mistake_in_the_tasks_is_one_line_per_job(tmp_path):
    config = {"run_option": "allreduce", "dense_metod": "bfb"}
    done = subprocess.run(command(tmp_path, config=config), capture_output=True, text=True,
                          timeout=120, env=ENV)
    assert done.returncode == 1
    # TensorFlow 2.21 logs a few lines at import (absl, before its logging
    # is set up) whatever TF_CPP_MIN_LOG_LEVEL says; the launcher's are the rest
    lines = [ln for ln in done.stderr.splitlines() if "started" not in ln
             and not re.match(r"(\[\w+ \d+\] )?([IWEF]\d{4} |WARNING: All log messages before "
                              r"absl::InitializeLog)", ln)]
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("parallax-ng run: worker ")
    assert ": ConfigError: unknown config key 'dense_metod'" in lines[0]
    assert "Traceback" not in done.stderr + done.stdout
    verbose = subprocess.run(command(tmp_path, config=config, launcher=("--verbose",)),
                             capture_output=True, text=True, timeout=120, env=ENV)
    assert "Traceback" in verbose.stderr and "ConfigError" in verbose.stderr


@pytest.mark.parametrize("text,says", [
    ("run_option: hybird\n", "config key 'run_option' has value 'hybird'"),
    ("run_option: [allreduce\n", "is not valid YAML at line 2"),
    (None, "does not exist")])
def test_the_config_file_is_checked_before_any_task_starts(tmp_path, text, says):
    path = tmp_path / "c.yaml"
    if text is not None:
        path.write_text(text)
    done = subprocess.run([sys.executable, "-m", "parallax_ng", "run", SCRIPT, "-r",
                           resources(tmp_path), "-c", str(path)], capture_output=True,
                          text=True, timeout=60, env=ENV)
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and says in done.stderr, done.stderr
    assert "started" not in done.stderr


def test_a_port_in_use_names_the_address_and_the_task(tmp_path):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        path = tmp_path / "r.yaml"
        path.write_text(f"hosts:\n  - address: 127.0.0.1\n    devices: [cpu:0]\n"
                        f"  - address: 127.0.0.1:{port}\n    devices: [cpu:0]\n")
        done = subprocess.run([sys.executable, "-m", "parallax_ng", "run", SCRIPT, "-r",
                               str(path)], capture_output=True, text=True, timeout=60,
                              env=ENV)
    assert done.returncode == 2
    assert f"worker 1's address 127.0.0.1:{port} cannot be used" in done.stderr
    assert "started" not in done.stderr


def test_picked_ports_are_free_distinct_and_below_the_ephemeral_range():
    """A port from the ephemeral range that is free when picked may be taken by
    an outgoing connection before its server starts; picked ports stay below it."""
    from parallax_ng.tools import launch
    low = launch._ephemeral_low()
    ports = [launch.free_port() for _ in range(50)]
    assert len(set(ports)) == 50
    assert all(1024 <= p < low for p in ports), (low, ports)
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[0]))       # free indeed
    address = launch._with_port("127.0.0.1")
    assert address.startswith("127.0.0.1:") and int(address.rsplit(":", 1)[1]) < low


def test_a_port_another_launcher_picked_is_not_picked_again(tmp_path, monkeypatch):
    """Launchers in two processes starting jobs together each found a port
    free and picked it for both (CI: a worker registered its graph with
    the other job's task, `unknown device`): a pick is marked in the
    machine's temp dir, and another process skips it until it is old."""
    from parallax_ng.tools import launch
    monkeypatch.setattr(launch.tempfile, "gettempdir", lambda: str(tmp_path))
    port = 23456
    other = subprocess.run(
        [sys.executable, "-c", "import sys, tempfile; tempfile.tempdir = sys.argv[1]; "
         "from parallax_ng.tools import launch; print(launch._reserve(23456))", str(tmp_path)],
        capture_output=True, text=True, timeout=120, env=dict(os.environ, PYTHONPATH=TASK_PATH))
    assert other.stdout.strip() == "True", other.stderr
    assert not launch._reserve(port)                 # the other process's for now
    mark = tmp_path / "parallax_ng_ports" / str(port)
    old = mark.stat().st_mtime - launch.RESERVED_SECONDS - 1
    os.utime(mark, (old, old))
    assert launch._reserve(port) and not launch._reserve(port)    # old: taken, then held


def test_a_task_slow_to_end_after_its_program_is_not_a_stalled_one(tmp_path):
    """A worker whose interpreter takes longer than the job's timeout to end
    after its program (silent: TensorFlow's teardown under load, here an
    object's finalizer) ends the job with 0, not as a task that stopped
    making progress (the launcher had stopped such a job, exit 1)."""
    script = tmp_path / "slow_end.py"
    script.write_text(
        "import time\nimport parallax_ng.runtime.heartbeat as h\nh.set_timeout(2)\n"
        "class Slow:\n    def __del__(self):\n        time.sleep(6)\n"
        "keep = Slow()\ntime.sleep(2.5)\nprint('done', flush=True)\n")   # timeout said
    done = subprocess.run([sys.executable, "-m", "parallax_ng", "run", str(script), "-r",
                           resources(tmp_path)], capture_output=True, text=True, env=ENV,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("done") == 2 and "stopped making progress" not in done.stderr


def test_the_tasks_of_one_machine_share_its_cores(tmp_path):
    """Each task of a job on this machine sizes TensorFlow's thread pools to
    its share of the cores (two workers here), unless the launcher's own
    environment sizes them."""
    script = tmp_path / "pools.py"
    script.write_text("import os\nprint('pools', os.environ.get('TF_NUM_INTEROP_THREADS'), "
                      "os.environ.get('TF_NUM_INTRAOP_THREADS'), flush=True)\n")
    share = max(1, (os.cpu_count() or 1) // 2)
    for given, said in (({}, f"pools {share} {share}"), ({"TF_NUM_INTEROP_THREADS": "3"},
                                                          "pools 3 None")):
        done = subprocess.run([sys.executable, "-m", "parallax_ng", "run", str(script), "-r",
                               resources(tmp_path)], capture_output=True, text=True,
                              env={**ENV, **given}, timeout=120)
        assert done.returncode == 0, done.stderr
        assert done.stdout.count(said) == 2, done.stdout
