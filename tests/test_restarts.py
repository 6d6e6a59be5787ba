"""`parallax-ng run --restarts N`: a job whose task dies or hangs starts again
from its last checkpoint and ends with the variables of an uninterrupted job;
a user's mistake is not retried."""
import os
import re
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from task_env import TASK_PATH

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "resume_script.py")
ENV = dict(os.environ, PYTHONPATH=TASK_PATH, TF_CPP_MIN_LOG_LEVEL="2")
STEPS, KILL_AT, EVERY = 200, 100, 30
# the server always used (hybrid could find all-gather faster for the table and stop it)
TIMEOUT = '{"communication": {"timeout_seconds": 8}, "sparse_method": "ps"}'


class Launched:
    """`parallax-ng run ...` with its output read as it comes (both pipes
    drained by threads), so a test can act when a line appears."""

    def __init__(self, argv, cwd=None):
        self.lines: list[str] = []
        self._new = threading.Condition()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "parallax_ng", "run", *argv], env=ENV, cwd=cwd,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        self._readers = [threading.Thread(target=self._read, args=(pipe,), daemon=True)
                         for pipe in (self.process.stdout, self.process.stderr)]
        for t in self._readers:
            t.start()

    def _read(self, pipe):
        for line in pipe:
            with self._new:
                self.lines.append(line.rstrip("\n"))
                self._new.notify_all()

    def wait_for(self, pattern: str, timeout: float = 180) -> re.Match:
        """The first line matching `pattern` (searched from the start)."""
        deadline, seen = time.monotonic() + timeout, 0
        with self._new:
            while True:
                for line in self.lines[seen:]:
                    found = re.search(pattern, line)
                    if found:
                        return found
                seen = len(self.lines)
                left = deadline - time.monotonic()
                if left <= 0 or self.process.poll() is not None and not self._alive():
                    raise AssertionError(f"no line matches {pattern!r}; output:\n"
                                         + "\n".join(self.lines[-60:]))
                self._new.wait(min(left, 1.0))

    def _alive(self) -> bool:
        return any(t.is_alive() for t in self._readers)

    def pid(self, task: str) -> int:
        """The process id of `task` as last started."""
        self.wait_for(rf"started {task} \(pid \d+\)")
        with self._new:
            started = [m for m in (re.search(rf"started {task} \(pid (\d+)\)", line)
                                   for line in self.lines) if m]
        return int(started[-1].group(1))

    def finish(self, timeout: float = 300) -> int:
        try:
            code = self.process.wait(timeout)
        finally:
            if self.process.poll() is None:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(10)
        for t in self._readers:
            t.join(10)
        return code

    def text(self) -> str:
        return "\n".join(self.lines)


def resources(tmp_path, servers: int = 1) -> str:
    res = tmp_path / "r.yaml"
    res.write_text("hosts:\n" + "  - address: 127.0.0.1\n    devices: [cpu:0]\n" * 2
                   + (f"ps: [{', '.join(['127.0.0.1'] * servers)}]\n" if servers else ""))
    return str(res)


def script_args(ckpt: str, out: str, hold: str | None = None) -> list[str]:
    """Seeded dropout: a restarted job draws on where the checkpoint's
    streams were (transforms/counted_draws.py). With `hold`, the workers of
    the first run wait after step KILL_AT until that file exists, so the
    test's signal lands at that step however fast the steps go."""
    return ["--", ckpt, out, str(STEPS), "--run-option", "hybrid", "--every", str(EVERY),
            "--print-steps", "--dropout", "0.3", "--config", TIMEOUT,
            *(["--hold-at", str(KILL_AT), "--hold-file", hold] if hold else [])]


def variables(prefix: str) -> dict:
    out = {}
    for w in (0, 1):
        with np.load(f"{prefix}.{w}.npz") as d:
            out.update({f"{w}/{k}": d[k] for k in d.files})
    return out


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The variables of the job run through, without restarts, its tasks
    started as processes of their own (--no-fork): the restarted jobs'
    forked tasks (tools/forking.py) must end bit for bit equal to them."""
    tmp = tmp_path_factory.mktemp("whole")
    job = Launched(["-r", resources(tmp), "--no-fork", SCRIPT, *script_args(str(tmp / "ck"),
                                                                 str(tmp / "whole"))])
    assert job.finish() == 0, job.text()[-3000:]
    return variables(str(tmp / "whole"))


@pytest.mark.parametrize("task, how", [("worker 1", signal.SIGKILL), ("ps 0", signal.SIGKILL),
                                       ("worker 1", signal.SIGSTOP)],
                         ids=["killed-worker", "killed-server", "stopped-worker"])
def test_a_job_restarted_after_a_lost_task_equals_an_uninterrupted_one(
        tmp_path, uninterrupted, task, how):
    """Worker 1 SIGKILLed, the server SIGKILLed, worker 1 SIGSTOPped (found
    by its silence) at step 100 of 200: the launcher names the task, stops
    every task, starts the job again from the last checkpoint (step 90,
    every 30 steps), says when it trains again, and the job ends with every
    variable of every replica equal to the uninterrupted job's, bit for bit."""
    ck, out = str(tmp_path / "ck"), str(tmp_path / "out")
    hold = tmp_path / "go"
    job = Launched(["-r", resources(tmp_path), "--restarts", "1", SCRIPT,
                    *script_args(ck, out, str(hold))])
    job.wait_for(rf"^\[worker 1\] step {KILL_AT}$")
    os.kill(job.pid(task), how)
    hold.touch()
    code = job.finish()
    text = job.text()
    assert code == 0, text[-4000:]
    assert re.search(rf"restart 1 of 1: {task} failed; every task starts again and the job "
                     rf"resumes from step 90 \({re.escape(ck)}/model.ckpt-90\)", text), text
    assert len(re.findall(r"training again \(step 91, worker \d\) [\d.]+ s after the failure",
                          text)) == 1
    for w in (0, 1):
        assert f"[worker {w}] parallax_ng: restored step 90 from {ck}/model.ckpt-90" in text
    got = variables(out)
    assert set(got) == set(uninterrupted) and len(got) > 10
    for key, value in uninterrupted.items():
        np.testing.assert_array_equal(got[key], value, err_msg=key)


