"""The fork server (parallax_ng/tools/forking.py): a task forked from it
runs as `python SCRIPT ARGS` (or `python -m MODULE ARGS`) would, and the
launcher sees it as a subprocess.Popen. Real processes: one server that
imported TensorFlow, its forked children."""
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from task_env import TASK_PATH

from parallax_ng.tools.forking import Forker

ENV = dict(os.environ, PYTHONPATH=TASK_PATH, TF_CPP_MIN_LOG_LEVEL="2")
ENV.pop("PARALLAX_NG_FORK_SERVER", None)       # the tests' own (tests/forked.py)

SCRIPT = """\
import json, os, sys
print(json.dumps({"name": __name__, "file": __file__, "argv": sys.argv,
                  "path0": sys.path[0], "cwd": os.getcwd(), "stdin": sys.stdin.read(),
                  "only_task": os.environ.get("ONLY_TASK"),
                  "launcher_only": os.environ.get("LAUNCHER_ONLY")}))
print("to stderr", file=sys.stderr)
sys.exit(int(sys.argv[1]))
"""


@pytest.fixture(scope="module")
def forker():
    f = Forker(dict(ENV, LAUNCHER_ONLY="1"))
    yield f
    f.close()


def spawn(forker, tmp_path, text, *args, env=None, name="task.py"):
    path = tmp_path / name
    path.write_text(text)
    task = forker.spawn([str(path), *args], dict(ENV, **(env or {})), script=str(path))
    assert task is not None, forker.failed
    return task


def test_a_task_runs_as_its_own_python_process_would(forker, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    os.chdir(work)            # the task's working directory is the launcher's now
    try:
        task = spawn(forker, tmp_path, SCRIPT, "3", env={"ONLY_TASK": "yes"})
    finally:
        os.chdir(tmp_path)
    assert task.wait(60) == 3 and task.poll() == 3 and task.returncode == 3
    import json
    seen = json.loads(task.stdout.read())
    path = str(tmp_path / "task.py")
    assert seen == {"name": "__main__", "file": path, "argv": [path, "3"],
                    "path0": str(tmp_path), "cwd": str(work), "stdin": "",
                    "only_task": "yes", "launcher_only": None}
    assert task.stderr.read() == b"to stderr\n"


def test_a_task_runs_in_the_directory_it_is_given(forker, tmp_path):
    work = tmp_path / "given"
    work.mkdir()
    path = tmp_path / "task.py"
    path.write_text(SCRIPT)
    task = forker.spawn([str(path), "0"], ENV, script=str(path), cwd=str(work))
    assert task is not None and task.wait(60) == 0
    import json
    assert json.loads(task.stdout.read())["cwd"] == str(work) != os.getcwd()


def test_an_exception_prints_the_scripts_traceback_and_exits_1(forker, tmp_path):
    task = spawn(forker, tmp_path, "import parallax_ng\n\ndef f():\n    raise ValueError('no')\n"
                 "f()\n", env={"PARALLAX_NG_HEARTBEAT": "worker 0"})
    assert task.wait(60) == 1
    err = task.stderr.read().decode()
    # the heartbeat started with the task (parallax_ng is imported by it, not the server)
    assert "\x1eparallax_ng error worker 0: ValueError: no" in err
    trace = err[err.index("Traceback"):]
    assert trace.splitlines()[1].startswith(f'  File "{tmp_path / "task.py"}", line 5')
    assert "forking.py" not in trace and "runpy" not in trace


def test_the_scripts_globals_live_until_its_atexit_handlers_ran(forker, tmp_path):
    """As in `python SCRIPT`: `__main__` stays in sys.modules, so an atexit
    handler that reaches a global through a weak reference finds it (the
    runner's final checkpoint, parallax_ng/runtime/runner.py)."""
    task = spawn(forker, tmp_path, "import atexit, sys, weakref\nclass Held: pass\n"
                 "held = Held()\nref = weakref.ref(held)\n"
                 "atexit.register(lambda: print('at exit', ref() is not None, "
                 "sys.modules['__main__'].held is ref(), flush=True))\n")
    assert task.wait(60) == 0
    assert task.stdout.read() == b"at exit True True\n"


def test_signals_reach_the_tasks_process_group(forker, tmp_path):
    task = spawn(forker, tmp_path, "import time\nprint('up', flush=True)\ntime.sleep(60)\n")
    assert task.stdout.readline() == b"up\n"
    assert os.getpgid(task.pid) == task.pid          # a session and group of its own
    with pytest.raises(subprocess.TimeoutExpired):
        task.wait(0.3)
    assert task.poll() is None
    os.killpg(task.pid, signal.SIGKILL)
    assert task.wait(10) == -signal.SIGKILL


def test_keras_and_random_state_are_the_tasks_own(forker, tmp_path):
    """Only TensorFlow is imported before the fork: a script that sets
    TF_USE_LEGACY_KERAS before importing it gets tf_keras; numpy's and
    random's generators differ between tasks."""
    text = ("import os\nos.environ['TF_USE_LEGACY_KERAS'] = '1'\n"
            "import random, numpy as np, tensorflow as tf\n"
            "print(tf.keras.__name__.split('.')[0], np.random.randint(1 << 30), "
            "random.randrange(1 << 30))\n")
    tasks = [spawn(forker, tmp_path, text) for _ in range(2)]
    outs = [t.stdout.read().split() for t in tasks]
    assert [t.wait(60) for t in tasks] == [0, 0]
    assert outs[0][0] == outs[1][0] == b"tf_keras"
    assert outs[0][1] != outs[1][1] and outs[0][2] != outs[1][2]


def test_a_module_runs_as_python_m_would(forker, tmp_path):
    (tmp_path / "pn_forked_mod.py").write_text(
        "import sys\nprint(__name__, sys.argv[1:], sys.path[0])\n")
    os.chdir(tmp_path)
    task = forker.spawn(["pn_forked_mod", "a", "b"], ENV, module="pn_forked_mod")
    assert task.wait(60) == 0
    assert task.stdout.read().decode().split() == ["__main__", "['a',", "'b']", str(tmp_path)]


def test_a_package_runs_its_main_as_python_m_would(forker, tmp_path):
    package = tmp_path / "pn_forked_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "__main__.py").write_text(
        "import sys\nfrom . import __name__ as parent\nprint(__name__, parent, sys.argv[1:])\n")
    task = forker.spawn(["pn_forked_pkg", "x"], ENV, module="pn_forked_pkg", cwd=str(tmp_path))
    assert task.wait(60) == 0, task.stderr.read()
    assert task.stdout.read().decode().split() == ["__main__", "pn_forked_pkg", "['x']"]