def test_a_users_mistake_is_not_restarted(tmp_path):
    """A ConfigError in the script ends the job at once, however many
    restarts were allowed."""
    bad = tmp_path / "bad.py"
    bad.write_text("import parallax_ng as pn\n"
                   "pn.get_runner(None, None, {'run_option': 'nonsense'})\n")
    job = Launched(["-r", resources(tmp_path, servers=0), "--restarts", "3", "--run-dir",
                    str(tmp_path / "run"), str(bad)])
    code = job.finish(120)
    text = job.text()
    assert code != 0
    assert "run_option" in text and "restart 1 of" not in text, text


def test_restarts_must_be_a_count(tmp_path):
    job = Launched(["-r", resources(tmp_path, servers=0), "--restarts", "-1", SCRIPT])
    assert job.finish(60) == 2
    assert "--restarts must be a count of 0 or more, not -1" in job.text()


def checkpoint_step(ck: str) -> int:
    with open(os.path.join(ck, "checkpoint")) as f:
        return int(f.readline().split('"')[1].rsplit("-", 1)[1])


def test_sigterm_to_the_launcher_checkpoints_a_step_every_worker_reaches(tmp_path,
                                                                         uninterrupted):
    """SIGTERM to the launcher at step 100: both workers save step 101 or
    102 (one past the last step any of them was at when it heard) and stop,
    the launcher exits 143; a rerun resumes there and ends equal to the
    uninterrupted job."""
    ck, out = str(tmp_path / "ck"), str(tmp_path / "out")
    hold = tmp_path / "go"
    job = Launched(["-r", resources(tmp_path), SCRIPT, *script_args(ck, out, str(hold))])
    job.wait_for(rf"^\[worker 1\] step {KILL_AT}$")
    os.kill(job.process.pid, signal.SIGTERM)
    job.wait_for("the launcher got SIGTERM: passed on to every worker")
    hold.touch()
    assert job.finish() == 143, job.text()[-3000:]
    text = job.text()
    saved = checkpoint_step(ck)
    assert saved in (KILL_AT + 1, KILL_AT + 2), text[-3000:]
    assert "the launcher got SIGTERM: passed on to every worker" in text
    assert f"the job stopped at step {saved} with a checkpoint of it" in text
    for w in (0, 1):
        assert f"[worker {w}] parallax_ng: stopped at step {saved} after SIGTERM" in text
        assert checkpoint_step(f"{ck}/inputs/worker-{w}") == saved
    again = Launched(["-r", resources(tmp_path), SCRIPT, *script_args(ck, out)])
    assert again.finish() == 0, again.text()[-3000:]
    assert f"[worker 0] parallax_ng: restored step {saved} from {ck}/model.ckpt-{saved}" in \
        again.text()
    got = variables(out)
    for key, value in uninterrupted.items():
        np.testing.assert_array_equal(got[key], value, err_msg=key)


@pytest.mark.parametrize("task", ["worker 1", "ps 0"])
def test_sigterm_to_a_task_checkpoints_and_the_job_restarts(tmp_path, uninterrupted, task):
    """A preemption's SIGTERM to one task (a worker, or the server, which
    serves on while the workers save): every worker saves step 101 or 102
    and stops; with --restarts 1 the job starts again from there and ends
    equal to the uninterrupted job."""
    ck, out = str(tmp_path / "ck"), str(tmp_path / "out")
    hold = tmp_path / "go"
    job = Launched(["-r", resources(tmp_path), "--restarts", "1", SCRIPT,
                    *script_args(ck, out, str(hold))])
    job.wait_for(rf"^\[worker 1\] step {KILL_AT}$")
    os.kill(job.pid(task), signal.SIGTERM)
    job.wait_for(f"{task} got SIGTERM: passed on to every worker")
    hold.touch()
    code = job.finish()
    text = job.text()
    assert code == 0, text[-4000:]
    found = re.search(r"the job stopped at step (\d+) with a checkpoint of it", text)
    assert found, text[-4000:]
    saved = int(found.group(1))
    assert saved in (KILL_AT + 1, KILL_AT + 2)
    assert f"{task} got SIGTERM: passed on to every worker" in text
    assert (f"restart 1 of 1: {task} got SIGTERM; every task starts again and the job "
            f"resumes from step {saved} ({ck}/model.ckpt-{saved})") in text
    got = variables(out)
    for key, value in uninterrupted.items():
        np.testing.assert_array_equal(got[key], value, err_msg=key)


def test_sigterm_in_one_process_saves_the_step_and_exits_143(tmp_path):
    """In-process (this machine's devices): SIGTERM during training saves
    the step it lands after and ends the script with exit code 143; a rerun
    resumes there."""
    ck, out = str(tmp_path / "ck"), str(tmp_path / "out")
    hold = tmp_path / "go"
    process = subprocess.Popen([sys.executable, SCRIPT, ck, out, "400", "--every", "1000",
                                "--print-steps", "--hold-at", "20", "--hold-file", str(hold)],
                               env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
    for line in process.stdout:
        if line.strip() == "step 20":
            process.send_signal(signal.SIGTERM)
            hold.touch()
            break
    _, err = process.communicate(timeout=120)
    assert process.returncode == 143, err[-3000:]
    stopped = re.search(r"parallax_ng: stopped at step (\d+) after SIGTERM", err)
    assert stopped, err[-3000:]
    assert 20 < int(stopped.group(1)) <= 22 and checkpoint_step(ck) == int(stopped.group(1))


def test_a_host_that_fails_twice_is_replaced_by_a_spare(tmp_path):
    """Worker 1's host (127.0.0.2) dies at step 11 on every start: after its
    second failure the spare (127.0.0.3, the same devices) takes its place,
    the job keeps two replicas and ends equal to an uninterrupted job. The
    script's config names no checkpoint.dir: the launcher gives one under
    the run directory."""
    res = tmp_path / "r.yaml"
    res.write_text("hosts:\n  - address: 127.0.0.1\n    devices: [cpu:0]\n"
                   "  - address: 127.0.0.2\n    devices: [cpu:0]\n"
                   "spares:\n  - address: 127.0.0.3\n    devices: [cpu:0]\n")
    args = ["--run-option", "allreduce", "--every", "5"]
    whole = Launched(["-r", str(res), SCRIPT, "--", str(tmp_path / "ck_whole"),
                      str(tmp_path / "whole"), "15", *args])
    assert whole.finish() == 0, whole.text()[-3000:]
    run, out = tmp_path / "run", str(tmp_path / "out")
    job = Launched(["-r", str(res), "--restarts", "2", "--run-dir", str(run), SCRIPT, "--",
                    "-", out, "15", *args, "--die-at", "11", "--die-on-host", "127.0.0.2"])
    code = job.finish()
    text = job.text()
    assert code == 0, text[-4000:]
    ck = run / "checkpoints"
    assert f"checkpoints go to {ck}" in text
    assert (f"restart 1 of 2: worker 1 failed; every task starts again and the job resumes "
            f"from step 10 ({ck}/model.ckpt-10)") in text
    assert "worker 1's host 127.0.0.2 failed 2 times; spare 127.0.0.3 takes its place" in text
    assert "restart 2 of 2: worker 1 failed" in text
    assert re.search(r"started worker 1 \(pid \d+\) at 127\.0\.0\.3:\d+", text)
    got, expected = variables(out), variables(str(tmp_path / "whole"))
    assert set(got) == set(expected)
    for key, value in expected.items():
        np.testing.assert_array_equal(got[key], value, err_msg=key)


def test_runs_tensorflow_refused_as_repeats_do_not_replace_a_host(tmp_path):
    """Worker 1 on 127.0.0.2 ends at step 11 of every start with the error
    of a run TensorFlow's runtime refused as a repeated request (which any
    host meets by chance): the launcher restarts the job, but its host is
    not counted as failing, so no spare takes its place."""
    res = tmp_path / "r.yaml"
    res.write_text("hosts:\n  - address: 127.0.0.1\n    devices: [cpu:0]\n"
                   "  - address: 127.0.0.2\n    devices: [cpu:0]\n"
                   "spares:\n  - address: 127.0.0.3\n    devices: [cpu:0]\n")
    job = Launched(["-r", str(res), "--restarts", "2", "--run-dir", str(tmp_path / "run"),
                    SCRIPT, "--", "-", str(tmp_path / "out"), "15", "--run-option",
                    "allreduce", "--every", "5", "--die-at", "11", "--die-on-host",
                    "127.0.0.2", "--die-as", "refused"])
    code = job.finish()
    text = job.text()
    assert code == 1, text[-4000:]
    assert "refused this run as a repeat of an earlier request" in text
    assert "restart 1 of 2: worker 1 failed" in text and "restart 2 of 2: worker 1 failed" in text
    assert "takes its place" not in text
    assert not re.search(r"started worker 1 \(pid \d+\) at 127\.0\.0\.3", text)