def test_when_the_server_dies_its_tasks_end_and_spawn_says_none(tmp_path):
    f = Forker(ENV)
    try:
        task = spawn(f, tmp_path, "import time\nprint('up', flush=True)\ntime.sleep(60)\n")
        assert task.stdout.readline() == b"up\n"
        f.process.kill()
        assert task.wait(10) == -signal.SIGKILL
        assert _gone(task.pid)
        assert f.failed == "the fork server ended"
        assert f.spawn(["x.py"], ENV, script="x.py") is None
    finally:
        f.close()


def test_a_server_that_stops_forking_leaves_its_tasks_running(tmp_path):
    """A live server that refuses a request (it found threads it cannot
    fork with) makes `spawn` say None from then on; the tasks it started
    run on and their ends are still reported."""
    f = Forker(ENV)
    try:
        go = tmp_path / "go"
        task = spawn(f, tmp_path, "import os, time\nfor _ in range(600):\n"
                     f"    if os.path.exists({str(go)!r}): break\n    time.sleep(0.05)\n"
                     "print('done', flush=True)\n")
        f._fail("2 threads in the fork server", kill=False)     # as its reply would
        assert f.spawn(["x.py"], ENV, script="x.py") is None
        assert task.poll() is None and _gone(task.pid, 0.5) is False
        go.touch()
        assert task.stdout.readline() == b"done\n" and task.wait(10) == 0
    finally:
        f.close()


def test_closing_the_server_kills_what_it_started(tmp_path):
    f = Forker(ENV)
    task = spawn(f, tmp_path, "import time\nprint('up', flush=True)\ntime.sleep(60)\n")
    assert task.stdout.readline() == b"up\n"
    f.close()
    assert f.process.returncode == 0
    assert _gone(task.pid)


def test_a_server_that_cannot_import_tensorflow_says_why(tmp_path):
    (tmp_path / "tensorflow.py").write_text("raise ImportError('broken on purpose')\n")
    f = Forker(dict(ENV, PYTHONPATH=f"{tmp_path}{os.pathsep}{TASK_PATH}"))
    try:
        assert f.spawn(["x.py"], ENV, script="x.py") is None
        assert f.failed == "importing TensorFlow: ImportError: broken on purpose"
    finally:
        f.close()


def _gone(pid: int, seconds: float = 10) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
            if open(f"/proc/{pid}/stat").read().split()[2] == "Z":   # ended, not yet reaped
                return True
        except (ProcessLookupError, FileNotFoundError):   # (reaped between the two)
            return True
        time.sleep(0.05)
    return False



def test_launchers_share_one_server_and_each_ones_tasks_end_with_it(tmp_path):
    """A server started with `share` forks the tasks of every launcher that
    connects at its address; a launcher that goes away takes its own tasks
    with it, and the others' run on and are reported."""
    server = Forker(ENV, share=True)
    env = dict(ENV, PARALLAX_NG_FORK_SERVER=server.address)
    a, b = Forker.shared(env), Forker.shared(env)
    try:
        assert a is not None and b is not None and a.process is None
        go = tmp_path / "go"
        sleeper = spawn(a, tmp_path, "import time\nprint('up', flush=True)\ntime.sleep(60)\n")
        waiter = spawn(b, tmp_path, "import os, time\nfor _ in range(600):\n"
                       f"    if os.path.exists({str(go)!r}): break\n    time.sleep(0.05)\n"
                       "print(os.getppid(), flush=True)\n", name="waiter.py")
        assert sleeper.stdout.readline() == b"up\n"
        a.close()
        assert _gone(sleeper.pid)
        go.touch()
        assert waiter.stdout.readline() == f"{server.process.pid}\n".encode()
        assert waiter.wait(10) == 0
        own = spawn(server, tmp_path, "print('own')\n", name="own.py")
        assert own.wait(30) == 0 and own.stdout.read() == b"own\n"
    finally:
        b.close()
        server.close()
    assert not os.path.exists(server.address)


def test_a_shared_server_is_used_only_where_its_environment_is_the_launchers(tmp_path):
    server = Forker(ENV, share=True)
    try:
        env = dict(ENV, PARALLAX_NG_FORK_SERVER=server.address)
        assert Forker.shared(ENV) is None                         # none named
        assert Forker.shared(dict(env, PARALLAX_NG_FORK_SERVER=str(tmp_path / "no"))) is None
        for differs in ({"TF_ENABLE_ONEDNN_OPTS": "0"}, {"PYTHONPATH": str(tmp_path)},
                        {"PYTHONHASHSEED": "7"}):   # read by the import or the interpreter
            assert Forker.shared(dict(env, **differs)) is None, differs
        for key in ("TF_CPP_MIN_LOG_LEVEL", "PYTHONPATH"):
            assert Forker.shared({k: v for k, v in env.items() if k != key}) is None, key
        same = Forker.shared(dict(env, TF_USE_LEGACY_KERAS="0", ONLY_LAUNCHER="1"))
        assert same is not None       # tf.keras resolves in the task; the rest is the task's
        same.close()
    finally:
        server.close()


def test_a_job_takes_its_tasks_from_the_shared_server(tmp_path):
    """`parallax-ng run` with PARALLAX_NG_FORK_SERVER set forks its worker
    from that server; without it the launcher starts a server of its own."""
    script = tmp_path / "job.py"
    script.write_text("import os\nprint('parent', os.getppid(), flush=True)\n")
    resources = tmp_path / "r.yaml"
    resources.write_text("hosts:\n  - address: 127.0.0.1\n    devices: [cpu:0]\n")
    server = Forker(ENV, share=True)
    try:
        cmd = [sys.executable, "-m", "parallax_ng", "run", str(script), "-r", str(resources)]
        parents = []
        for env in (dict(ENV, PARALLAX_NG_FORK_SERVER=server.address, PYTHONUNBUFFERED="1"),
                    {k: v for k, v in ENV.items() if k != "PARALLAX_NG_FORK_SERVER"}):
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
            assert done.returncode == 0, done.stderr[-2000:]
            parents.append(int(re.search(r"\[worker 0\] parent (\d+)", done.stdout).group(1)))
        assert parents[0] == server.process.pid
        assert parents[1] != server.process.pid
        # a server task too (it had imported TensorFlow in a process of its own)
        script.write_text(
            "import os\n"
            "def ppid(pid):\n"
            "    try:\n"
            "        with open(f'/proc/{pid}/stat') as f:\n"
            "            return int(f.read().rsplit(')', 1)[1].split()[1])\n"
            "    except OSError:\n"
            "        return -1\n"
            "print('siblings', [int(p) for p in os.listdir('/proc') if p.isdigit() and "
            "int(p) != os.getpid() and ppid(p) == os.getppid()], flush=True)\n")
        resources.write_text(resources.read_text() + "ps: [127.0.0.1]\n")
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                              env=dict(ENV, PARALLAX_NG_FORK_SERVER=server.address))
        assert done.returncode == 0, done.stderr[-2000:]
        ps = int(re.search(r"started ps 0 \(pid (\d+)\)", done.stderr + done.stdout).group(1))
        assert ps in eval(re.search(r"siblings (\[.*\])", done.stdout).group(1)), done.stdout
    finally:
        server.close()
